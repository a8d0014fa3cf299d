"""Which runtime and actor the current code runs in.

The controller's runtime starts lazily on first use (``context()``, a spawn, a
channel): a root client actor named ``client`` in this process, an ``atexit``
hook that stops every child proc. In a worker the runtime is set by the worker
entry point before any actor runs.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from typing import Any

from ._actor import Context, Instance, _context
from ._proc import ProcRuntime

__all__ = ["current_runtime", "runtime_started", "start_client", "set_runtime", "context", "shutdown_context", "current_actor_name", "enable_transport"]

_runtime: ProcRuntime | None = None
_client_context: Context | None = None
_lock = threading.Lock()


def _client_display() -> str | None:
    ctx = _client_context
    return None if ctx is None else repr(ctx.actor_instance)


def _install(rt: ProcRuntime) -> None:
    from . import _cell, _log_prefix, _stats, _supervision

    _log_prefix.install(_client_display)
    _cell.install(rt)
    _stats.install(rt)
    _supervision.install(rt)


def set_runtime(rt: ProcRuntime) -> None:
    """Make ``rt`` this process's runtime (worker entry point)."""
    global _runtime, _client_context
    _install(rt)
    _runtime = rt
    _client_context = Context(Instance(runtime=rt, name=rt.name, display=f"<{rt.name}>", rank=None, class_name="proc"))


def runtime_started() -> bool:
    """Whether this process's runtime is running already (starting it fixes its secret)."""
    return _runtime is not None


def current_runtime(*, secret: bytes | None = None, tls: Any = None) -> ProcRuntime:
    """This process's runtime, starting the controller's on first use.

    ``secret`` (and ``tls``, a ``JobTLS``) are the job credentials to start
    with, for jobs whose agents hold them; they are ignored when the runtime
    already runs: compare ``rt.secret``.
    """
    rt = _runtime
    if rt is not None:
        return rt
    start_client(lambda: ProcRuntime(name="client", secret=secret, tls=tls))
    assert _runtime is not None
    return _runtime


def start_client(make: Callable[[], ProcRuntime]) -> ProcRuntime | None:
    """Start the controller's runtime with ``make()`` unless one runs already.

    Returns the new runtime, or None when this process's runtime had started
    (then ``make`` is not called). ``make`` raising leaves no runtime behind.
    """
    with _lock:
        if _runtime is not None:
            return None
        rt = make()
        set_runtime(rt)
        _client_context.actor_instance._display = "<root>"  # type: ignore[union-attr]
        atexit.register(_shutdown_at_exit)
        return rt


def context() -> Context:
    """The current actor's context; on the controller, the root client's."""
    ctx = _context.get()
    if ctx is not None:
        return ctx
    current_runtime()
    assert _client_context is not None
    return _client_context


def current_actor_name() -> str:
    """The current actor's id as a string."""
    return context().actor_instance.actor_id


def _shutdown_at_exit() -> None:
    shutdown_context()


def shutdown_context() -> Any:
    """Stop every proc this process spawned and close its runtime (idempotent).

    Returns a completed Future, for Monarch compatibility.
    """
    global _runtime, _client_context
    from ._future import Future
    from ._spawn import kill_all_children

    with _lock:
        rt, _runtime = _runtime, None
        _client_context = None
    if rt is not None:
        for cell in list(rt.actors.values()):
            cell.stop(None)
        kill_all_children(rt)
        rt.close()
    return Future._completed(None)


_TRANSPORT_NAMES = {"tcp": "tcp", "ipc": "unix", "unix": "unix", "tls": "tcp", "Tls": "tcp", "TcpWithLocalhost": "tcp", "TcpWithHostname": "tcp", "Unix": "unix"}


def enable_transport(transport: Any) -> None:
    """Choose the channel transport before first use.

    Accepts a :class:`ChannelTransport` or a string: ``"unix"``/``"ipc"``
    (default), ``"tcp"`` (``TcpWithHostname``/``TcpWithLocalhost``) or
    ``"tls"`` (tcp with mutual TLS on the job's own CA). Enabling the
    transport already in use is a no-op; a different one after the runtime
    started raises RuntimeError (Monarch's rule).
    """
    from ..config import configure, get_config
    from ._ids import ChannelTransport

    key = transport.name if isinstance(transport, ChannelTransport) else transport
    if not isinstance(key, str):
        raise TypeError(f"enable_transport() takes a ChannelTransport or a string like 'tcp', got {transport!r}")
    if key in _UNSUPPORTED_TRANSPORTS or "://" in key:
        raise ValueError(f"transport {transport!r} is not available in actormesh: {_UNSUPPORTED_TRANSPORTS.get(key, _EXPLICIT_ADDRESS)}")
    name = _TRANSPORT_NAMES.get(key)
    if name is None:
        raise ValueError(f"unknown transport {transport!r}; use ChannelTransport.Unix/TcpWithHostname/Tls or 'unix', 'ipc', 'tcp', 'tls'")
    tls = key in ("tls", "Tls")
    rt = _runtime
    if rt is not None:
        if rt.transport != name or (tls and rt.tls is None):
            raise RuntimeError(f"the runtime already runs on {rt.transport!r}; enable_transport() must come before any other use")
        return
    cfg = get_config()
    if cfg.default_transport != name or (tls and not cfg.tls):
        configure(default_transport=name, **({"tls": True} if tls else {}))


_EXPLICIT_ADDRESS = "listeners bind to config bind_host on free ports; give 'tcp' and configure(bind_host=...)"
_UNSUPPORTED_TRANSPORTS = {
    "Local": "in-process channels only; actormesh procs are separate processes (use 'unix')",
    "local": "in-process channels only; actormesh procs are separate processes (use 'unix')",
    **{k: "Meta-internal TLS/QUIC; use ChannelTransport.Tls (mutual TLS on the job's own CA)"
       for k in ("MetaTlsWithHostname", "MetaTlsWithIpV6", "MetaQuicWithHostname", "MetaQuicWithIpV6", "Quic",
                 "metatls", "metatls-hostname", "quic")},
}
