"""Typed endpoints: mypy sees an endpoint's signature through the adverbs.

Runs mypy on tests/typing_cases/endpoints.py (a user program, never executed)
and checks every ``reveal_type`` and the two deliberate argument errors.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy")

CASE = Path(__file__).parent / "typing_cases" / "endpoints.py"


@pytest.fixture(scope="module")
def mypy_lines() -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent", "--ignore-missing-imports", "--no-error-summary", str(CASE)],
        capture_output=True, text=True, timeout=240,
    )
    return out.stdout.splitlines()


def _revealed(lines: list[str]) -> list[str]:
    found = [re.search(r'Revealed type is "(.*)"', line) for line in lines]
    return [m.group(1).replace("actormesh.runtime._future.", "").replace("actormesh.mesh._value_mesh.", "") for m in found if m]


def test_adverbs_carry_the_endpoint_return_type(mypy_lines: list[str]) -> None:
    assert _revealed(mypy_lines) == [
        "Future[int]",  # call_one of a sync endpoint
        "ValueMesh[int]",  # call(...).get()
        "Future[str]",  # async endpoint: the coroutine's result type
        "Future[float]",  # explicit_response_port: the port's type
        "typing.Iterator[Future[bytes]]",  # concurrent endpoint, stream
        "Future[list[int]]",  # @endpoint(options) keeps the signature
    ], mypy_lines


def test_wrong_arguments_are_type_errors(mypy_lines: list[str]) -> None:
    errors = [line for line in mypy_lines if ": error:" in line]
    assert len(errors) == 2, mypy_lines
    assert 'incompatible type "str"; expected "int"' in errors[0]
    assert 'Missing positional argument "by"' in errors[1]


def test_the_package_declares_its_types() -> None:
    import actormesh

    assert (Path(actormesh.__file__).parent / "py.typed").exists()
