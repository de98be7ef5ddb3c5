"""Fixtures of every tier: a free TCP port and a ``python -m ray_app`` runner (helpers: tests/support).

Every test runs under a timeout sized for its tier (pytest-timeout), so a hang fails within minutes with
the test's name instead of at CI's wall; a test may set its own with ``@pytest.mark.timeout(s)``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.ports import free_port
from tests.support.processes import run_cli

TESTS = Path(__file__).resolve().parent
# seconds per test, fixtures included: the slowest test of each tier measured (under make test's units
# side by side), times two or more
TIER_TIMEOUT_S = {"unit": 180, "deploy": 180, "bench": 600, "integration": 600, "e2e": 900}
# the first e2e test that needs the image also builds it (docker/build-offline.sh allows 1500 s)
IMAGE_BUILD_TIMEOUT_S = 1500 + TIER_TIMEOUT_S["e2e"]


def tier_of(item: pytest.Item) -> str | None:
    try:
        return Path(str(item.fspath)).resolve().relative_to(TESTS).parts[0]
    except ValueError:
        return None


def pytest_collection_modifyitems(config, items):
    # the e2e tier runs last: the image it needs builds in the background meanwhile (tests/e2e/image_build.py)
    items.sort(key=lambda item: tier_of(item) == "e2e")
    needs_image = any(tier_of(item) == "e2e" and "image" in getattr(item, "fixturenames", ()) for item in items)
    if needs_image and not config.option.collectonly:
        from tests.e2e.image_build import docker_engine_problem, start

        if docker_engine_problem() is None:
            start()
    image_built = False
    for item in items:
        if item.get_closest_marker("timeout") is not None:
            continue
        tier = tier_of(item)
        seconds = TIER_TIMEOUT_S.get(tier)
        if seconds is None:
            continue
        if tier == "e2e" and "image" in getattr(item, "fixturenames", ()) and not image_built:
            seconds, image_built = IMAGE_BUILD_TIMEOUT_S, True
        item.add_marker(pytest.mark.timeout(seconds))


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


def pytest_sessionfinish(session, exitstatus):
    from tests.e2e.image_build import stop

    stop()  # a background build that no test waited for (the session ended before the e2e tier)
