"""Shared fixtures: a free TCP port and a ``python -m ray_app`` runner."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.helpers import run_cli

REPO = Path(__file__).resolve().parents[1]


def pick_free_port() -> int:
    """A port nobody listens on right now (bound once, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def free_port() -> int:
    return pick_free_port()


# Fixtures rather than `from conftest import ...`: tests/e2e has its own conftest.py, and
# which one `import conftest` finds depends on what pytest collected first.

@pytest.fixture(name="run_cli", scope="session")
def run_cli_fixture():
    """``run_cli(args, env=None, timeout=120, cwd=None, console_script=False) -> (rc, stdout, stderr)``."""
    return run_cli


@pytest.fixture(scope="session")
def port_picker():
    """A callable returning a free port, for module- or session-scoped fixtures."""
    return pick_free_port
