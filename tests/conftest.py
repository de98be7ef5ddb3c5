"""Shared fixtures: a free TCP port and a ``python -m ray_app`` runner."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pick_free_port() -> int:
    """A port nobody listens on right now (bound once, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def free_port() -> int:
    return pick_free_port()


def run_cli(args: list[str], env: dict | None = None, timeout: float = 120, cwd: str | os.PathLike | None = None):
    """Run ``python -m ray_app ARGS``; returns (returncode, stdout, stderr).

    ``env`` entries are added to (not replacing) this process's environment;
    an entry whose value is None removes that variable (e.g. ``{"RAY_ADDRESS": None}``).
    ``cwd`` defaults to the repository root, where configs/local.yaml lives.
    """
    full_env = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    proc = subprocess.run([sys.executable, "-m", "ray_app", *args], cwd=str(cwd or REPO), env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


# Fixtures rather than `from conftest import ...`: tests/e2e has its own conftest.py, and
# which one `import conftest` finds depends on what pytest collected first.

@pytest.fixture(name="run_cli", scope="session")
def run_cli_fixture():
    """``run_cli(args, env=None, timeout=120, cwd=None) -> (rc, stdout, stderr)``."""
    return run_cli


@pytest.fixture(scope="session")
def port_picker():
    """A callable returning a free port, for module- or session-scoped fixtures."""
    return pick_free_port
