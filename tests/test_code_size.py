"""STYLE.md's size rules, read from the source: no module over 400 lines, no function over 60."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "actormesh"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def oversized(root: Path) -> list[str]:
    """``path: what`` for each module or function over its limit under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(root.parent)
        if text.count("\n") > MAX_MODULE_LINES:
            found.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{name}:{node.lineno} {node.name}() is {lines} lines")
    return found


def test_no_module_or_function_is_over_its_limit() -> None:
    assert oversized(SRC) == [], "split these (STYLE.md: modules <= 400 lines, functions <= 60)"


def test_the_check_finds_a_long_function_and_a_long_module(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (pkg / "long_fn.py").write_text(f"def f():\n{body}")
    (pkg / "long_mod.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (pkg / "fine.py").write_text("def g():\n    return 1\n")
    assert oversized(pkg) == ["pkg/long_fn.py:1 f() is 61 lines", "pkg/long_mod.py: 401 lines"]
