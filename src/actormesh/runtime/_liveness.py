"""Liveness of child procs: telling died, stopped, hung and busy apart (sans-I/O).

Theory of operation
-------------------
A spawner (the controller for procs on its own host, a host agent for the
procs of its host) watches the procs it started. Silence alone cannot tell a
proc that is busy inside one long GIL-holding C call (a regex, a tokenizer, a
torch op) from one that is stopped or wedged: all three stop answering pings.
The spawner can do better, because it sees its children through the OS. This
module holds the rules; the asyncio shell in ``_spawn.py`` feeds it one
*round* per tick (the clock, and for every child its pid and when bytes last
arrived from it) and acts on what it returns (ping these, kill those with this
cause). The clock and the ``/proc`` reader are injected, so every rule is
tested in virtual time (``tests/test_liveness.py``).

Rules, per child, with its policy (``heartbeat_interval`` I,
``heartbeat_timeout`` T, ``hung_timeout`` H, from the settings in force when it
was spawned):

1. A late checker gives no verdict. A round that comes more than ``2 * I``
   after the previous one means the checker itself did not run (its process was
   frozen, paused in a debugger, starved of the GIL, its VM paused): the
   children's silence says nothing about them. That round only pings, and every
   silence clock restarts from it.
2. A child quiet for more than I is pinged (it answers from its I/O loop).
3. A child silent for at most T is alive: no verdict.
4. A child silent for more than T is looked at in ``/proc/<pid>/stat``:

   - gone, or a zombie: it *died*; no verdict here, the exit watcher reports
     its exit status (code or signal) as the cause.
   - state ``T`` (SIGSTOP, SIGTSTP): *stopped*; it is killed, so that no late
     reply can ever arrive, and declared dead with that cause.
   - its CPU time (utime + stime, all threads) advanced since the stall window
     opened by at least ``max(30 ms, 1 %)`` of the window: *busy*; the window
     reopens. A busy child is never declared dead, however long it is silent.
   - no such progress for H while no thread is runnable: *hung*; killed.

   Without ``/proc`` (not Linux) a busy child cannot be told from a hung one:
   after T of silence it is declared *unresponsive* and killed, as before,
   and rule 1 still holds.

Deadlines that follow, counted from the child's last message while the
checker runs on time (rounds every I / 2): stopped within T + I / 2 (3.25 s by
default, under 5 s), hung within T + H + I (63.5 s by default).
"""

from __future__ import annotations

import enum
import os
import signal as _signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..errors import Cause, CauseKind

__all__ = [
    "Policy",
    "ProcSample",
    "Peer",
    "Verdict",
    "Death",
    "Round",
    "LivenessJudge",
    "read_proc",
    "proc_available",
    "describe_exit",
]

#: CPU use that counts as progress over a stall window: this much at least...
MIN_PROGRESS_S = 0.03
#: ...and this share of the window's wall time (a thread waiting for the GIL
#: wakes every 5 ms and uses ~0.2 % of a core: far below this).
MIN_PROGRESS_SHARE = 0.01
#: A child that is not silent is still sampled this often (its memory, for exit reports).
SAMPLE_EVERY_S = 1.0
#: States of a process that exited (zombie, dead): its exit status is on its way.
_EXITED = frozenset({"Z", "X", "x"})


@dataclass(frozen=True)
class Policy:
    """The liveness settings one child is judged by (seconds)."""

    interval_s: float = 0.5
    timeout_s: float = 3.0
    hung_s: float = 60.0


@dataclass(frozen=True)
class ProcSample:
    """What the OS says about a process at one moment."""

    #: The state letter of ``/proc/<pid>/stat`` (R, S, D, T, t, Z, ...).
    state: str
    #: User + system CPU seconds of all its threads so far.
    cpu_s: float
    #: Whether any of its threads is runnable (state R); None when not read.
    runnable: bool | None = None
    rss_bytes: int | None = None


#: ``read(pid, threads)`` -> a sample, or None when no such process exists.
#: ``threads`` asks for the per-thread states (``runnable``), which cost more.
ProcReader = Callable[[int, bool], "ProcSample | None"]


