"""The code passes the linter the project configures (pyproject.toml [tool.ruff]); `make lint` runs the same."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is a dev dependency: pip install -e .[dev]")
    out = subprocess.run([ruff, "check", "ray_app", "bench", "tests"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
