"""``HostMesh.sync_workspace``: ship local directories to every host of a mesh,
sending only the files whose content the host lacks (sha256), each directory
swapped in atomically on each host (``_workspace_store.py``).

The controller scans each directory (a file's hash is recomputed only when its
size, mtime or inode changed since the last scan in this process, as rsync's
quick check does), asks every host which contents it lacks, streams those in
chunks as ordinary actor messages over the job's authenticated channels
(several chunks in flight per host, every host at once), then commits. With
``auto_reload=True`` the procs spawned through the mesh then reload the
modules whose files changed (``_workspace_reload.py``).
"""

from __future__ import annotations

import fnmatch
import os
import pickle
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..runtime import Future
from ._workspace_store import Entry, WorkspaceStore, default_workspace_root, file_digest

__all__ = ["WorkspaceSync", "sync_workspace", "DEFAULT_EXCLUDE"]

#: Never shipped unless ``exclude=`` replaces this list.
DEFAULT_EXCLUDE = (".git", ".hg", "__pycache__", "*.pyc", ".venv", ".actormesh", ".mypy_cache", ".pytest_cache")
_CHUNK = 4 << 20
_WINDOW = 4  # chunks in flight per host
_CALL_TIMEOUT_S = 300.0

_digests: dict[str, tuple[tuple[int, int, int], str]] = {}  # abs path -> ((size, mtime_ns, inode), sha256)
_digests_lock = threading.Lock()


@dataclass
class WorkspaceSync:
    """What one ``sync_workspace`` did."""

    #: host agent address (``"local"`` for this host) -> {directory name: its path on that host}
    paths: dict[str, dict[str, str]] = field(default_factory=dict)
    #: directory name -> relative paths added, changed or deleted (on any host)
    changed: dict[str, list[str]] = field(default_factory=dict)
    files_sent: int = 0
    bytes_sent: int = 0
    #: modules reloaded in the procs (``auto_reload=True``)
    reloaded: list[str] = field(default_factory=list)


def resolve_dirs(workspace: Any) -> list[tuple[str, str]]:
    """``[(local absolute dir, name on the hosts)]`` from a path, a list of paths, or an
    object with ``dirs`` (Monarch's ``Workspace``: a list, or a dict of local -> name)."""
    dirs = getattr(workspace, "dirs", workspace)
    if isinstance(dirs, (str, os.PathLike)):
        dirs = [dirs]
    pairs: list[tuple[Any, Any]]
    if isinstance(dirs, dict):
        pairs = [(k, v or os.path.basename(os.path.abspath(k))) for k, v in dirs.items()]
    elif isinstance(dirs, Sequence) and dirs:
        pairs = [(d, os.path.basename(os.path.abspath(d))) for d in dirs]
    else:
        raise TypeError(f"workspace must be a directory path, a list of them, or a Workspace with dirs; got {workspace!r}")
    out: list[tuple[str, str]] = []
    for local, name in pairs:
        if not isinstance(local, (str, os.PathLike)) or not os.path.isdir(local):
            raise ValueError(f"workspace directory {local!r} does not exist here (give existing local directories)")
        name = os.fspath(name).strip("/")
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"workspace name {name!r} for {local!r} must be a plain name not starting with '.' (rename the directory or use a dict)")
        out.append((os.path.abspath(local), name))
    names = [n for _, n in out]
    if len(set(names)) != len(names):
        raise ValueError(f"two workspace directories would land under the same name on the hosts: {names}; use a dict of local -> name")
    return out


def scan(root: str, exclude: Sequence[str]) -> tuple[dict[str, Entry], dict[str, str]]:
    """The manifest of ``root`` and ``{sha256: a local file holding it}``."""
    manifest: dict[str, Entry] = {}
    sources: dict[str, str] = {}

    def skip(name: str) -> bool:
        return any(fnmatch.fnmatch(name, pat) for pat in exclude)

    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not skip(d))
        rel_dir = os.path.relpath(dirpath, root)
        for d in dirnames:
            full = os.path.join(dirpath, d)
            rel = os.path.normpath(os.path.join(rel_dir, d))
            if os.path.islink(full):
                manifest[rel] = ("l", 0, 0, os.readlink(full))
            else:
                manifest[rel] = ("d", 0, 0o755, "")
        for f in sorted(filenames):
            if skip(f):
                continue
            full = os.path.join(dirpath, f)
            rel = os.path.normpath(os.path.join(rel_dir, f))
            st = os.lstat(full)
            if os.path.islink(full):
                manifest[rel] = ("l", 0, 0, os.readlink(full))
            elif os.path.isfile(full):
                digest = _digest(full, st)
                manifest[rel] = ("f", st.st_size, st.st_mode & 0o7777, digest)
                sources.setdefault(digest, full)
    return manifest, sources


