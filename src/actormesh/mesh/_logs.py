"""Worker stdout/stderr at the controller: forwarded, prefixed, aggregated.

Spawners (the controller for local procs, host agents for remote ones) read
their procs' output line by line and hand each line to the controller's
:class:`LogSink`. By default lines are written unchanged, as if inherited.
``await procs.logging_option(stream_to_client=True, aggregate_window_sec=3)``
prefixes them with the proc's rank and host and, within each window, collapses
identical lines from many procs into one line with a count.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from typing import Any, TextIO

from ..runtime import Future, Promise

__all__ = ["LogSink", "sink", "pump", "add_log_tap", "remove_log_tap"]

_MAX_LINE = 4096


class LogSink:
    """Where forwarded lines go (one per controller process). Thread-safe."""

    def __init__(self) -> None:
        self.stream_to_client = False
        self.window_s: float | None = None
        self._lock = threading.Lock()
        self._pending: OrderedDict[tuple[str, str], list[str]] = OrderedDict()
        self._timer: threading.Timer | None = None
        #: Also called with every line, whatever the mode (the dashboard's log tail).
        self.taps: list[Any] = []

    def configure(self, stream_to_client: bool, window_s: float | None) -> None:
        """Switch modes (flushes what was being aggregated)."""
        self.flush()
        with self._lock:
            self.stream_to_client = stream_to_client
            self.window_s = window_s

    def line(self, who: str, stream: str, text: str) -> None:
        """One line of output from proc ``who`` ("rank host") on "stdout"/"stderr"."""
        if len(text) > _MAX_LINE:
            text = text[:_MAX_LINE] + "...[truncated]"
        for tap in tuple(self.taps):
            try:
                tap(who, stream, text)
            except Exception:  # a broken tap must not stop the forwarding of output
                pass
        out = sys.stdout if stream == "stdout" else sys.stderr
        with self._lock:
            if not self.stream_to_client:
                _write(out, text)
                return
            if not self.window_s:
                _write(out, f"[{who}] {text}")
                return
            key = (stream, text)
            self._pending.setdefault(key, []).append(who)
            if self._timer is None:
                self._timer = threading.Timer(self.window_s, self.flush)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        """Write out the current aggregation window now."""
        with self._lock:
            pending, self._pending = self._pending, OrderedDict()
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        for (stream, text), whos in pending.items():
            out = sys.stdout if stream == "stdout" else sys.stderr
            if len(whos) == 1:
                _write(out, f"[{whos[0]}] {text}")
            else:
                _write(out, f"[{len(whos)} similar log lines] {text}")


def _write(out: TextIO, text: str) -> None:
    try:
        out.write(text if text.endswith("\n") else text + "\n")
        out.flush()
    except (OSError, ValueError):
        pass


sink = LogSink()


def add_log_tap(tap: Any) -> None:
    """Also hand every forwarded line to ``tap(who, stream, text)`` (any thread; must not block)."""
    sink.taps.append(tap)


def remove_log_tap(tap: Any) -> None:
    """Stop handing lines to ``tap`` (no-op if it was not added)."""
    try:
        sink.taps.remove(tap)
    except ValueError:
        pass


def pump(pipe: Any, deliver: Any, who: str, stream: str) -> Future[None]:
    """Read ``pipe`` line by line on a daemon thread, calling ``deliver(who, stream, line)``.

    The thread ends when the pipe does (its process exited); the returned future
    completes then, so its owner can wait for the last lines without a join.
    """
    drained: Promise[None] = Promise()

    def run() -> None:
        try:
            for raw in iter(pipe.readline, b""):
                deliver(who, stream, raw.decode(errors="replace").rstrip("\n"))
        except (OSError, ValueError):
            pass
        finally:
            try:
                pipe.close()
            except OSError:
                pass
            drained.set_result(None)

    threading.Thread(target=run, name=f"log-{who}-{stream}", daemon=True).start()
    return drained.future
