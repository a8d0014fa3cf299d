"""A process's peers: dialing one, and what happens when one is gone.

``ProcRuntime`` delegates here (its methods of the same names are thin). A peer
is gone when dialing it fails, when its connection closes (for a child proc:
when its spawner reports its exit status, or after a grace period without one),
or when a liveness verdict or an agent's report says so. Then, in this order:
its route is marked dead with the :class:`~actormesh.errors.Cause` (late sends
fail at once), supervision hooks hear of it (unless it was expected), every
reply it owed fails, and the per-peer tables forget it (its route stays as a
bounded tombstone).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from ..errors import AuthenticationError, Cause, CauseKind, TransportError
from ..transport import Connection, connect
from . import _messages as M
from ._gateway import dial_plan
from ._routes import LocalRoute, Route

if TYPE_CHECKING:
    from ._proc import ProcRuntime

log = logging.getLogger("actormesh.runtime")

__all__ = ["dial", "hello", "connection_closed", "peer_gone", "revive", "table_sizes", "MAX_TOMBSTONES"]

#: Dead peers remembered so that late sends to them fail at once (oldest forgotten first).
MAX_TOMBSTONES = 1024


def _unreachable(text: str, error: BaseException | None = None) -> Cause:
    return Cause(text, CauseKind.UNREACHABLE, error=error)


async def dial(rt: ProcRuntime, route: Route) -> None:
    """Connect ``route`` (loop thread); a failure makes its peer gone, UNREACHABLE."""
    try:
        target, relay = dial_plan(route.address)  # a client's via name: dial its gateway
        conn = await connect(
            target,
            rt.secret,
            on_frame=rt._on_frame,
            on_close=rt._on_close,
            max_frame_bytes=rt.config.codec_max_frame_length,
            handshake_timeout_s=rt.config.handshake_timeout,
            timeout_s=rt.config.connect_timeout,
            ssl_context=rt._client_ssl if target.startswith("tcp:") else None,
            shm=rt.shm,
            dead_after_s=rt.config.link_timeout,
            bulk_lane_bytes=rt.config.bulk_lane_bytes,
        )
    except AuthenticationError as exc:
        peer_gone(
            rt,
            route.address,
            _unreachable(f"authentication failed: this handle belongs to another job (the process at {route.address} "
                         f"does not share this controller's job secret; use a mesh handle only inside the job that made it): {exc}", exc),
        )
        return
    except (TransportError, OSError) as exc:
        peer_gone(rt, route.address, _unreachable(f"the process at {route.address} is unreachable: {exc}", exc))
        return
    except Exception as exc:  # anything else must still fail the route's waiters, never strand them
        log.exception("dialing %s failed", route.address)
        peer_gone(rt, route.address, _unreachable(f"the process at {route.address} is unreachable: {type(exc).__name__}: {exc}", exc))
        return
    conn.tag = route.address
    extra = relay[0] if relay else (M.RESTART if route.restart else None)
    conn.send([M.encode(M.Hello(M.HELLO, rt.address, rt.pid, rt.hello_error, extra))])
    route.publish(conn)


def hello(rt: ProcRuntime, conn: Connection, env: M.Hello) -> None:
    """A peer identified itself on a connection it dialed (loop thread).

    With RESTART it had given us up as unreachable and begins anew (a healed
    partition): what either side numbered before is void, and the connection it
    used before, if we still hold it, is replaced (its close, whenever we see
    it, is then no longer this peer's loss).
    """
    address = env.address
    restart = env.extra == M.RESTART
    if restart:
        rt._reorder.forget(address)
        rt.seq_out.forget(address)
        rt.cast_tables.forget(address)
    r = rt.route(address)
    if r.dead is not None and revive(rt, address, restart=False):
        r = rt.route(address)  # it was only unreachable, and is back
    elif restart and isinstance(r, Route) and r.conn is not None and r.conn is not conn:
        old = r.replace(conn)
        if old is not None:
            old.abort()
        return
    if isinstance(r, Route):
        r.publish(conn)  # no-op if we already dialed them ourselves


def connection_closed(rt: ProcRuntime, conn: Connection) -> None:
    """A connection closed (loop thread): its peer is gone, or, for a child proc,
    will be once its spawner knows how it ended."""
    address = conn.tag
    if address is None or rt.closed:
        return
    r = rt._routes.get(address)
    if isinstance(r, Route) and r.conn is conn:
        if r.child or r.reported():
            # The spawner (this process, or the proc's host agent) learns the exit status
            # and reports it (see _spawn, mesh/_host_agent). Until then messages queue on
            # the route, so they fail with that status and not a bare "connection lost";
            # a status that never comes still fails them, and so does the agent's loss.
            r.hold()
            grace = 2 * rt.config.heartbeat_timeout + 5.0
            rt.loop.call_later(grace, _child_silent, rt, address, r, grace)
            return
        peer_gone(rt, address, _unreachable(f"lost connection to the process at {address}"))


def _child_silent(rt: ProcRuntime, address: str, route: Route, waited: float) -> None:
    if route.dead is None and route.conn is None and rt._routes.get(address) is route:
        peer_gone(rt, address, _unreachable(f"lost connection to the process at {address} (no exit status after {waited:.0f}s)"))


def peer_gone(rt: ProcRuntime, address: str, reason: str, expected: bool = False) -> None:
    """See :meth:`ProcRuntime.peer_gone`."""
    reason = Cause.of(reason)
    r = rt._routes.get(address) or rt._dead.get(address)
    if isinstance(r, LocalRoute):
        return  # this very process
    if r is None:
        r = Route(rt, address)
    pending = r.fail(reason)  # marks the route dead first
    if address in rt._expected_gone:
        rt._expected_gone.discard(address)
        expected = True
    first = address not in rt._dead  # else supervision already heard (e.g. bootstrap failure, then exit)
    if first:
        rt._dead[address] = r
        for hook in [] if expected else list(rt.handlers.peer_lost):
            try:
                hook(address, reason)
            except Exception:
                log.exception("peer-lost hook failed")
    for env, _ in pending:
        rt.undeliverable(env, address, reason)
    for handler in list(rt._waiting_on.pop(address, ())):
        handler.peer_lost(address, reason)
    if first:
        _forget(rt, address, r)
        _reporter_gone(rt, address, reason)


def _reporter_gone(rt: ProcRuntime, agent: str, reason: Cause) -> None:
    """The host agent at ``agent`` is gone: its procs held for its report fail now."""
    if agent not in rt.reporters:
        return  # not an agent: nothing waits for its word (no scan of every route per lost peer)
    rt.reporters.discard(agent)
    held = [a for a, r in list(rt._routes.items()) if type(r) is Route and r.reporter == agent and r.held and r.dead is None]
    for address in held:
        peer_gone(rt, address, _unreachable(f"lost connection to the process at {address}, and its host agent at {agent} "
                                             f"is gone too ({reason})"))


def _forget(rt: ProcRuntime, address: str, route: Route) -> None:
    """Prune what this process kept about a peer that is gone (loop thread).

    Its route stays as a tombstone (bounded) so that late sends fail fast;
    everything else keyed by it goes, so the tables do not grow with every
    proc ever spawned.
    """
    with rt._routes_lock:
        if rt._routes.get(address) is route:
            del rt._routes[address]
        while len(rt._dead) > MAX_TOMBSTONES:
            rt._dead.popitem(last=False)
    rt.seq_out.forget(address)
    rt._reorder.forget(address)
    rt.cast_tables.forget(address)
    links = getattr(rt, "links", None)
    if links is not None:
        links.forget(address)
    rt._waiting_on.pop(address, None)
    owned = rt.owned_meshes
    if owned:
        for name, record in list(owned.items()):
            if address in record.addresses and not any(_live(rt, a) for a in record.addresses):
                del owned[name]  # every member's proc is gone: it can fail no more
    if route.child and address.startswith("unix:"):
        path = address[5:]
        if os.path.dirname(path) == rt.job_dir:  # a socket we named; its proc may have been killed
            try:
                os.unlink(path)
            except OSError:
                pass


def revive(rt: ProcRuntime, address: str, restart: bool = True) -> bool:
    """Forget that ``address`` was unreachable, so it may be reached again (any thread).

    Only an UNREACHABLE tombstone is lifted (a partition healed, an agent came
    back): a process that exited or was killed stays gone. Sequence numbers
    start afresh: we forgot the peer when we gave it up, and our HELLO says
    RESTART so that the peer forgets us too, even if it has not yet seen the
    old connection close.
    """
    with rt._routes_lock:
        r = rt._dead.get(address)
        if r is None or r.dead is None or getattr(r.dead, "kind", None) is not CauseKind.UNREACHABLE:
            return False
        del rt._dead[address]
        fresh = rt._routes[address] = Route(rt, address)
        fresh.restart = restart  # our HELLO will tell the peer to drop what it kept of us
    return True


def _live(rt: ProcRuntime, address: str) -> bool:
    r = rt._routes.get(address)
    return r is not None and r.dead is None


def table_sizes(rt: ProcRuntime) -> dict[str, int]:
    """Entries in a process's per-peer tables (diagnostics; tests check nothing leaks)."""
    return {
        "routes": len(rt._routes),
        "tombstones": len(rt._dead),
        "seq_out": len(rt.seq_out),
        "reorder": len(rt._reorder._streams),
        "cast_tables": len(rt.cast_tables),
        "waiting_on": len(rt._waiting_on),
        "early": len(rt._early),
        "ports": len(rt.ports),
        "children": len(rt.children),
        "owned_meshes": len(rt.owned_meshes),
    }
