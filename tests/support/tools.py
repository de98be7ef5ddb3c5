"""Command-line tools the tests run: the project's venv first, then PATH."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"


def venv_tool(name: str) -> str:
    """A console script of the project's venv (or of the running interpreter's), else the one on PATH."""
    for folder in (VENV_BIN, Path(sys.executable).parent):
        if (folder / name).exists():
            return str(folder / name)
    return shutil.which(name) or name


def promtool() -> str:
    """Path of promtool; skip without it, unless CI says Prometheus must be there."""
    path = shutil.which("promtool")
    if path:
        return path
    if os.environ.get("REQUIRE_DOCKER") == "1" or os.environ.get("REQUIRE_PROMETHEUS") == "1":
        pytest.fail("promtool is required (REQUIRE_DOCKER/REQUIRE_PROMETHEUS=1): apt-get install -y prometheus")
    pytest.skip("promtool not installed (apt-get install -y prometheus)")
