"""The package type-checks (mypy, configured in pyproject.toml's ``[tool.mypy]``).

Every module must stay clean (none is exempt since issue 13, item 6), so a
signature change that breaks a caller fails here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(600)
def test_the_package_type_checks() -> None:
    pytest.importorskip("mypy")
    done = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary"], cwd=ROOT, capture_output=True,
                          text=True, timeout=560)
    assert done.returncode == 0, f"mypy found type errors:\n{done.stdout}{done.stderr}"
