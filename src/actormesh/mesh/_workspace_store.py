"""The host side of ``HostMesh.sync_workspace``: a workspace root that receives
trees of files and swaps each in atomically.

Theory of operation. A synced directory ``NAME`` lives on the host as a
symlink ``ROOT/NAME -> .versions/NAME/<version>``; every version is a complete
tree. A sync is a session: ``begin(manifests)`` compares the sender's
manifest (relative path -> kind, size, mode, sha256) with the current
version's and answers the content hashes the host lacks; ``put`` writes those
contents, in chunks, into a staging directory; ``commit`` checks each received
hash, builds the next version (new contents moved in, unchanged files
hard-linked from the current version, so nothing is copied), then replaces
the symlink with ``rename(2)``. A reader that opens ``ROOT/NAME/...`` sees the
whole old tree or the whole new one, never a mix. The previous version is
kept (a process may still read it); older ones are removed.

Files in a synced tree are shared between versions (hard links): treat them
as read-only on the hosts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = ["WorkspaceStore", "default_workspace_root", "WORKSPACE_ENV", "file_digest", "Entry"]

#: A host's workspace root (where synced directories land) when the caller gives none.
WORKSPACE_ENV = "ACTORMESH_WORKSPACE_DIR"
_SESSION_IDLE_S = 600.0

#: relative path -> ("f", size, mode, sha256 hex) | ("d", 0, mode, "") | ("l", 0, 0, link target)
Entry = tuple[str, int, int, str]


def default_workspace_root() -> str:
    """``$ACTORMESH_WORKSPACE_DIR``, else ``<tmp>/actormesh-workspace-<uid>`` (node-local)."""
    env = os.environ.get(WORKSPACE_ENV)
    if env:
        return os.path.abspath(os.path.expanduser(env))
    return os.path.join(tempfile.gettempdir(), f"actormesh-workspace-{os.getuid()}")


def file_digest(path: str) -> str:
    """sha256 of a file's content, hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@dataclass
class _Session:
    names: dict[str, dict[str, Entry]]
    staging: str
    needed: set[str]
    received: dict[str, int] = field(default_factory=dict)
    hashing: dict[str, Any] = field(default_factory=dict)  # sha256 -> hash of the bytes received so far
    touched: float = field(default_factory=time.monotonic)


