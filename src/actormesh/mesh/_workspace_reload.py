"""``sync_workspace(..., auto_reload=True)`` in the procs: reload the modules whose
files changed, and update the old classes and functions in place so that
objects made before the reload (actors already spawned, functions imported with
``from m import f``) run the new code on their next call, as IPython's
``autoreload`` does.

Limits: a function whose closure changed shape, or a class whose base classes
or ``__slots__`` changed, keeps its old definition (new code reaches new
objects only); module-level state is re-initialised by the reload; modules
are reloaded deepest first, then by name, so a module that imports from a
changed sibling sees its new names; deleted modules stay loaded.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import types
from typing import Any

from ..runtime import Actor, endpoint

__all__ = ["WorkspaceReloader", "reload_changed"]

log = logging.getLogger("actormesh.workspace")

_SKIP = frozenset({"__dict__", "__weakref__", "__module__", "__qualname__", "__doc__"})


def _module_name(rel: str) -> str | None:
    if not rel.endswith(".py"):
        return None
    parts = rel[:-3].split(os.sep)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) if parts and all(p.isidentifier() for p in parts) else None


def _update_function(old: Any, new: Any) -> None:
    for attr in ("__code__", "__defaults__", "__kwdefaults__", "__doc__", "__annotations__"):
        try:
            setattr(old, attr, getattr(new, attr))
        except (AttributeError, TypeError, ValueError):  # e.g. a closure of another size: keep the old one
            pass


def _unwrap(obj: Any) -> Any:
    """The plain function behind a method, classmethod, staticmethod or endpoint."""
    obj = getattr(obj, "__func__", obj)
    return getattr(obj, "__wrapped__", obj)


def _update_class(old: type, new: type) -> None:
    for key, value in vars(new).items():
        if key in _SKIP:
            continue
        current = old.__dict__.get(key)
        f_old, f_new = _unwrap(current), _unwrap(value)
        if isinstance(f_old, types.FunctionType) and isinstance(f_new, types.FunctionType):
            _update_function(f_old, f_new)
            if type(current) is not type(value):
                setattr(old, key, value)
            continue
        try:
            setattr(old, key, value)
        except (AttributeError, TypeError):
            pass


def reload_changed(paths: dict[str, str], changed: dict[str, list[str]]) -> list[str]:
    """Reload the loaded modules among ``changed`` files of the synced directories ``paths`` (name -> dir).

    Each synced directory is put on ``sys.path`` if it is not there. Returns the modules reloaded.
    """
    importlib.invalidate_caches()
    todo: list[tuple[int, str]] = []
    for name, root in paths.items():
        if root not in sys.path:
            sys.path.insert(0, root)
        for rel in changed.get(name, []):
            mod = _module_name(rel)
            if mod is None:
                continue
            m = sys.modules.get(mod)
            file = getattr(m, "__file__", None)
            if m is not None and file and os.path.abspath(file).startswith(root + os.sep) and os.path.exists(os.path.join(root, rel)):
                todo.append((-mod.count("."), mod))
    done = []
    for _, mod in sorted(todo):
        module = sys.modules[mod]
        before = dict(vars(module))
        try:
            importlib.reload(module)
        except Exception as exc:
            log.error("auto_reload: reloading %s failed, the old code stays: %s", mod, exc)
            raise
        for key, old in before.items():
            new = vars(module).get(key)
            if old is new or getattr(old, "__module__", None) != mod:
                continue
            if isinstance(old, type) and isinstance(new, type):
                _update_class(old, new)
            elif isinstance(old, types.FunctionType) and isinstance(new, types.FunctionType):
                _update_function(old, new)
        done.append(mod)
    return done


class WorkspaceReloader(Actor):
    """Spawned briefly on a proc mesh after a sync to reload changed modules there."""

    @endpoint
    def reload(self, paths: dict[str, str], changed: dict[str, list[str]]) -> list[str]:
        """See :func:`reload_changed`."""
        return reload_changed(paths, changed)
