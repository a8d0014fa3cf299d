"""``get_or_spawn_controller``: process-wide singleton actors that live in the controller.

The root (controller) keeps one actor mesh per name; workers ask the root with a
SINGLETON message and get the mesh back, so every caller shares one actor.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, TypeVar

from ..runtime import Future, check_actor_class, current_runtime, messages as M
from ..transport import dumps
from ._actor_mesh import RESERVED_NAMES, ActorMesh
from ._proc_mesh import this_proc

if TYPE_CHECKING:
    from ..runtime import ProcRuntime

__all__ = ["get_or_spawn_controller", "install_singleton_handler"]

T = TypeVar("T")

_singletons: dict[str, ActorMesh[Any]] = {}
_singleton_lock = threading.Lock()


def _root_get_or_spawn(name: str, Class: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ActorMesh[Any]:
    with _singleton_lock:
        mesh = _singletons.get(name)
        if mesh is not None:
            record = mesh._record
            if record is not None and record.failed:
                cause = next(iter(record.failed.values()))
                raise ValueError(f"Failure on {name}: {cause}")
        if mesh is None:
            mesh = this_proc().spawn(name, Class, *args, **kwargs)  # type: ignore[assignment]
            _singletons[name] = mesh
        return mesh


def get_or_spawn_controller(name: str, Class: type[T], *args: Any, **kwargs: Any) -> Future[T]:
    """A process-wide singleton actor keyed by ``name``, living in the controller.

    The first call spawns it (arguments used once); later calls, from the
    controller or any actor, return the same actor.
    """
    rt = current_runtime()
    if rt.root_address == rt.address:
        return Future.completed(_root_get_or_spawn(name, Class, args, kwargs))
    check_actor_class(Class, RESERVED_NAMES)
    from ..runtime import StreamPort

    port = StreamPort(rt, f"get_or_spawn_controller({name!r})", [rt.root_address])
    rt.ask_singleton(name, (rt.address, port.port_id), dumps((Class, args, kwargs)))
    return port.futures[0]


def install_singleton_handler(rt: ProcRuntime) -> None:
    """Serve get_or_spawn_controller requests from workers, if ``rt`` is a root.

    Called by the code that makes a root's workers (spawning procs, starting a host
    agent) before the first of them exists; a no-op for a non-root or a second call.
    """
    if rt.root_address != rt.address or rt.handlers.singleton is not None:
        return

    def on_singleton(env: Any, payload: Any) -> None:
        from ..transport import loads

        name, reply = env.name, env.reply

        def work() -> None:
            try:
                Class, args, kwargs = loads(payload)
                mesh = _root_get_or_spawn(name, Class, args, kwargs)
                rt.reply(reply, 0, M.OK, dumps(mesh))
            except Exception as exc:
                import traceback

                rt.reply(reply, 0, M.ERROR, dumps((exc, traceback.format_exc())))

        rt.threads.start(work, name="actormesh-singleton")  # it may block (a spawn): off the loop, owned by rt

    rt.handlers.singleton = on_singleton