@dataclass(frozen=True)
class Peer:
    """One child as the shell sees it this round."""

    key: str
    pid: int
    #: When bytes last arrived from it, on the judge's clock.
    last_rx: float
    policy: Policy = Policy()


class Verdict(enum.Enum):
    """Why a child was declared dead by its judge."""

    STOPPED = "stopped"
    HUNG = "hung"
    UNRESPONSIVE = "unresponsive"


@dataclass(frozen=True)
class Death:
    """A verdict on one child, with the cause every waiter on it is given."""

    key: str
    verdict: Verdict
    #: A HUNG :class:`~actormesh.errors.Cause` (its ``signal`` is SIGSTOP for a stopped child).
    reason: Cause


@dataclass
class Round:
    """What the shell does after one tick."""

    ping: list[str] = field(default_factory=list)
    deaths: list[Death] = field(default_factory=list)
    #: The checker was late: no verdict was given this round.
    late: bool = False


@dataclass
class _Watch:
    since: float  # silence is counted from max(last_rx, since)
    sampled_at: float = float("-inf")
    stall_at: float | None = None  # when the current window without CPU progress opened
    stall_cpu_s: float = 0.0
    rss_bytes: int | None = None


class LivenessJudge:
    """The rules above, for the children of one spawner. Not thread-safe: one
    shell calls it (the spawner's loop thread)."""

    def __init__(self, clock: Callable[[], float], read: ProcReader | None) -> None:
        self._clock = clock
        self._read = read
        self._watches: dict[str, _Watch] = {}
        self._last_round: float | None = None

    def rss_bytes(self, key: str) -> int | None:
        """The child's resident memory when last sampled (None if never)."""
        w = self._watches.get(key)
        return None if w is None else w.rss_bytes

    def tick(self, peers: Iterable[Peer]) -> Round:
        """Judge one round. Children not in ``peers`` are forgotten."""
        now = self._clock()
        peers = list(peers)
        out = Round()
        previous, self._last_round = self._last_round, now
        if peers and previous is not None:
            out.late = now - previous > 2 * min(p.policy.interval_s for p in peers)
        seen = set()
        for peer in peers:
            seen.add(peer.key)
            w = self._watches.get(peer.key)
            if w is None or out.late:
                w = self._watches[peer.key] = _Watch(since=now, rss_bytes=None if w is None else w.rss_bytes)
            if now - peer.last_rx > peer.policy.interval_s:
                out.ping.append(peer.key)
            if not out.late:
                death = self._judge(peer, w, now)
                if death is not None:
                    out.deaths.append(death)
        for key in [k for k in self._watches if k not in seen]:
            del self._watches[key]
        return out

    def _judge(self, peer: Peer, w: _Watch, now: float) -> Death | None:
        p = peer.policy
        silent = now - max(peer.last_rx, w.since)
        if silent <= p.timeout_s:
            w.stall_at = None
            if self._read is not None and now - w.sampled_at >= SAMPLE_EVERY_S:
                self._sample(peer, w, now, threads=False)
            return None
        if self._read is None:
            return Death(peer.key, Verdict.UNRESPONSIVE, _unresponsive(silent, p))
        s = self._sample(peer, w, now, threads=False)
        if s is None or s.state in _EXITED:
            return None  # it died: the exit watcher reports how
        if s.state == "T":
            return Death(peer.key, Verdict.STOPPED, _stopped(silent))
        if w.stall_at is None or s.cpu_s - w.stall_cpu_s >= max(MIN_PROGRESS_S, MIN_PROGRESS_SHARE * (now - w.stall_at)):
            w.stall_at, w.stall_cpu_s = now, s.cpu_s  # busy (or first look): the window (re)opens
            return None
        stalled = now - w.stall_at
        if stalled < p.hung_s:
            return None
        s = self._sample(peer, w, now, threads=True)  # the thread states cost more: only now
        if s is None or s.state in _EXITED or s.runnable:
            return None  # waiting for a CPU is not hung: look again next round
        return Death(peer.key, Verdict.HUNG, _hung(silent, stalled, p, s))

    def _sample(self, peer: Peer, w: _Watch, now: float, *, threads: bool) -> ProcSample | None:
        assert self._read is not None
        s = self._read(peer.pid, threads)
        w.sampled_at = now
        if s is not None and s.rss_bytes is not None:
            w.rss_bytes = s.rss_bytes
        return s


