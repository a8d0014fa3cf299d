"""The client side of Monarch's ``attach``: a controller runtime whose traffic
all goes through one connection it opened to a gateway (see ``_gateway.py`` for
the protocol), for a client the job's procs cannot dial.

It listens on nothing. Its address is the via name the gateway gave it; every
route to another process is that one duplex with the destination stamped on
each frame. Losing the duplex fails everything every peer owed this client.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any, cast

from ..errors import AuthenticationError, Cause, TransportError
from ..transport import Connection, JobTLS, LostPayload, Segment, connect
from . import _messages as M
from ._gateway import ATTACH
from ._jobdir import remove_job_dir
from ._lost import payload_lost
from ._proc import ProcRuntime
from ._routes import LocalRoute, Route

log = logging.getLogger("actormesh.runtime")

__all__ = ["AttachedRuntime", "attach_gateway"]

LOCAL_SPAWN_REFUSED = ("this client is attached to the gateway at {gateway} (attach()): it cannot spawn procs on its own "
                       "machine, whose procs would be unreachable from the job; spawn them on the attached hosts "
                       "(the HostMesh from attach_to_workers())")


class _DuplexLeg:
    """A route's connection stand-in: frames go over the duplex, stamped with their destination."""

    __slots__ = ("_duplex", "_destination", "tag")

    def __init__(self, duplex: Connection, destination: str) -> None:
        self._duplex = duplex
        self._destination = destination.encode()
        self.tag = destination

    def send(self, segments: Sequence[Segment], *, wait_flushed: bool = False, order_key: Any = None) -> Any:
        return self._duplex.send([segments[0], self._destination, *segments[1:]], wait_flushed=wait_flushed,
                                 order_key=None if order_key is None else (self._destination, order_key))

    @property
    def last_rx(self) -> float:
        return self._duplex.last_rx

    @property
    def flush_scheduled(self) -> bool:
        return self._duplex.flush_scheduled

    @property
    def closed(self) -> bool:
        return self._duplex.closed

    def close(self) -> None:
        pass  # the duplex is shared: the runtime closes it once (_Duplex.close)

    def abort(self) -> None:
        """A peer behind the gateway fell silent (runtime/_links.py): every peer is behind
        this one duplex, so the duplex goes, and with it what every peer owed us."""
        self._duplex.abort()


class _Duplex:
    """Stands in for the listener an attached client does not have: closing the runtime closes the duplex."""

    def __init__(self, conn: Connection, gateway: str) -> None:
        self.conn = conn
        self.address = gateway

    def close(self) -> None:
        self.conn.close()


