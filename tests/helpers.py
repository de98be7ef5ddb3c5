"""Small helpers shared by the test tiers (imported as ``tests.helpers``)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def stop_process(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``grace_s``."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(grace_s)


def promtool() -> str:
    """Path of promtool; skip without it, unless CI says Prometheus must be there."""
    path = shutil.which("promtool")
    if path:
        return path
    if os.environ.get("REQUIRE_DOCKER") == "1" or os.environ.get("REQUIRE_PROMETHEUS") == "1":
        pytest.fail("promtool is required (REQUIRE_DOCKER/REQUIRE_PROMETHEUS=1): apt-get install -y prometheus")
    pytest.skip("promtool not installed (apt-get install -y prometheus)")
