"""Gateways: how a client that procs cannot dial (one outside the cluster's
network, reaching it through a port-forward) still takes part in a job, over one
connection it opens itself. This is the serving side of Monarch's ``attach``;
the client side is ``_attached.py``.

Theory of operation
-------------------
The client dials a gateway (a host agent's listener: the address its worker
loop serves) and says HELLO with ``("attach", uid)``. The gateway names it
``via:<uid>@<gateway address>`` and answers HELLO with that name; every ref the
client makes (reply ports, owners) carries it. That one connection, the
*duplex*, then carries frames both ways:

- client -> gateway: ``[envelope, destination, *payload]``. The gateway passes
  ``[envelope, *payload]`` on over one *leg* per (client, destination), or
  dispatches it itself when the destination is the gateway's own address.
- gateway -> client: ordinary frames, and ``(RELAY_LOST, address, reason)``
  when a leg to ``address`` closed or could not be opened (the client fails
  what that peer owed it, as it would on losing a direct connection).

A leg the gateway dials for the client says HELLO with the client's via name,
so the proc answers over it. A proc that must reach the client first (a port
it was handed) routes ``via:<uid>@G`` by dialing G with HELLO ``("to", uid)``.
Either way procs never dial the client.

Order: one sender's frames to one receiver take one path. Client to proc: the
duplex, then the one leg used for that proc (frames that wait for the leg's dial
go first). Proc to client: the proc's one route connection, then the duplex.
Authentication: every connection here ran the job secret's handshake.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ResourceExhaustedError, TransportError
from ..transport import Connection, LostPayload, Segment, connect
from . import _messages as M
from ._lost import error_payload
from ._routes import Route

if TYPE_CHECKING:
    from ._proc import ProcRuntime

log = logging.getLogger("actormesh.gateway")

__all__ = ["Gateway", "serve_gateway", "via_address", "split_via", "dial_plan", "refuse_relay", "ATTACH", "TO"]

VIA = "via:"
#: HELLO's relay request of a client attaching, and of a proc dialing a client's via name.
ATTACH = "attach"
TO = "to"
_UID = re.compile(r"[0-9a-f]{8,64}")
Envelope = Any  # a Message of any kind: code here branches on its .kind, which a type checker cannot narrow


def via_address(uid: str, gateway: str) -> str:
    """The name of client ``uid`` attached to the gateway at ``gateway``."""
    return f"{VIA}{uid}@{gateway}"


def split_via(address: str) -> tuple[str, str] | None:
    """``(uid, gateway address)`` of a via name; None for an ordinary address."""
    if not address.startswith(VIA):
        return None
    uid, sep, gateway = address[len(VIA):].partition("@")
    if not sep or not _UID.fullmatch(uid) or not gateway:
        raise ValueError(f"bad gateway-routed address {address!r}: expected 'via:<uid>@<gateway address>'")
    return uid, gateway


def dial_plan(address: str) -> tuple[str, tuple[Any, ...]]:
    """Where to dial for a route to ``address``, and what HELLO adds to ask for a relay."""
    via = split_via(address)
    if via is None:
        return address, ()
    return via[1], ((TO, via[0]),)


def refuse_relay(conn: Connection, env: Envelope) -> None:
    """What a process that is no gateway answers a relay request (it then closes)."""
    log.warning("refusing a relay request from %s: this process is no gateway", conn.peer_name)
    _refuse(conn, "this process is not a gateway: attach to the address of a worker started with run_worker_loop_forever")


def _refuse(conn: Connection, why: str) -> None:
    try:
        conn.send([M.encode(M.Hello(M.HELLO, "", 0, why))])
    except TransportError:
        return
    conn.close()


def serve_gateway(runtime: ProcRuntime) -> Gateway:
    """Make ``runtime`` (a host agent's) accept attached clients on its listener."""
    gateway = Gateway(runtime)
    runtime.handlers.relay = gateway.on_hello
    return gateway


class Gateway:
    """Relays between attached clients and the procs of the job (loop thread only)."""

    def __init__(self, runtime: ProcRuntime) -> None:
        self.runtime = runtime
        self.sessions: dict[str, _Session] = {}

    def on_hello(self, conn: Connection, env: Envelope) -> None:
        """A connection's HELLO asked for a relay: take the connection over."""
        request = env.extra
        ok = type(request) is tuple and len(request) == 2 and request[0] in (ATTACH, TO)
        uid = request[1] if ok else None
        if not ok or type(uid) is not str or not _UID.fullmatch(uid):
            log.warning("closing connection from %s: malformed relay request %r", conn.peer_name, request)
            conn.abort()
            return
        if request[0] == ATTACH:
            if uid in self.sessions:
                _refuse(conn, f"a client named {uid} is attached already")
                return
            self.sessions[uid] = session = _Session(self, uid, conn, env.pid)
            session.start()
            return
        attached = self.sessions.get(uid)
        if attached is None:  # that client detached: the proc learns it as a lost connection
            _refuse(conn, f"no client {via_address(uid, self.runtime.address)} is attached to this gateway")
            return
        attached.leg_in(conn, env.address)


class _Session:
    """One attached client: its duplex and its legs to procs."""

    def __init__(self, gateway: Gateway, uid: str, conn: Connection, client_pid: int) -> None:
        self.gateway = gateway
        self.rt = gateway.runtime
        self.uid = uid
        self.conn = conn
        self.client_pid = client_pid
        self.address = via_address(uid, self.rt.address)
        #: destination -> the leg the client's frames to it take (one, for their order)
        self.legs: dict[str, Connection] = {}
        #: destination -> frames waiting for its leg's dial
        self.dialing: dict[str, list[list[Segment]]] = {}
        self.all_legs: set[Connection] = set()
        self.closed = False

    def start(self) -> None:
        self.conn.send([M.encode(M.Hello(M.HELLO, self.address, self.rt.pid, None))])
        self.conn.tag = self.address
        self.conn.rebind(on_frame=self.from_client, on_close=self.client_closed)
        # The gateway's own messages to the client (replies, host-agent events) take the duplex.
        route = self.rt.route(self.address)
        if isinstance(route, Route):  # a client's via address is never the gateway's own
            route.publish(self.conn)
        log.info("client %s (pid %s) attached from %s", self.address, self.client_pid, self.conn.peer_name)

    # -- client -> procs ------------------------------------------------------------------
    def from_client(self, conn: Connection, segments: list[Segment]) -> None:
        if len(segments) < 2:
            log.warning("closing the duplex of %s: a frame without a destination", self.address)
            conn.abort()
            return
        env_bytes, dest = segments[0], segments[1]
        if type(dest) is LostPayload:  # we ran out taking it in: fail that one message
            env = M.decode(env_bytes)
            exc = ResourceExhaustedError(f"gateway {self.rt.name} (pid {self.rt.pid}) {dest.error}", getattr(dest.error, "resource", ""))
            self.rt._fail_reply(env, M.ERROR, error_payload(exc))
            log.warning("a %r message relayed from %s lost its payload: %s", type(env).__name__, self.address, exc)
            return
        destination = bytes(dest).decode()
        if destination == self.rt.address:
            self.rt.route(destination).send(M.decode(env_bytes), segments[2:])
            return
        self.forward(destination, [env_bytes, *segments[2:]])

    def forward(self, destination: str, frame: list[Segment]) -> None:
        leg = self.legs.get(destination)
        if leg is not None:
            try:
                leg.send(frame)
            except TransportError as exc:
                self._undeliverable([frame], destination, f"lost connection to the process at {destination}: {exc}")
            return
        waiting = self.dialing.get(destination)
        if waiting is not None:
            waiting.append(frame)
            return
        self.dialing[destination] = [frame]
        asyncio.ensure_future(self._dial(destination))

    async def _dial(self, destination: str) -> None:
        rt = self.rt
        try:
            target, relay = dial_plan(destination)
            leg = await connect(
                target,
                rt.secret,
                on_frame=lambda c, s: self.from_proc(destination, s),
                on_close=lambda c, e: self.leg_closed(destination, c),
                max_frame_bytes=rt.config.codec_max_frame_length,
                handshake_timeout_s=rt.config.handshake_timeout,
                timeout_s=rt.config.connect_timeout,
                ssl_context=rt._client_ssl if target.startswith("tcp:") else None,
                shm=rt.shm,
                bulk_lane_bytes=rt.config.bulk_lane_bytes,
            )
        except Exception as exc:  # whatever it was, the waiting frames fail: none may hang
            reason = f"the process at {destination} is unreachable from the gateway at {rt.address}: {type(exc).__name__}: {exc}"
            self._undeliverable(self.dialing.pop(destination, []), destination, reason)
            self.lost(destination, reason)
            return
        if self.closed:
            leg.close()
            return
        leg.tag = destination
        self.all_legs.add(leg)
        # Says it is the client: the proc answers over this leg, and never dials the client.
        leg.send([M.encode(M.Hello(M.HELLO, self.address, self.client_pid, None, relay[0] if relay else None))])
        for frame in self.dialing.pop(destination, []):
            leg.send(frame)
        self.legs[destination] = leg

    def _undeliverable(self, frames: Sequence[list[Segment]], destination: str, reason: str) -> None:
        for frame in frames:
            self.rt.undeliverable(M.decode(frame[0]), destination, reason)

    # -- procs -> client ------------------------------------------------------------------
    def leg_in(self, conn: Connection, source: str) -> None:
        """A proc dialed this client's via name: relay what it sends."""
        conn.rebind(on_frame=lambda c, s: self.from_proc(source, s), on_close=lambda c, e: self.leg_closed(source, c))
        self.all_legs.add(conn)
        if source not in self.legs and source not in self.dialing:
            self.legs[source] = conn

    def from_proc(self, source: str, segments: list[Segment]) -> None:
        if len(segments) == 2 and type(segments[1]) is LostPayload:
            self._lost_payload(source, segments[0], segments[1].error)
            return
        try:
            self.conn.send(segments)
        except TransportError:
            pass  # the client is gone: client_closed tells everyone

    def _lost_payload(self, source: str, env_bytes: Segment, error: Any) -> None:
        """A frame for the client lost its payload here: the client gets an error in its place."""
        env = M.decode(env_bytes)
        exc = ResourceExhaustedError(f"gateway {self.rt.name} (pid {self.rt.pid}) {error}", getattr(error, "resource", ""))
        log.warning("a %r message from %s to %s lost its payload: %s", type(env).__name__, source, self.address, exc)
        if env.kind == M.REPLY:
            self.rt.reply((self.address, env.port), env.slot, M.ERROR, error_payload(exc))
        elif env.kind == M.REPLY_MULTI:
            for index, _status, _n in env.entries:
                self.rt.reply((self.address, env.port), index, M.ERROR, error_payload(exc))
        else:
            self.rt._fail_reply(env, M.ERROR, error_payload(exc))

    def leg_closed(self, peer: str, conn: Connection) -> None:
        self.all_legs.discard(conn)
        if self.legs.get(peer) is conn:
            del self.legs[peer]
        if not self.closed:
            self.lost(peer, f"lost connection to the process at {peer} (relayed by the gateway at {self.rt.address})")

    def lost(self, peer: str, reason: str) -> None:
        try:
            self.conn.send([M.encode(M.RelayLost(M.RELAY_LOST, peer, reason))])
        except TransportError:
            pass

    # -- the client leaves ----------------------------------------------------------------
    def client_closed(self, conn: Connection, exc: BaseException | None) -> None:
        if self.closed:
            return
        self.closed = True
        self.gateway.sessions.pop(self.uid, None)
        for leg in list(self.all_legs):
            leg.close()  # procs see their route to the client lost
        self.all_legs.clear()
        self.legs.clear()
        self.dialing.clear()  # their replies would go to the client, who is gone
        reason = f"the attached client {self.address} disconnected from the gateway" + (f": {exc}" if exc else "")
        log.info("%s", reason)
        if not self.rt.closed:
            self.rt.peer_gone(self.address, reason)  # a host agent stops the procs it left behind