class AttachedRuntime(ProcRuntime):
    """A controller runtime attached to the gateway at ``gateway`` (an address
    like ``tcp:host:port``). Starting it dials the gateway (bounded by
    ``connect_timeout`` and ``handshake_timeout``) and raises ``TransportError``
    (``AuthenticationError`` for a wrong secret) with what to check if that fails.
    """

    attached_via: str  # never None here

    def __init__(self, gateway: str, *, secret: bytes, tls: JobTLS | None = None, name: str = "client") -> None:
        self.attached_via = gateway
        #: Why every peer is unreachable once the duplex is lost (routes made later fail with it too).
        self._gateway_lost: Cause | None = None
        try:
            super().__init__(secret=secret, name=name, tls=tls)
        except BaseException:
            self._abandon()
            raise

    def _abandon(self) -> None:
        """Undo a start that failed: nothing of this runtime may stay behind."""
        loop_thread = getattr(self, "loop_thread", None)
        if loop_thread is not None:
            loop_thread.stop()
        shm = getattr(self, "shm", None)
        if shm is not None:
            shm.close()
        if getattr(self, "owns_job_dir", False):
            remove_job_dir(self.job_dir)

    def __repr__(self) -> str:
        return f"<AttachedRuntime {self.name} at {getattr(self, 'address', '?')} via {self.attached_via}>"

    async def _listen(self, root_address: str | None) -> Any:
        gateway = self.attached_via
        acked: asyncio.Future[Any] = self.loop.create_future()

        def first_frame(conn: Connection, segments: list[Segment]) -> None:
            conn.rebind(on_frame=self._on_gateway_frame, on_close=self._on_gateway_close)
            try:
                env = M.decode(segments[0])
            except Exception as exc:
                env = exc
            if not acked.done():
                acked.set_result(env)

        def closed_early(conn: Connection, exc: BaseException | None) -> None:
            if not acked.done():
                acked.set_exception(TransportError(f"attach({gateway!r}): the gateway closed the connection before accepting this client"))

        try:
            conn = await connect(
                gateway,
                self.secret,
                on_frame=first_frame,
                on_close=closed_early,
                max_frame_bytes=self.config.codec_max_frame_length,
                handshake_timeout_s=self.config.handshake_timeout,
                timeout_s=self.config.connect_timeout,
                ssl_context=self._client_ssl if gateway.startswith("tcp:") else None,
                shm=self.shm,
                dead_after_s=self.config.link_timeout,
                bulk_lane_bytes=self.config.bulk_lane_bytes,
            )
        except AuthenticationError as exc:
            raise AuthenticationError(f"attach({gateway!r}): the gateway did not accept this job's secret: {exc} "
                                      "(set ACTORMESH_SECRET_FILE to the file its workers were started with)") from exc
        except (TransportError, OSError) as exc:
            raise TransportError(f"attach({gateway!r}): cannot reach the gateway: {exc} (is a worker started with "
                                 "run_worker_loop_forever listening there, e.g. at the local end of a port-forward?)") from exc
        conn.send([M.encode(M.Hello(M.HELLO, "", self.pid, None, (ATTACH, os.urandom(8).hex())))])
        try:
            env = await asyncio.wait_for(acked, self.config.handshake_timeout)
        except asyncio.TimeoutError:
            conn.close()
            raise TransportError(f"attach({gateway!r}): the process there did not accept the attach within "
                                 f"{self.config.handshake_timeout:.0f}s; attach to the address of a worker started with run_worker_loop_forever") from None
        except TransportError:
            conn.close()
            raise
        if type(env) is not M.Hello or env.error is not None or not env.address:
            conn.close()
            why = env.error if type(env) is M.Hello and env.error else f"unexpected answer {env!r}"
            raise TransportError(f"attach({gateway!r}): the gateway refused this client: {why}")
        self.address = self.root_address = env.address
        self._routes[self.address] = LocalRoute(self, self.address, self._dispatch)
        log.info("attached to the gateway at %s as %s", gateway, self.address)
        return _Duplex(conn, gateway)

    # -- routes: everything goes over the duplex ------------------------------------------
    def route(self, address: str) -> Route | LocalRoute:
        """The route to ``address``: over the duplex (created on first use)."""
        r = self._routes.get(address)
        if r is None:
            with self._routes_lock:
                r = self._routes.get(address) or self._dead.get(address)
                if r is None:
                    r = Route(self, address)
                    if self._gateway_lost is not None:
                        r.fail(self._gateway_lost)
                    else:
                        # _listen() returned a _Duplex (this runtime listens on nothing); the leg stands in
                        # for the Connection a route publishes (send, last_rx, closed, abort)
                        duplex = cast(_Duplex, self._listener)
                        r.publish(_DuplexLeg(duplex.conn, address))  # type: ignore[arg-type]
                    self._routes[address] = r
        return r

    def start_dial(self, route: Route) -> None:
        """Never dials: a route without the duplex is one whose gateway is gone."""
        self.loop.call_soon_threadsafe(self.peer_gone, route.address, self._gateway_lost or "no gateway connection")

    def _on_gateway_frame(self, conn: Connection, segments: list[Segment]) -> None:
        try:
            env = M.decode(segments[0])
        except Exception as exc:
            log.warning("dropping a frame from the gateway at %s: bad envelope (%s)", self.attached_via, exc)
            return
        if env.kind == M.RELAY_LOST:
            self.peer_gone(env.address, env.reason)
        elif len(segments) == 2 and type(segments[1]) is LostPayload:
            payload_lost(self, env, segments[1].error)
        else:
            self._dispatch(env, segments[1:], None)

    def _on_gateway_close(self, conn: Connection, exc: BaseException | None) -> None:
        if self.closed:
            return
        reason = f"lost the connection to the gateway at {self.attached_via}" + (f": {exc}" if exc else "")
        log.error("%s: this attached client can reach no proc any more", reason)
        # A Cause, not bare text: routes made from now on fail with it (route()), and a call
        # to one must raise ActorUnreachableError as a call to an existing one does.
        self._gateway_lost = lost = Cause.of(reason)
        for address, r in list(self._routes.items()):
            if isinstance(r, Route):
                self.peer_gone(address, lost)


def attach_gateway(gateway: str, *, secret: bytes, tls: JobTLS | None = None) -> ProcRuntime:
    """Start this process's controller runtime attached to the gateway at ``gateway``.

    Raises RuntimeError when the runtime has started already (it cannot be
    re-routed: refs made so far carry its address), TransportError when the
    gateway cannot be reached or refuses.
    """
    from ._context import start_client

    rt = start_client(lambda: AttachedRuntime(gateway, secret=secret, tls=tls))
    if rt is None:
        raise RuntimeError("attach() must be called before the first actor call or context() in this process: "
                           "its actormesh runtime has started already (refs made so far carry its address). "
                           "Call attach(addr) first thing, before attach_to_workers() and any spawn.")
    return rt
