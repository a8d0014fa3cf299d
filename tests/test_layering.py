"""The layering of DESIGN.md section 1, checked on the source: imports point down
only, through each layer's public surface.

Every import counts: at module level, inside functions, under ``TYPE_CHECKING``,
and ``importlib.import_module("actormesh....")`` by name. A lower layer that needs
something above it offers a typed registration the upper layer calls
(``use_tensor_engine``, ``use_proc_view``, ``use_dashboard``, ``add_cast_hook``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "actormesh"

#: Layer of each top-level name under actormesh, lowest first (DESIGN.md section 1).
#: Names of one rank may import each other; ``host`` is the host agent's entry point
#: (``python -m actormesh.host``), which the job layer starts in-process too.
RANK = {
    "errors": 0, "config": 0, "telemetry": 0, "extent": 0, "_monarch_config": 0,
    "transport": 1,
    "runtime": 2,
    "mesh": 3, "host": 3,
    "job": 4,
    "rdma": 5,
    "tensor": 6,
    "parallel": 7, "spmd": 7,
    "integrations": 8,
    "serve": 9,
    "rl": 10,
    "cli": 11, "dashboard": 11, "debug": 11,
    # Above every layer: the package's lazy names, the facade and its stand-ins,
    # and the programs a proc runs (worker, zygote).
    "__init__": 12, "actor": 12, "_standins": 12, "worker": 12, "zygote": 12,
}


def _module_name(path: Path) -> tuple[str, str]:
    """(module, package it is in) for a file under SRC."""
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
        return ".".join(parts), ".".join(parts)
    return ".".join(parts), ".".join(parts[:-1])


def _layer(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _imports(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, dotted target) for every import of actormesh code in ``tree``: a module,
    or ``module.name`` for ``from module import name`` (the name may be a submodule)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "actormesh" or module.startswith("actormesh."):
                # `from . import x` names a module; `from .x import y` may too (y a submodule).
                found += [(node.lineno, f"{module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("actormesh")]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and node.args[0].value.startswith("actormesh.")
              and isinstance(node.func, (ast.Attribute, ast.Name))
              and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) in ("import_module", "__import__")):
            found.append((node.lineno, node.args[0].value))
    return found


def _private(target: str) -> bool:
    """Whether ``target`` reaches below a layer's surface (``runtime._cast``, ``runtime._x``)."""
    return any(p.startswith("_") and not p.startswith("__") for p in target.split(".")[2:])


def _violations() -> list[str]:
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        module, package = _module_name(path)
        src = _layer(module)
        assert src in RANK, f"{module}: a new top-level name; give it a layer in RANK ({path})"
        for line, target in _imports(ast.parse(path.read_text()), package):
            dst = _layer(target)
            if dst == src or dst not in RANK:
                continue  # within a layer, or `from actormesh import <name>` of the package's lazy names
            where = f"{path.relative_to(SRC.parent)}:{line} imports {target}"
            if RANK[dst] > RANK[src]:
                bad.append(f"{where}: upward ({src} -> {dst})")
            if _private(target):
                bad.append(f"{where}: a private module of another layer ({dst})")
    return bad


def test_imports_point_down_through_public_surfaces() -> None:
    bad = _violations()
    assert not bad, "layering (DESIGN.md section 1):\n" + "\n".join(bad)


@pytest.mark.parametrize("source, expected", [
    ("from ..mesh import ProcMesh\n", "upward"),
    ("def f():\n    from ..tensor import activate\n", "upward"),
    ("import importlib\nimportlib.import_module('actormesh.tensor')\n", "upward"),
    ("from ..transport._frames import x\n", "private"),
    ("from ..transport import _frames\n", "private"),
    ("import actormesh.mesh._views\n", "upward private"),
    ("from ..transport import dumps\nfrom . import _cell\n", None),
])
def test_the_check_sees_what_it_must(tmp_path: Path, source: str, expected: str | None) -> None:
    """The checker on a made-up runtime module, so a silent checker fails here."""
    found = _imports(ast.parse(source), "actormesh.runtime")
    kinds = set()
    for _, target in found:
        dst = _layer(target)
        if dst != "runtime" and RANK[dst] > RANK["runtime"]:
            kinds.add("upward")
        if dst != "runtime" and _private(target):
            kinds.add("private")
    assert kinds == (set(expected.split()) if expected else set())


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_facade_stands_in_for_the_optional_layers_until_they_load() -> None:
    """``import actormesh.actor`` loads neither torch nor FastAPI; ``procs.activate()``
    reaches the tensor engine through the facade's stand-in, which the engine replaces
    once imported."""
    out = _run(
        "import sys\n"
        "import actormesh.actor\n"
        "from actormesh._standins import LazyTensorEngine\n"
        "from actormesh.mesh import tensor_engine\n"
        "assert isinstance(tensor_engine(), LazyTensorEngine)\n"
        "print(sorted(m for m in ('torch', 'actormesh.tensor', 'actormesh.dashboard', 'fastapi') if m in sys.modules))\n"
        "import actormesh.tensor\n"
        "print(tensor_engine() is actormesh.tensor.MESH_ENGINE)\n")
    assert out.split() == ["[]", "True"]


def test_without_the_facade_the_missing_layer_is_named() -> None:
    out = _run(
        "from actormesh.mesh import ProcMesh\n"
        "try:\n"
        "    ProcMesh.activate(None)\n"
        "except RuntimeError as exc:\n"
        "    print(exc)\n")
    assert "ProcMesh.activate() needs the tensor engine" in out and "import actormesh.tensor" in out
