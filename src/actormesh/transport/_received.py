"""What a :class:`~._frames.FrameDecoder` hands out: plain frames (lists of
segments), and the list types that mark the special ones, plus the assembly
of a large frame's segments as its bytes arrive."""

from __future__ import annotations

from typing import Any, Union

Segment = Union[bytes, bytearray, memoryview]


class ShmFrame(list):  # type: ignore[type-arg]
    """A decoded frame flagged ``FLAG_SHM``: segment 0 is the manifest."""

    __slots__ = ()


class LaneFrame(list):  # type: ignore[type-arg]
    """A decoded frame flagged ``FLAG_LANE``: for the connection itself (see _lanes.py)."""

    __slots__ = ()


class LostFrame(list):  # type: ignore[type-arg]
    """A frame whose data could not be received (no memory): ``[envelope]`` and ``error``."""

    __slots__ = ("error",)

    def __init__(self, segments: list[Segment], error: BaseException) -> None:
        super().__init__(segments)
        self.error = error


class Assembly:
    """The segments of one large frame being filled in wire order."""

    __slots__ = ("objs", "views", "flags", "remaining", "_i", "_off", "error", "_scratch")

    def __init__(self, objs: list[Any], views: list[memoryview | None], flags: int, total: int,
                 error: BaseException | None = None, scratch: memoryview | None = None) -> None:
        self.objs, self.views, self.flags, self.remaining = objs, views, flags, total
        self._i = self._off = 0
        self.error = error  # set: a lost frame, only the envelope is kept
        self._scratch = scratch

    def space(self, limit: int) -> memoryview:
        """Writable memory for the next at most ``limit`` bytes (within one segment)."""
        views = self.views
        while True:
            view = views[self._i]
            size = len(view) if view is not None else self.objs[self._i]
            if self._off < size:
                break
            self._i += 1
            self._off = 0
        n = min(limit, size - self._off)
        if view is None:  # discarded: any scratch memory will do
            assert self._scratch is not None
            return self._scratch[: min(n, len(self._scratch))]
        return view[self._off : self._off + n]

    def advance(self, n: int) -> None:
        self._off += n
        self.remaining -= n

    def copy_in(self, data: memoryview) -> None:
        pos, total = 0, len(data)
        while pos < total:
            dst = self.space(total - pos)
            k = len(dst)
            dst[:] = data[pos : pos + k]
            self.advance(k)
            pos += k

    def frame(self) -> list[Segment]:
        if self.error is not None:
            env = self.views[0]
            return LostFrame([env if env is not None else b""], self.error)
        return ShmFrame(self.objs) if self.flags else self.objs
