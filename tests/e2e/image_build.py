"""The cpu image's build, started in the background as soon as a session knows it will need it.

`docker/build-offline.sh` (debootstrap base, wheelhouse, `docker build`) takes minutes on a fresh
machine, mostly waiting on the network, the disk and single-threaded unpacking. The root conftest starts
it when collection ends if a selected test uses the ``image`` fixture, and runs the e2e tier last, so the
build overlaps the other tiers; the fixture then only waits for it. The build runs with the session's
test credentials exported, as a developer's shell with AWS keys would be; test_image.py checks no layer
kept them.
"""

from __future__ import annotations

import os
import subprocess
import time

from tests.e2e.e2e_cluster import LOG_DIR, REPO, Secrets

IMAGE = os.environ.get("IMAGE", "ray-app:0.1.0")  # = the Makefile's IMAGE
BUILD_TIMEOUT_S = 1500
_SESSION: dict = {}  # secrets, and the build when one was started: proc, log, t0


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


def session_secrets() -> Secrets:
    """Credentials made for this test run: in the build's and the containers' environments only."""
    if "secrets" not in _SESSION:
        _SESSION["secrets"] = Secrets.generate()
    return _SESSION["secrets"]


def start() -> None:
    """Start the build once (a second call does nothing); its output goes to build/e2e-logs/build.log."""
    if "proc" in _SESSION:
        return
    creds = session_secrets()
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "IMAGE": IMAGE, "AWS_ACCESS_KEY_ID": creds.s3_access_key,
           "AWS_SECRET_ACCESS_KEY": creds.s3_secret_key, "RAY_AUTH_TOKEN": creds.ray_token}
    log = open(LOG_DIR / "build.log", "w")  # noqa: SIM115 - closed by wait() or stop()
    _SESSION.update(log=log, t0=time.monotonic(),
                    proc=subprocess.Popen(["bash", "docker/build-offline.sh"], cwd=REPO, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))


def wait() -> tuple[int, float]:
    """Start the build if nothing did, wait for it; (exit code, seconds since it started)."""
    start()
    proc = _SESSION["proc"]
    try:
        rc = proc.wait(timeout=max(1.0, BUILD_TIMEOUT_S - (time.monotonic() - _SESSION["t0"])))
    except subprocess.TimeoutExpired:
        stop()
        rc = -9
    _SESSION["log"].close()
    return rc, time.monotonic() - _SESSION["t0"]


def stop() -> None:
    """End a build still running (a session that ends before the e2e tier)."""
    proc = _SESSION.get("proc")
    if proc is not None and proc.poll() is None:
        import signal

        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
