"""The job directory: a private temp dir per controller (or agent) runtime.

It holds the Unix sockets of this process and of the procs it spawns, and
files written for host agents (secrets, logs). The runtime that made it
removes it when it closes. A process that was SIGKILLed cannot, so every new
directory sweeps away earlier ones whose owner is provably dead: a directory
is ours only if it carries our prefix, belongs to our uid, is private (0700)
and holds an ``owner`` file naming a pid, that pid's start time, its pid
namespace and the boot it ran in; it is dead only if, in that same namespace
and boot, no process with that pid and start time exists. Anything that
cannot be proved both ways (another container sharing /tmp, an older
directory without an owner file) is left alone.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile

log = logging.getLogger("actormesh.runtime")

__all__ = ["make_job_dir", "remove_job_dir", "sweep_stale_job_dirs"]

PREFIX = "actormesh-"
_OWNER = "owner"


def _start_time(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (None if it does not exist)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _identity() -> tuple[str, str] | None:
    """(pid namespace, boot id) of this process: where its pids mean something."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return None
    return ns.replace(" ", "_"), boot


def make_job_dir() -> str:
    """A new 0700 job directory marked with this process as its owner."""
    sweep_stale_job_dirs()
    path = tempfile.mkdtemp(prefix=PREFIX)
    os.chmod(path, 0o700)
    me = os.getpid()
    started, identity = _start_time(me), _identity()
    if started is not None and identity is not None:
        fd = os.open(os.path.join(path, _OWNER), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, f"{me} {started} {identity[0]} {identity[1]}\n".encode())
        finally:
            os.close(fd)
    return path


def remove_job_dir(path: str) -> None:
    """Remove a job directory this process made (and everything in it)."""
    shutil.rmtree(path, ignore_errors=True)


def _owner_is_dead(path: str) -> bool:
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
            return False
        with open(os.path.join(path, _OWNER)) as f:
            pid_text, started, ns, boot = f.read().split()
        pid = int(pid_text)
    except (OSError, ValueError):
        return False  # not provably ours (no or odd owner file): leave it
    if pid == os.getpid() or (ns, boot) != _identity():
        return False  # its pids are not ours to check
    return _start_time(pid) != started


def sweep_stale_job_dirs(root: str | None = None) -> list[str]:
    """Remove job directories left by dead runtimes of this user; return them."""
    root = root or tempfile.gettempdir()
    if not os.path.isdir("/proc/self"):
        return []  # cannot prove a pid dead without /proc
    removed = []
    try:
        names = [n for n in os.listdir(root) if n.startswith(PREFIX)]
    except OSError:
        return []
    for name in names:
        path = os.path.join(root, name)
        if _owner_is_dead(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed %d job directories of runtimes that are gone", len(removed))
    return removed
