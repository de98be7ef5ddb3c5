"""Fixtures of every tier: a free TCP port and a ``python -m ray_app`` runner (helpers: tests/support)."""

from __future__ import annotations

import pytest

from tests.support.ports import free_port
from tests.support.processes import run_cli

# Fixtures rather than `from conftest import ...`: each tier may have its own conftest.py, and
# which one `import conftest` finds depends on what pytest collected first.

@pytest.fixture(name="run_cli", scope="session")
def run_cli_fixture():
    """``run_cli(args, env=None, timeout=120, cwd=None, console_script=False) -> (rc, stdout, stderr)``."""
    return run_cli


@pytest.fixture(scope="session")
def port_picker():
    """A callable returning a free port, for module- or session-scoped fixtures."""
    return free_port
