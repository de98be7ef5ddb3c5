"""Fixtures of the container tests: the Docker gate, test credentials, the image.

Without a Docker engine these tests skip with the reason, except when
REQUIRE_DOCKER=1 (as .ci/run sets it, after docker/ci-setup.sh started one):
then a missing engine fails them.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.e2e.e2e_cluster import LOG_DIR, REPO, Secrets

IMAGE = os.environ.get("IMAGE", "ray-app:0.1.0")  # = the Makefile's IMAGE


def docker_engine_problem() -> str | None:
    """None when `docker info` answers, else why not."""
    try:
        out = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True,
                             text=True, timeout=30)
    except FileNotFoundError:
        return "no docker CLI on PATH (docker/ci-setup.sh installs and starts the engine)"
    except subprocess.TimeoutExpired:
        return "docker info timed out"
    if out.returncode != 0:
        return f"no Docker engine answers ({out.stderr.strip().splitlines()[-1] if out.stderr.strip() else 'docker info failed'})"
    return None


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
    return Secrets.generate()


@pytest.fixture(scope="session")
def image(docker_engine, test_secrets) -> str:
    """The cpu image, built by docker/build-offline.sh (debootstrap base + wheelhouse, both cached).

    The build runs with the test credentials exported, as a developer's shell
    with AWS keys would be; test_image.py then checks no layer kept them.
    """
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "IMAGE": IMAGE, "AWS_ACCESS_KEY_ID": test_secrets.s3_access_key,
           "AWS_SECRET_ACCESS_KEY": test_secrets.s3_secret_key, "RAY_AUTH_TOKEN": test_secrets.ray_token}
    t0 = time.monotonic()
    with open(LOG_DIR / "build.log", "w") as log:
        proc = subprocess.run(["bash", "docker/build-offline.sh"], cwd=REPO, env=env, stdout=log,
                              stderr=subprocess.STDOUT, timeout=1500)
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        tail = (LOG_DIR / "build.log").read_text()[-4000:]
        pytest.fail(f"docker/build-offline.sh failed ({proc.returncode}) after {seconds:.0f}s:\n{tail}")
    print(f"\n[e2e] image {IMAGE} built or reused in {seconds:.1f}s (log: {LOG_DIR / 'build.log'})")
    return IMAGE
