"""``actormesh.actor.unhandled_fault_hook``: assigned as in Monarch, kept by the runtime that calls it."""

from __future__ import annotations

from typing import Any

import pytest

import actormesh.actor as am
from actormesh.runtime import default_fault_hook, fault_hook


def test_assigning_the_facade_attribute_sets_the_runtimes_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(am, "unhandled_fault_hook", seen.append)
    assert fault_hook() == seen.append and am.unhandled_fault_hook == seen.append
    from actormesh.actor import unhandled_fault_hook

    assert unhandled_fault_hook == seen.append
    am.unhandled_fault_hook = default_fault_hook
    assert fault_hook() is default_fault_hook
    am.unhandled_fault_hook = None  # type: ignore[assignment]
    assert am.unhandled_fault_hook is default_fault_hook


def test_a_hook_that_cannot_be_called_is_refused_at_once() -> None:
    before = fault_hook()
    with pytest.raises(TypeError, match="unhandled_fault_hook must be a callable"):
        am.unhandled_fault_hook = "print"  # type: ignore[assignment]
    assert fault_hook() is before
