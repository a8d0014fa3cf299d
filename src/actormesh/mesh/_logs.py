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

__all__ = ["LogSink", "sink", "pump"]

_MAX_LINE = 4096


class LogSink:
    """Where forwarded lines go (one per controller process). Thread-safe."""

    def __init__(self) -> None:
        self.stream_to_client = False
        self.window_s: float | None = None
        self._lock = threading.Lock()
        self._pending: OrderedDict[tuple[str, str], list[str]] = OrderedDict()
        self._timer: threading.Timer | None = None

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


def pump(pipe: Any, deliver: Any, who: str, stream: str) -> threading.Thread:
    """Read ``pipe`` line by line on a daemon thread, calling ``deliver(who, stream, line)``."""

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

    thread = threading.Thread(target=run, name=f"log-{who}-{stream}", daemon=True)
    thread.start()
    return thread
