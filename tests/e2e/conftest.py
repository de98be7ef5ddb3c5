"""Fixtures of the container tests: the Docker gate, test credentials, the image.

Without a Docker engine these tests skip with the reason, except when
REQUIRE_DOCKER=1 (as .ci/run sets it, after docker/ci-setup.sh started one):
then a missing engine fails them.
"""

from __future__ import annotations

import os

import pytest

from tests.e2e import image_build
from tests.e2e.e2e_cluster import LOG_DIR, Secrets
from tests.e2e.image_build import IMAGE, docker_engine_problem


@pytest.fixture(scope="session")
def docker_engine() -> None:
    problem = docker_engine_problem()
    if problem is None:
        return
    if os.environ.get("REQUIRE_DOCKER") == "1":
        pytest.fail(f"REQUIRE_DOCKER=1 but {problem}")
    pytest.skip(f"needs Docker: {problem}")


@pytest.fixture(scope="session")
def test_secrets() -> Secrets:
    """Credentials made for this test run: in the build's and the containers' environments only."""
    return image_build.session_secrets()


@pytest.fixture(scope="session")
def image(docker_engine, test_secrets) -> str:
    """The cpu image, built by docker/build-offline.sh (debootstrap base + wheelhouse, both cached), in the
    background from the end of collection (tests/e2e/image_build.py); this waits for it."""
    rc, seconds = image_build.wait()
    if rc != 0:
        tail = (LOG_DIR / "build.log").read_text()[-4000:]
        pytest.fail(f"docker/build-offline.sh failed ({rc}) after {seconds:.0f}s:\n{tail}")
    print(f"\n[e2e] image {IMAGE} built or reused {seconds:.1f}s after the build started (log: {LOG_DIR / 'build.log'})")
    return IMAGE
