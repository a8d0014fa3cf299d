"""The debug console's vocabulary: its commands, rank selections and session table.

Pure functions over strings and small records (no I/O), so the console's
parsing is tested without a job.

>>> parse_command("attach trainer 1")
Attach(actor='trainer', rank=1)
>>> parse_command("cast trainer ranks(0,2) p x")
Cast(actor='trainer', ranks=[0, 2], command='p x')
>>> parse_ranks("ranks(1:6:2)")
range(1, 6, 2)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Union

__all__ = [
    "SessionInfo",
    "Attach",
    "Cast",
    "Continue",
    "Help",
    "ListSessions",
    "Quit",
    "Command",
    "DebugCommandError",
    "parse_command",
    "parse_ranks",
    "format_sessions",
    "HELP",
    "TICK",
    "RESUME",
]

#: What the controller sends a paused session besides pdb lines (a pdb line never holds NUL).
TICK = "\x00tick"  # a console is connected: keep waiting
RESUME = "\x00resume"  # clear breakpoints and continue (the console's ``continue``)


@dataclass(frozen=True)
class SessionInfo:
    """One actor paused in ``breakpoint()``: who, where, and where in the code."""

    actor: str
    rank: int
    coords: dict[str, int] = field(default_factory=dict, hash=False)
    host: str = ""
    pid: int = 0
    function: str = ""
    filename: str = ""
    lineno: int = 0

    @property
    def key(self) -> tuple[str, int]:
        """Sessions are known by (actor name, rank): one session per actor at a time."""
        return (self.actor, self.rank)

    @property
    def where(self) -> str:
        """``file:line`` of the paused frame."""
        return f"{self.filename}:{self.lineno}"


@dataclass(frozen=True)
class ListSessions:
    """``list``: the table of sessions."""


@dataclass(frozen=True)
class Attach:
    """``attach <actor> <rank>``: a pdb prompt on one session."""

    actor: str
    rank: int


@dataclass(frozen=True)
class Cast:
    """``cast <actor> ranks(...) <pdb command>``: one pdb command to several ranks."""

    actor: str
    ranks: Union[list[int], range, None]
    command: str


@dataclass(frozen=True)
class Continue:
    """``continue``: clear breakpoints and resume every session."""


@dataclass(frozen=True)
class Help:
    """``help``."""


@dataclass(frozen=True)
class Quit:
    """``quit``: leave the console; sessions stay paused for the next console."""


Command = Union[ListSessions, Attach, Cast, Continue, Help, Quit]


class DebugCommandError(ValueError):
    """A console line that is not a command; the message says what to type instead."""


HELP = """\
actormesh debugger commands:
  list                               sessions: actor, rank, host, function, file:line
  attach <actor> <rank>              a pdb prompt on that session ('detach' returns here)
  cast <actor> ranks(...) <command>  one pdb command to several ranks at once:
                                       ranks(1), ranks(0,2), ranks(1:4), ranks(0:8:2), ranks(*)
  continue                           clear breakpoints and resume every session
  help                               this text
  quit                               leave the console (sessions stay paused for the next one)
"""

_RANKS = re.compile(r"ranks\(([^)]*)\)")
_INT = re.compile(r"-?\d+")


def parse_ranks(text: str) -> Union[list[int], range, None]:
    """``ranks(1)``, ``ranks(0,2)``, ``ranks(1:4)``, ``ranks(::2)`` or ``ranks(*)`` (None: all)."""
    m = _RANKS.fullmatch(text.strip())
    if not m:
        raise DebugCommandError(f"expected ranks(...) like ranks(0,2) or ranks(1:4), got {text!r}")
    body = m.group(1).replace(" ", "")
    if body in ("*", ""):
        return None
    if ":" in body:
        parts = body.split(":")
        if len(parts) > 3 or not all(p == "" or _INT.fullmatch(p) for p in parts):
            raise DebugCommandError(f"a rank range is start:stop[:step] of integers, got {body!r}")
        start, stop, step = (parts + ["", ""])[:3]
        if stop == "":
            raise DebugCommandError(f"a rank range needs a stop (ranks(0:4)), got {body!r}")
        return range(int(start or 0), int(stop), int(step or 1))
    items = body.split(",")
    if not all(_INT.fullmatch(p) for p in items):
        raise DebugCommandError(f"ranks are comma-separated integers, got {body!r}")
    return [int(p) for p in items]


def _int_arg(text: str, what: str) -> int:
    if not _INT.fullmatch(text):
        raise DebugCommandError(f"{what} must be an integer, got {text!r}")
    return int(text)


def parse_command(line: str) -> Command:
    """One console line as a command; DebugCommandError says what was wrong."""
    words = line.split()
    if not words:
        raise DebugCommandError("empty command; type 'help'")
    verb, args = words[0], words[1:]
    if verb in ("list", "ls", "l") and not args:
        return ListSessions()
    if verb in ("attach", "a"):
        if len(args) != 2:
            raise DebugCommandError("usage: attach <actor> <rank>")
        return Attach(args[0], _int_arg(args[1], "the rank"))
    if verb == "cast":
        m = re.match(r"\s*cast\s+(\S+)\s+(ranks\([^)]*\))\s+(.+)$", line)
        if not m:
            raise DebugCommandError("usage: cast <actor> ranks(...) <pdb command>, e.g. cast trainer ranks(0,2) p loss")
        return Cast(m.group(1), parse_ranks(m.group(2)), m.group(3).strip())
    if verb in ("continue", "c", "cont") and not args:
        return Continue()
    if verb in ("help", "h", "?"):
        return Help()
    if verb in ("quit", "q", "exit") and not args:
        return Quit()
    raise DebugCommandError(f"unknown command {line.strip()!r}; type 'help' for the list")


def format_sessions(infos: list[SessionInfo], states: dict[tuple[str, int], str] | None = None) -> str:
    """A plain-text table of sessions, sorted by actor and rank."""
    if not infos:
        return "no sessions: no actor is paused in breakpoint()\n"
    states = states or {}
    header = ("actor", "rank", "coords", "host", "pid", "function", "file:line", "state")
    rows = [header]
    for i in sorted(infos, key=lambda s: s.key):
        coords = ",".join(f"{k}={v}" for k, v in i.coords.items())
        rows.append((i.actor, str(i.rank), coords, i.host, str(i.pid), i.function, i.where, states.get(i.key, "paused")))
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines) + "\n"
