"""``HostMesh.sync_workspace``: directories shipped to every host, only changed
contents travel, each directory swapped in atomically, procs reload changed modules.

Hosts are ProcessJob agents (real processes on their own loopback addresses),
each with its own workspace root, as separate machines would have.
Semantics: docs/sync.md; Monarch's row in MONARCH_API.md §1.13.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import bridged_namespaces

from actormesh.actor import this_host
from actormesh.job import ProcessJob
from actormesh.mesh import WorkspaceSync
from actormesh.mesh._workspace_store import WorkspaceStore

pytestmark = pytest.mark.timeout(120)
T = 60


@pytest.fixture(scope="module")
def hosts() -> Iterator[Any]:
    job = ProcessJob({"hosts": 2})
    try:
        yield job.state().hosts
    finally:
        job.kill()


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _write(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def test_a_changed_an_added_and_a_deleted_file_reach_every_host(hosts: Any, tmp_path: Path) -> None:
    src = tmp_path / "proj"
    big = os.urandom(9 << 20)  # several chunks
    _write(src, {"a.py": b"A = 1\n", "sub/b.txt": b"bee", "data.bin": big, "empty": b"", ".git/HEAD": b"ref"})
    (src / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (src / "run.sh").chmod(0o755)
    first: WorkspaceSync = hosts.sync_workspace(str(src)).get(timeout=T)
    assert len(first.paths) == 2
    dirs = [Path(p["proj"]) for p in first.paths.values()]
    assert dirs[0] != dirs[1]  # each host its own copy
    expected = {k: v for k, v in _tree(src).items() if not k.startswith(".git")}
    for d in dirs:
        assert _tree(d) == expected
        assert os.stat(d / "run.sh").st_mode & 0o777 == 0o755
    assert first.files_sent == 2 * 5 and first.bytes_sent >= 2 * len(big)

    (src / "a.py").write_text("A = 2\n")
    (src / "c.txt").write_text("new")
    (src / "sub" / "b.txt").unlink()
    old_data_inode = os.stat(dirs[0] / "data.bin").st_ino
    second = hosts.sync_workspace(str(src)).get(timeout=T)
    assert second.files_sent == 2 * 2 and second.bytes_sent == 2 * len(b"A = 2\nnew")  # only what changed travelled
    assert second.changed == {"proj": ["a.py", "c.txt", "sub/b.txt"]}
    expected = {k: v for k, v in _tree(src).items() if not k.startswith(".git")}
    for d in dirs:
        assert _tree(d) == expected
        assert not (d / "sub" / "b.txt").exists()
    assert os.stat(dirs[0] / "data.bin").st_ino == old_data_inode  # unchanged content is linked, not copied

    third = hosts.sync_workspace([str(src)]).get(timeout=T)
    assert third.files_sent == 0 and third.changed == {"proj": []}


_MODULE_V1 = '''
from actormesh.actor import Actor, endpoint

def version():
    return "v1"

class Greeter(Actor):
    @endpoint
    def hello(self):
        return "hello " + version()
'''


def test_procs_import_the_synced_code_and_auto_reload_runs_the_new_code(hosts: Any, tmp_path: Path) -> None:
    mod = f"am_sync_{os.getpid()}"
    src = tmp_path / "code"
    _write(src, {f"{mod}.py": _MODULE_V1.encode()})
    hosts.sync_workspace(src).get(timeout=T)
    sys.path.insert(0, str(src))  # the controller pickles the class by reference; the procs import their synced copy
    try:
        module = __import__(mod)
        procs = hosts.spawn_procs(per_host={"gpus": 1})
        try:
            greeters = procs.spawn("greeter", module.Greeter)
            assert set(greeters.hello.call().get(timeout=T).values()) == {"hello v1"}
            (src / f"{mod}.py").write_text(_MODULE_V1.replace('"v1"', '"v2"'))
            report = hosts.sync_workspace(src, auto_reload=True).get(timeout=T)
            assert report.reloaded == [mod]
            assert set(greeters.hello.call().get(timeout=T).values()) == {"hello v2"}  # the same actors, new code
        finally:
            procs.stop().get(timeout=T)
    finally:
        sys.path.remove(str(src))
        sys.modules.pop(mod, None)


def test_a_reader_never_sees_half_a_sync(tmp_path: Path) -> None:
    """Each version a reader can reach through the symlink is complete and consistent."""
    src, dest = tmp_path / "w", tmp_path / "dest"
    files = [f"f{i}.txt" for i in range(20)]
    _write(src, {f: b"0" for f in files})
    this_host().sync_workspace(src, dest=str(dest)).get(timeout=T)
    stop, seen, bad = threading.Event(), set(), []

    def read() -> None:
        while not stop.is_set():
            real = os.path.realpath(dest / "w")
            try:
                values = {(Path(real) / f).read_bytes() for f in files}
            except FileNotFoundError:
                continue  # a version two syncs old was pruned under us: resolve again
            (seen.update if len(values) == 1 else bad.append)(values)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for v in range(1, 15):
            _write(src, {f: str(v).encode() for f in files})
            this_host().sync_workspace(src, dest=str(dest)).get(timeout=T)
    finally:
        stop.set()
        reader.join(timeout=T)
    assert not bad, f"a reader saw a mixed tree: {bad[:3]}"
    assert _tree(dest / "w") == {f: b"14" for f in files}


def test_errors_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist here"):
        this_host().sync_workspace(str(tmp_path / "missing"))
    with pytest.raises(TypeError, match="directory path"):
        this_host().sync_workspace(42)
    with pytest.raises(NotImplementedError, match="conda"):
        this_host().sync_workspace(str(tmp_path), conda=True)
    (tmp_path / "dest" / "w").mkdir(parents=True)
    (tmp_path / "w").mkdir()
    with pytest.raises(RuntimeError, match="not a synced workspace"):
        this_host().sync_workspace(tmp_path / "w", dest=str(tmp_path / "dest")).get(timeout=T)


def test_a_corrupt_or_missing_content_changes_nothing(tmp_path: Path) -> None:
    store = WorkspaceStore(str(tmp_path / "root"))
    manifest = {"x": ("f", 3, 0o644, "0" * 64)}
    sid, needed = store.begin({"w": manifest})
    assert needed == ["0" * 64]
    store.put(sid, "0" * 64, 0, b"abc")
    with pytest.raises(ValueError, match="missing or corrupt"):
        store.commit(sid)
    assert not (tmp_path / "root" / "w").exists()
    sid, _ = store.begin({"w": manifest})  # the failed session released the name
    store.abort(sid)


_NETNS_CONTROLLER = """
import json, os, subprocess, sys
from pathlib import Path
from actormesh import config
bridge_ip, src, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
config.configure(default_transport="tcp", bind_host=bridge_ip)
from actormesh.mesh import HostMesh
from actormesh.runtime import current_runtime