_PREFIX = "the process this actor was running on"


def _stopped(silent: float) -> Cause:
    return Cause(f"{_PREFIX} was stopped (state T: SIGSTOP or SIGTSTP) and silent for {silent:.1f}s; "
                 "it was killed so that no late reply can arrive", CauseKind.HUNG, signal=int(_signal.SIGSTOP))


def _hung(silent: float, stalled: float, p: Policy, s: ProcSample) -> Cause:
    return Cause(f"{_PREFIX} hung: silent for {silent:.1f}s, not runnable (state {s.state}) and using no CPU for "
                 f"{stalled:.1f}s (hung_timeout {p.hung_s:g}s){_rss(s.rss_bytes)}; it was killed", CauseKind.HUNG)


def _unresponsive(silent: float, p: Policy) -> Cause:
    return Cause(f"{_PREFIX} stopped responding for {silent:.1f}s (heartbeat_timeout {p.timeout_s:g}s; this OS has no "
                 "/proc to tell a busy proc from a hung one) and was killed", CauseKind.HUNG)


def _rss(rss_bytes: int | None) -> str:
    if rss_bytes is None:
        return ""
    return f", resident memory {rss_bytes / 2**20:.0f} MiB"


_SIGNAL_WORDS = {9: "Killed", 15: "Terminated", 11: "Segfault", 6: "Aborted"}


def describe_exit(returncode: int, *, rss_bytes: int | None = None, killed_by_spawner: bool = False) -> Cause:
    """How a process ended, in Monarch's wording (``failed: Killed(sig=9)``), with
    what is known of why: a SIGKILL its spawner did not send usually comes from
    the kernel's out-of-memory killer, so its last seen memory is given.
    An EXITED cause with the code, or a SIGNALED one with the signal number."""
    import signal

    if returncode >= 0:
        if returncode:
            return Cause(f"{_PREFIX} exited with non-zero code {returncode}", CauseKind.EXITED, code=returncode)
        return Cause(f"{_PREFIX} exited", CauseKind.EXITED, code=0)
    sig = -returncode
    try:
        word = _SIGNAL_WORDS.get(sig, signal.Signals(sig).name)
    except ValueError:
        word = "Signal"
    text = f"{_PREFIX} failed: {word}(sig={sig})"
    if sig == signal.SIGKILL and not killed_by_spawner:
        text += " (not sent by actormesh: the kernel's out-of-memory killer or another process)"
    if rss_bytes is not None:
        text += f"; its resident memory was {rss_bytes / 2**20:.0f} MiB when last seen"
    return Cause(text, CauseKind.SIGNALED, signal=sig)


# -- the real /proc reader ------------------------------------------------------------------

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def proc_available() -> bool:
    """Whether this OS has a Linux ``/proc`` the reader understands."""
    return os.path.exists(f"/proc/{os.getpid()}/stat")


def _stat_fields(path: str) -> list[bytes] | None:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:  # no such process (or thread): it is gone
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ")".
    return data[data.rindex(b")") + 2 :].split()


def read_proc(pid: int, threads: bool) -> ProcSample | None:
    """Read ``/proc/<pid>/stat`` (and, with ``threads``, every thread's state)."""
    f = _stat_fields(f"/proc/{pid}/stat")
    if f is None:
        return None
    # After the name: [0] state, [11] utime, [12] stime (clock ticks), [21] rss (pages).
    cpu_s = (int(f[11]) + int(f[12])) / _TICKS_PER_S
    runnable = None
    if threads:
        runnable = False
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            tids = []
        for tid in tids:
            t = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
            if t is not None and t[0] == b"R":
                runnable = True
                break
    return ProcSample(state=f[0].decode(), cpu_s=cpu_s, runnable=runnable, rss_bytes=int(f[21]) * _PAGE_BYTES)
