"""Identity types Monarch exports from ``monarch.actor``: ``Uid`` and ``ProcId``
(``ChannelTransport`` is defined with the config names, in ``_monarch_config``).

A :class:`Uid` is either a *singleton* (just a label, e.g. ``service``) or an
*instance*: a 64-bit value with an optional label, written ``label<value>`` or
``<value>`` with the value in base58 (the Flickr alphabet, as Monarch writes
it: ``Uid.instance_from_value(12, "service")`` is ``service<d>``). A
:class:`ProcId` names a proc by its uid; ``str`` and ``from_string`` round-trip
and both types pickle by their string.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from .._monarch_config import ChannelTransport

__all__ = ["ChannelTransport", "Uid", "ProcId"]

_ALPHABET = "123456789abcdefghijkmnopqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ"
_DIGIT = {c: i for i, c in enumerate(_ALPHABET)}
_LABEL = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_MAX = (1 << 64) - 1


def _encode(value: int) -> str:
    if value == 0:
        return _ALPHABET[0]
    out = []
    while value:
        value, digit = divmod(value, 58)
        out.append(_ALPHABET[digit])
    return "".join(reversed(out))


def _decode(text: str, whole: str) -> int:
    value = 0
    for c in text:
        if c not in _DIGIT:
            raise ValueError(f"invalid uid {whole!r}: {c!r} is not a base58 digit")
        value = value * 58 + _DIGIT[c]
    if value > _MAX:
        raise ValueError(f"invalid uid {whole!r}: the value does not fit in 64 bits")
    return value


def _check_label(label: Any, what: str) -> str | None:
    if label is None:
        return None
    if not isinstance(label, str) or not _LABEL.fullmatch(label):
        raise ValueError(f"invalid {what} label {label!r}: use letters, digits, '_', '-' and '.' (not starting with '-' or '.')")
    return label


class Uid:
    """A unique identifier: a singleton label, or an instance value with an optional label."""

    __slots__ = ("_label", "_value")

    def __init__(self, label: str | None, value: int | None, _token: object = None) -> None:
        if _token is not _PRIVATE:
            raise TypeError("use Uid.anonymous(), Uid.instance(label), Uid.instance_from_value(v, label) or Uid.from_string(s)")
        self._label = label
        self._value = value

    @staticmethod
    def anonymous() -> Uid:
        """A fresh instance uid without a label."""
        return Uid(None, secrets.randbits(64), _PRIVATE)

    @staticmethod
    def instance(label: str | None = None) -> Uid:
        """A fresh instance uid (random 64-bit value) with an optional display label."""
        return Uid(_check_label(label, "uid"), secrets.randbits(64), _PRIVATE)

    @staticmethod
    def instance_from_value(value: int, label: str | None = None) -> Uid:
        """An instance uid with an explicit 64-bit value."""
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX:
            raise ValueError(f"a uid value must be an int in [0, 2**64), got {value!r}")
        return Uid(_check_label(label, "uid"), value, _PRIVATE)

    @staticmethod
    def singleton(label: str) -> Uid:
        """The singleton uid named ``label``."""
        if label is None:
            raise ValueError("a singleton uid needs a label")
        return Uid(_check_label(label, "uid"), None, _PRIVATE)

    @staticmethod
    def from_string(uid: str) -> Uid:
        """Parse ``label``, ``label<value>`` or ``<value>`` (raises ValueError)."""
        if not isinstance(uid, str):
            raise TypeError(f"Uid.from_string() needs a str, got {uid!r}")
        m = re.fullmatch(r"([^<>]*)(?:<([^<>]*)>)?", uid)
        if m is None or (m.group(2) is None and not m.group(1)):
            raise ValueError(f"invalid uid {uid!r}: expected 'label', 'label<value>' or '<value>'")
        label = m.group(1) or None
        _check_label(label, "uid")
        if m.group(2) is None:
            return Uid(label, None, _PRIVATE)
        if not m.group(2):
            raise ValueError(f"invalid uid {uid!r}: empty value between '<' and '>'")
        return Uid(label, _decode(m.group(2), uid), _PRIVATE)

    @property
    def label(self) -> str | None:
        """The display label (None for an anonymous instance)."""
        return self._label

    @property
    def is_instance(self) -> bool:
        """True for an instance uid (it has a value)."""
        return self._value is not None

    @property
    def is_singleton(self) -> bool:
        """True for a singleton uid (a label only)."""
        return self._value is None

    @property
    def instance_value(self) -> int | None:
        """The 64-bit value of an instance uid; None for a singleton."""
        return self._value

    def __str__(self) -> str:
        if self._value is None:
            return self._label or ""
        return f"{self._label or ''}<{_encode(self._value)}>"

    def __repr__(self) -> str:
        return f"Uid({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Uid) and (self._label, self._value) == (other._label, other._value)

    def __hash__(self) -> int:
        return hash((self._label, self._value))

    def __reduce__(self) -> tuple[Any, ...]:
        return (Uid.from_string, (str(self),))


_PRIVATE = object()


class ProcId:
    """The identity of a proc: a :class:`Uid`. ``str`` is the uid's string."""

    __slots__ = ("_uid",)

    def __init__(self, uid: Uid) -> None:
        if not isinstance(uid, Uid):
            raise TypeError(f"ProcId(uid) needs a Uid, got {uid!r}")
        self._uid = uid

    @staticmethod
    def from_string(proc_id: str) -> ProcId:
        """Parse a proc id (the uid forms of :meth:`Uid.from_string`)."""
        return ProcId(Uid.from_string(proc_id))

    @property
    def uid(self) -> Uid:
        """The proc's uid."""
        return self._uid

    @property
    def label(self) -> str | None:
        """The uid's label."""
        return self._uid.label

    def __str__(self) -> str:
        return str(self._uid)

    def __repr__(self) -> str:
        return f"ProcId({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcId) and self._uid == other._uid

    def __hash__(self) -> int:
        return hash(("proc", self._uid))

    def __reduce__(self) -> tuple[Any, ...]:
        return (ProcId.from_string, (str(self),))