class WorkspaceStore:
    """One host's workspace root; thread-safe, one session per directory name at a time."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self._sessions: dict[str, _Session] = {}
        self._busy: dict[str, str] = {}  # directory name -> session holding it
        self._lock = threading.Lock()

    # -- protocol ------------------------------------------------------------------------
    def begin(self, manifests: dict[str, dict[str, Entry]]) -> tuple[str, list[str]]:
        """Start a session for ``{name: manifest}``; return (session id, sha256s to send)."""
        for name in manifests:
            if not name or name in (".", "..") or "/" in name or name.startswith("."):
                raise ValueError(f"bad workspace directory name {name!r}: a plain name not starting with '.'")
        with self._lock:
            self._expire()
            taken = [n for n in manifests if n in self._busy]
            if taken:
                raise RuntimeError(f"another sync of {taken} into {self.root} is in progress on this host; retry when it ends")
            os.makedirs(self.root, exist_ok=True)
            sid = uuid.uuid4().hex
            staging = os.path.join(self.root, ".staging", sid)
            os.makedirs(staging)
            have: set[str] = set()
            for name in manifests:
                have.update(e[3] for e in self._current_manifest(name).values() if e[0] == "f")
            needed = {e[3] for m in manifests.values() for e in m.values() if e[0] == "f"} - have
            self._sessions[sid] = _Session(dict(manifests), staging, needed)
            for name in manifests:
                self._busy[name] = sid
        return sid, sorted(needed)

    def put(self, sid: str, digest: str, offset: int, data: Any) -> None:
        """Write ``data`` at ``offset`` of the content ``digest`` (chunks come in order)."""
        s = self._session(sid)
        if digest not in s.needed:
            raise ValueError(f"sync session {sid}: content {digest[:12]} was not asked for")
        if s.received.get(digest, 0) != offset:
            raise ValueError(f"sync session {sid}: chunk of {digest[:12]} at {offset}, expected {s.received.get(digest, 0)}")
        with open(os.path.join(s.staging, digest), "r+b" if offset else "wb") as f:
            f.seek(offset)
            f.write(data)
        s.hashing.setdefault(digest, hashlib.sha256()).update(data)  # checked at commit without reading the file again
        s.received[digest] = offset + len(memoryview(data))
        s.touched = time.monotonic()

    def commit(self, sid: str) -> dict[str, dict[str, Any]]:
        """Check the contents, build and swap in every directory of the session.

        Returns ``{name: {"path": ROOT/NAME, "changed": [relative paths added, changed or deleted]}}``.
        """
        s = self._session(sid)
        try:
            for digest in s.needed:
                path = os.path.join(s.staging, digest)
                if digest == _EMPTY and digest not in s.hashing:
                    open(path, "wb").close()
                    s.hashing[digest] = hashlib.sha256()
                if digest not in s.hashing or s.hashing[digest].hexdigest() != digest:
                    raise ValueError(f"sync session {sid}: content {digest[:12]} is missing or corrupt (did a file change during the sync?); nothing was changed, sync again")
            pool = {}  # content already on this host (any synced directory) -> a file holding it
            for name in s.names:
                cur = self._current(name)
                pool.update({e[3]: os.path.join(cur, p) for p, e in self._current_manifest(name).items() if cur and e[0] == "f"})
            placed: dict[str, str] = {}  # content received in this session -> where it now lives
            return {name: self._swap_in(name, manifest, s.staging, pool, placed) for name, manifest in s.names.items()}
        finally:
            self.abort(sid)

    def abort(self, sid: str) -> None:
        """End a session, dropping what it staged (idempotent)."""
        with self._lock:
            s = self._sessions.pop(sid, None)
            for name in [n for n, owner in self._busy.items() if owner == sid]:
                del self._busy[name]
        if s is not None:
            shutil.rmtree(s.staging, ignore_errors=True)

    # -- internals -----------------------------------------------------------------------
    def _session(self, sid: str) -> _Session:
        with self._lock:
            s = self._sessions.get(sid)
        if s is None:
            raise RuntimeError(f"no sync session {sid} on this host (it ended or expired after {_SESSION_IDLE_S:.0f}s idle)")
        return s

    def _expire(self) -> None:
        now = time.monotonic()
        for sid, s in list(self._sessions.items()):
            if now - s.touched > _SESSION_IDLE_S:
                self._sessions.pop(sid)
                for name in [n for n, owner in self._busy.items() if owner == sid]:
                    del self._busy[name]
                shutil.rmtree(s.staging, ignore_errors=True)

    def _versions(self, name: str) -> str:
        return os.path.join(self.root, ".versions", name)

    def _current(self, name: str) -> str | None:
        link = os.path.join(self.root, name)
        if not os.path.islink(link):
            if os.path.exists(link):
                raise RuntimeError(f"{link} exists and is not a synced workspace (a symlink); move it away or sync into another root")
            return None
        return os.path.join(self.root, os.readlink(link))

    def _current_manifest(self, name: str) -> dict[str, Entry]:
        cur = self._current(name)
        if cur is None:
            return {}
        try:
            with open(cur + ".json") as f:
                return {k: tuple(v) for k, v in json.load(f).items()}  # type: ignore[misc]
        except (OSError, ValueError):
            return {}

    def _swap_in(self, name: str, manifest: dict[str, Entry], staging: str, by_digest: dict[str, str], placed: dict[str, str]) -> dict[str, Any]:
        old = self._current_manifest(name)
        cur = self._current(name)
        version = uuid.uuid4().hex[:16]
        build = os.path.join(self._versions(name), version)
        os.makedirs(build)
        for rel, (kind, _size, mode, value) in sorted(manifest.items()):
            dst = os.path.join(build, rel)
            if kind == "d":
                os.makedirs(dst, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if kind == "l":
                os.symlink(value, dst)
                continue
            staged = os.path.join(staging, value)
            src = placed.get(value) or by_digest.get(value) or staged
            _place(src, dst, mode, move=src == staged)
            placed.setdefault(value, dst)
        with open(build + ".json", "w") as f:
            json.dump(manifest, f)
        tmp_link = os.path.join(self.root, f".{name}.{version}.link")
        os.symlink(os.path.relpath(build, self.root), tmp_link)
        os.replace(tmp_link, os.path.join(self.root, name))  # the atomic step
        self._prune(name, keep={version, os.path.basename(cur) if cur else ""})
        changed = sorted(p for p in set(old) | set(manifest) if old.get(p) != manifest.get(p) and (old.get(p) or manifest[p])[0] != "d")
        return {"path": os.path.join(self.root, name), "changed": changed}

    def _prune(self, name: str, keep: set[str]) -> None:
        base = self._versions(name)
        for entry in os.listdir(base):
            if entry.removesuffix(".json") not in keep:
                path = os.path.join(base, entry)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    try:
                        os.unlink(path)
                    except OSError:
                        pass


_EMPTY = hashlib.sha256(b"").hexdigest()


def _place(src: str, dst: str, mode: int, move: bool) -> None:
    """Put ``src``'s content at ``dst`` with permission bits ``mode``: a rename for new
    content, a hard link for content already on the host (a copy where links fail or the mode differs)."""
    if move:
        os.replace(src, dst)
        os.chmod(dst, mode)
        return
    if stat.S_IMODE(os.stat(src).st_mode) == mode:
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copyfile(src, dst)
    os.chmod(dst, mode)
