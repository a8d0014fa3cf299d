"""Import alias: ``monarch`` and ``monarch.<x>`` resolve to ``actormesh`` and ``actormesh.<x>``.

This is the only glue between Monarch's test files and actormesh. It maps module
names and nothing else: no attribute is added, renamed or wrapped, so a name that
actormesh lacks fails the test that uses it (``ImportError``/``AttributeError``),
and a module that actormesh lacks fails with a ``ModuleNotFoundError`` naming both
the Monarch module and the actormesh module it was mapped to.

``install()`` puts the finder first on ``sys.meta_path``. It runs from
``sitecustomize`` (so worker processes that inherit ``PYTHONPATH`` get it too) and
from the pytest plugin entry (``-p monarch_alias``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

SOURCE = "monarch"
TARGET = "actormesh"


def _target_name(fullname: str) -> str | None:
    """The actormesh module name for a Monarch module name, or None if not Monarch's."""
    if fullname == SOURCE:
        return TARGET
    if fullname.startswith(SOURCE + "."):
        return TARGET + fullname[len(SOURCE) :]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Hands back the already-imported actormesh module under the Monarch name."""

    def __init__(self, module: ModuleType) -> None:
        self._module = module
        self._spec = module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self._module

    def exec_module(self, module: ModuleType) -> None:
        # importlib stamped the alias spec on the shared module object; the
        # actormesh module keeps its own identity (pickling, reload, tracebacks).
        module.__spec__ = self._spec


class MonarchAliasFinder(importlib.abc.MetaPathFinder):
    """Resolves ``monarch[.x]`` to the module object ``actormesh[.x]``."""

    def find_spec(self, fullname, path=None, target=None):  # type: ignore[override]
        target_name = _target_name(fullname)
        if target_name is None:
            return None
        try:
            module = importlib.import_module(target_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and _is_prefix(exc.name, target_name):
                raise ModuleNotFoundError(
                    f"No module named {fullname!r} (monarch alias: actormesh has no module {exc.name!r})",
                    name=fullname,
                ) from None
            raise
        return importlib.machinery.ModuleSpec(
            fullname, _AliasLoader(module), is_package=hasattr(module, "__path__")
        )


def _is_prefix(missing: str, wanted: str) -> bool:
    """True when the missing module is ``wanted`` or one of its parents."""
    return wanted == missing or wanted.startswith(missing + ".")


def install() -> None:
    """Put the alias finder first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, MonarchAliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MonarchAliasFinder())


install()