def _digest(path: str, st: os.stat_result) -> str:
    key = (st.st_size, st.st_mtime_ns, st.st_ino)
    with _digests_lock:
        hit = _digests.get(path)
    if hit is not None and hit[0] == key:
        return hit[1]
    digest = file_digest(path)
    with _digests_lock:
        _digests[path] = (key, digest)
    return digest


class _Host:
    """One destination: a host agent (endpoint calls) or this host (a store in-process)."""

    def __init__(self, agent: str | None, dest: str | None) -> None:
        self.label = agent or "local"
        self.dest = dest
        if agent is None:
            self._store = WorkspaceStore(dest or default_workspace_root())
        else:
            from ._host_agent import agent_mesh

            self._agent = agent_mesh(agent)

    def call(self, verb: str, *args: Any) -> Future[Any]:
        if self.label == "local":
            try:
                return Future.completed(getattr(self._store, verb)(*args))
            except Exception as exc:
                return Future.failed(exc)
        return getattr(self._agent, f"workspace_{verb}").call_one(self.dest, *args)


def sync_workspace(agents: list[str] | None, workspace: Any, *, dest: str | None, exclude: Sequence[str],
                   reload: Callable[[dict[str, dict[str, str]], dict[str, list[str]]], list[str]] | None) -> WorkspaceSync:
    """Blocking body of ``HostMesh.sync_workspace`` (``agents``: one address per host, None: this host)."""
    dirs = resolve_dirs(workspace)
    manifests: dict[str, dict[str, Entry]] = {}
    sources: dict[str, str] = {}
    for local, name in dirs:
        manifests[name], found = scan(local, exclude)
        sources.update(found)
    hosts = [_Host(a, dest) for a in dict.fromkeys(agents)] if agents else [_Host(None, dest)]
    begun = [h.call("begin", manifests) for h in hosts]
    sessions: list[tuple[_Host, str, list[str]]] = []
    error: BaseException | None = None
    for h, fut in zip(hosts, begun):
        try:
            sid, needed = fut.get(timeout=_CALL_TIMEOUT_S)
            sessions.append((h, sid, needed))
        except BaseException as exc:
            error = error or exc
    report = WorkspaceSync()
    try:
        if error is not None:
            raise error
        _send(sessions, sources, report)
        commits = [(h, h.call("commit", sid)) for h, sid, _ in sessions]
        sessions = []  # a commit ends its session, whether it succeeds or not
        for h, fut in commits:
            done = fut.get(timeout=_CALL_TIMEOUT_S)
            report.paths[h.label] = {name: r["path"] for name, r in done.items()}
            for name, r in done.items():
                report.changed[name] = sorted(set(report.changed.get(name, [])) | set(r["changed"]))
    finally:
        for h, sid, _ in sessions:
            try:
                h.call("abort", sid).get(timeout=30)
            except Exception:  # the host is gone: its session expires there
                pass
    if reload is not None and any(report.changed.values()):
        report.reloaded = reload(report.paths, report.changed)
    return report


def _send(sessions: list[tuple[_Host, str, list[str]]], sources: dict[str, str], report: WorkspaceSync) -> None:
    """Stream every needed content to the hosts that lack it, ``_WINDOW`` chunks in flight per host."""
    wanted: dict[str, list[tuple[_Host, str]]] = {}
    for h, sid, needed in sessions:
        for digest in needed:
            wanted.setdefault(digest, []).append((h, sid))
    inflight: dict[str, deque[Future[Any]]] = {h.label: deque() for h, _, _ in sessions}
    for digest, targets in wanted.items():
        path = sources[digest]
        with open(path, "rb") as f:
            offset = 0
            while True:
                chunk = f.read(_CHUNK)
                if not chunk:
                    break
                payload = pickle.PickleBuffer(chunk)  # travels out of band: not copied into the pickle stream
                for h, sid in targets:
                    q = inflight[h.label]
                    q.append(h.call("put", sid, digest, offset, payload))
                    if len(q) > _WINDOW:
                        q.popleft().get(timeout=_CALL_TIMEOUT_S)
                    report.bytes_sent += len(chunk)
                offset += len(chunk)
        report.files_sent += len(targets)
    for q in inflight.values():
        while q:
            q.popleft().get(timeout=_CALL_TIMEOUT_S)