rt = current_runtime()
secret = os.path.join(rt.job_dir, "secret")
fd = os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600)
os.write(fd, rt.secret.hex().encode()); os.close(fd)
agents, addrs = [], []
try:
    for i, (ns, ip) in enumerate(zip(sys.argv[4::2], sys.argv[5::2])):
        p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "actormesh.host", "--address", f"tcp:{ip}:0",
                              "--secret-file", secret, "--print-address", "--workspace-dir", str(out / f"ws{i}")],
                             stdout=subprocess.PIPE, text=True)
        agents.append(p)
        addrs.append(p.stdout.readline().strip())
    hosts = HostMesh(agents=addrs)
    first = hosts.sync_workspace(src).get(timeout=60)
    (src / "a.txt").write_text("changed")
    (src / "new.txt").write_text("added")
    (src / "gone.txt").unlink()
    second = hosts.sync_workspace(src).get(timeout=60)
    print(json.dumps({"addrs": addrs, "paths": second.paths, "changed": second.changed, "sent": [first.files_sent, second.files_sent]}))
finally:
    for p in agents:
        p.terminate()
        p.wait(timeout=30)
"""


def test_hosts_in_separate_network_namespaces(tmp_path: Path) -> None:
    """Agents in their own network namespaces, reached over a bridge: files travel over TCP between namespaces."""
    import json
    import subprocess

    with bridged_namespaces(2, "ams") as net:
        src = tmp_path / "src"
        _write(src, {"a.txt": b"one", "gone.txt": b"bye", "pkg/m.py": b"X = 1\n"})
        script = tmp_path / "controller.py"
        script.write_text(_NETNS_CONTROLLER)
        ns_args = [a for i, ns in enumerate(net.namespaces) for a in (ns, net.address(i))]
        out = subprocess.run([sys.executable, str(script), net.address(), str(src), str(tmp_path), *ns_args],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert [a.rsplit(":", 1)[0] for a in got["addrs"]] == [f"tcp:{net.address(0)}", f"tcp:{net.address(1)}"]
        assert got["sent"] == [2 * 3, 2 * 2] and got["changed"] == {"src": ["a.txt", "gone.txt", "new.txt"]}
        for i in range(2):
            assert _tree(tmp_path / f"ws{i}" / "src") == {"a.txt": b"changed", "new.txt": b"added", "pkg/m.py": b"X = 1\n"}


def test_a_monarch_style_workspace_with_renames_and_excludes(tmp_path: Path) -> None:
    class Workspace:  # the shape of Monarch's monarch.tools.config.workspace.Workspace
        def __init__(self, dirs: Any) -> None:
            self.dirs = dirs

    a, b, dest = tmp_path / "a", tmp_path / "b", tmp_path / "dest"
    _write(a, {"x.py": b"x", "skip.log": b"no", "build/out": b"no"})
    _write(b, {"y.txt": b"y", "x.copy": b"x"})
    report = this_host().sync_workspace(Workspace({str(a): "code", str(b): "data"}), dest=str(dest), exclude=["*.log", "build"]).get(timeout=T)
    assert _tree(dest / "code") == {"x.py": b"x"} and _tree(dest / "data") == {"y.txt": b"y", "x.copy": b"x"}
    assert report.files_sent == 2  # the same content under two names travels once
    (tmp_path / "x" / "a").mkdir(parents=True)
    with pytest.raises(ValueError, match="same name"):
        this_host().sync_workspace([str(a), str(tmp_path / "x" / "a")])
