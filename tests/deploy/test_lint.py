"""The code passes the linter the project configures (pyproject.toml [tool.ruff]; `make lint` runs the same), for
the Python versions the package accepts; the files its package data names exist."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
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


def test_ruff_targets_the_oldest_python_the_package_accepts():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    oldest = re.fullmatch(r">=\s*3\.(\d+)", meta["project"]["requires-python"]).group(1)
    assert meta["tool"]["ruff"]["target-version"] == f"py3{oldest}"


def test_package_data_the_package_promises_exists():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    for package, names in meta["tool"]["setuptools"]["package-data"].items():
        for name in names:
            assert list((REPO / package).glob(name)), f"pyproject.toml ships {package}/{name}, which does not exist"
