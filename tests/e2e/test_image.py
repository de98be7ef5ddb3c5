"""The images, built: the build context holds no secrets, the image runs as a non-root user and keeps no
credentials in any layer, the gpu stage builds on a local base. Its files without an engine:
tests/deploy/test_docker_files.py."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.e2e.e2e_cluster import REPO, docker

pytestmark = pytest.mark.e2e


def test_build_context_cannot_hold_secrets(docker_engine, tmp_path):
    """.dockerignore is an allowlist: secrets, venvs and run output never reach the build context.

    Checked with the engine's own rules: a context of decoy files plus the real
    .dockerignore is copied whole into a scratch image, whose files are listed.
    """
    decoys = [".ray-token", ".minio-secret", ".env", "docker/.env", ".aws/credentials", ".venv/bin/python",
              "runs/r/ckpt/model.pt", ".git/config", "build/e2e-logs/head.log", "id_rsa", "docker/compose.yaml"]
    kept = ["pyproject.toml", "README.md", "ray_app/driver/cli.py", "configs/cluster.yaml",
            "docker/requirements-cpu.txt", "build/wheelhouse/x-1.0-py3-none-any.whl"]
    for rel in decoys + kept:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    (tmp_path / ".dockerignore").write_text((REPO / ".dockerignore").read_text())
    tag = "ray-app-e2e-context:test"
    subprocess.run(["docker", "build", "-q", "-t", tag, "-f-", str(tmp_path)], input="FROM scratch\nCOPY . /ctx/\n",
                   text=True, check=True, capture_output=True, timeout=120)
    cid = docker("create", tag, "/none").stdout.strip()
    try:
        listing = subprocess.run(f"docker export {cid} | tar -t", shell=True, check=True, capture_output=True,
                                 text=True, timeout=120).stdout.split()
    finally:
        docker("rm", "-f", cid, check=False)
        docker("rmi", tag, check=False)
    included = {p[len("ctx/"):] for p in listing if p.startswith("ctx/") and not p.endswith("/")}
    assert not included & set(decoys), included & set(decoys)
    assert set(kept) <= included, set(kept) - included


def test_image_runs_as_numeric_non_root_user(image):
    user = docker("inspect", "-f", "{{.Config.User}}", image).stdout.strip()
    assert user == "1000:1000"
    ids = docker("run", "--rm", image, "sh", "-c", "id -u; id -g; echo $HOME; pwd; ls /app/configs").stdout.split()
    assert ids[:4] == ["1000", "1000", "/home/ray", "/app"]
    assert "cluster.yaml" in ids[4:]
    out = docker("run", "--rm", image, "ray-app", "--version").stdout
    assert "ray-app" in out


def test_image_carries_the_hf_and_tracking_extras(image):
    """`model.name: hf`, LoRA and tracking run in the image as shipped: their libraries import (from the
    image's venv, offline), each at the version docker/requirements-cpu.txt pins."""
    code = ("import importlib.metadata as m, transformers, safetensors, tokenizers, peft, mlflow, tensorboard; "
            "print(' '.join(f'{n}=={m.version(n)}' for n in ('transformers', 'safetensors', 'tokenizers', 'peft')))")
    out = docker("run", "--rm", image, "python", "-c", code).stdout.split()
    pinned = set((REPO / "docker" / "requirements-cpu.txt").read_text().split())
    assert len(out) == 4 and set(out) <= pinned, (out, sorted(p for p in pinned if p.startswith(("trans", "peft"))))


def test_image_holds_no_credentials(image, test_secrets):
    """The build ran with the test credentials in its environment: no layer, no file has them."""
    history = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", image).stdout
    config = docker("inspect", image).stdout
    for text, where in ((history, "docker history"), (config, "docker inspect")):
        for value in test_secrets.values():
            assert value not in text, f"a test credential is in {where}"
        assert not re.search(r"(AWS_SECRET_ACCESS_KEY|AWS_ACCESS_KEY_ID|RAY_AUTH_TOKEN|MINIO_ROOT_PASSWORD)=", text), where
    # Every file of the image's filesystem, streamed: `docker export` of a created (never started) container.
    cid = docker("create", image).stdout.strip()
    try:
        found = _stream_contains(["docker", "export", cid], [v.encode() for v in test_secrets.values()])
    finally:
        docker("rm", "-f", cid, check=False)
    assert not any(found), "a test credential is in the image's filesystem"
    # Ray's token file is written by `ray start --head` at run time, never at build time.
    listing = docker("run", "--rm", image, "sh", "-c", "ls -a /home/ray /home/ray/.ray 2>&1; ls -a /app").stdout
    assert "auth_token" not in listing and ".ray-token" not in listing


def _stream_contains(cmd: list[str], needles: list[bytes]) -> list[bool]:
    """Which needles occur in ``cmd``'s output, read in chunks (the image is ~2 GB)."""
    found = [False] * len(needles)
    keep = max(len(n) for n in needles)
    tail = b""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE) as proc:
        while chunk := proc.stdout.read(8 << 20):
            buf = tail + chunk
            for i, n in enumerate(needles):
                found[i] = found[i] or n in buf
            tail = buf[-keep:]
        assert proc.wait() == 0
    return found


def test_gpu_stage_without_cuda_base(image):
    """The gpu target's base stage (the numeric user; no Python installed over the base's) on the cpu image's
    bookworm base, from the gpu target's stages alone (docker/stages.sh), as build-offline.sh builds them.

    The whole gpu image (CUDA torch from a wheelhouse, about 7 GB) is built and run in the long tier:
    tests/e2e/test_gpu_image.py.
    """
    tag = "ray-app-e2e-gpu-base:test"
    dockerfile = subprocess.run(["bash", "docker/stages.sh", "gpu"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout
    assert "AS cpu" not in dockerfile and "AS gpu-base" in dockerfile
    out = subprocess.run(["docker", "build", "-f", "-", "--target", "gpu-base",
                          "--build-arg", "GPU_BASE_IMAGE=ray-app-base:bookworm", "-t", tag, "."], cwd=REPO,
                         input=dockerfile, capture_output=True, text=True, timeout=900)
    try:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        ids = docker("run", "--rm", "--user", "1000:1000", tag, "sh", "-c",
                     "id -un; echo $HOME; python3 -m venv /tmp/v && /tmp/v/bin/python -c "
                     "'import sys; print(\"%d.%d\" % sys.version_info[:2])'").stdout.split()
        assert ids == ["ray", "/home/ray", "3.11"]  # the base's own Python (bookworm's), for the cp311 wheels
    finally:
        docker("rmi", tag, check=False)
