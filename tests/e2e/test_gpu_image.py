"""The gpu image, built here with no registry and run here with no GPU (`make test-long` only: it is about 7 GB
and its first build takes minutes).

`docker/build-offline.sh` with TARGET=gpu builds it from the cpu image's debootstrap base and a wheelhouse of
torch's CUDA build and its nvidia-* wheels. Then, without a GPU: the image runs as the kit's non-root user with the
environment the NVIDIA container runtime reads, its torch is the CUDA build (``torch.version.cuda``), NCCL answers
(``torch.cuda.nccl.version()``), the CUDA runtime and NCCL libraries load, `ray-app train` runs the default job inside
it on the CPU, and a cluster of its containers (head + 2 workers) trains one DDP job across the two workers. The
image's size and build time are printed and written to build/e2e-logs/gpu-image.json. The Dockerfile's static
checks (the two targets agree): tests/deploy/test_docker_files.py.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import time

import pytest

from tests.e2e.e2e_cluster import LOG_DIR, REPO, ContainerCluster, docker, rank_placements, summary_of

pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.slow, pytest.mark.timeout(3600)]

GPU_IMAGE = os.environ.get("IMAGE_GPU", "ray-app:0.1.0-gpu")  # = the Makefile's IMAGE_GPU
BUILD_TIMEOUT_S = 3000
EPOCHS = 3


@pytest.fixture(scope="module")
def gpu_image(docker_engine, test_secrets) -> str:
    """`TARGET=gpu docker/build-offline.sh`, with the test credentials in its environment (none may reach the
    image); its figures go to build/e2e-logs/gpu-image.json."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TARGET": "gpu", "IMAGE": GPU_IMAGE, "AWS_ACCESS_KEY_ID": test_secrets.s3_access_key,
           "AWS_SECRET_ACCESS_KEY": test_secrets.s3_secret_key, "RAY_AUTH_TOKEN": test_secrets.ray_token}
    t0 = time.monotonic()
    with open(LOG_DIR / "build-gpu.log", "w") as log:
        out = subprocess.run(["bash", "docker/build-offline.sh"], cwd=REPO, env=env, stdout=log,
                             stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S)
    seconds = time.monotonic() - t0
    text = (LOG_DIR / "build-gpu.log").read_text()
    assert out.returncode == 0, f"docker/build-offline.sh (gpu) failed ({out.returncode}):\n{text[-4000:]}"
    size = int(docker("image", "inspect", "-f", "{{.Size}}", GPU_IMAGE).stdout)
    steps = re.findall(r"\[build-offline\] .*: \d+ MB; .*", text)
    figures = {"image": GPU_IMAGE, "bytes": size, "gb": round(size / 1e9, 2), "build_s": round(seconds, 1),
               "steps": steps[-1] if steps else None}
    (LOG_DIR / "gpu-image.json").write_text(json.dumps(figures, indent=1) + "\n")
    print(f"\n[e2e] gpu image {GPU_IMAGE}: {size / 1e9:.2f} GB, built or reused in {seconds:.0f} s "
          f"({figures['steps']}; log: {LOG_DIR / 'build-gpu.log'})")
    return GPU_IMAGE


def run_in(image: str, *argv: str, timeout: float = 600, flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return docker("run", "--rm", *flags, image, *argv, timeout=timeout, check=False)


def test_the_gpu_image_runs_as_the_kits_user_with_the_nvidia_runtimes_environment(gpu_image, test_secrets):
    config = json.loads(docker("inspect", gpu_image).stdout)[0]["Config"]
    assert config["User"] == "1000:1000" and config["WorkingDir"] == "/app" and config["Cmd"] == ["ray-app", "--help"]
    assert config.get("Entrypoint") is None
    env = dict(e.split("=", 1) for e in config["Env"])
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert env["NVIDIA_REQUIRE_CUDA"] == "cuda>=13.0"
    ids = run_in(gpu_image, "sh", "-c", "id -u; id -g; echo $HOME; pwd; ray-app --version").stdout.split()
    assert ids[:4] == ["1000", "1000", "/home/ray", "/app"] and "ray-app" in ids[4:], ids
    # the build ran with test credentials in its environment: neither its history nor its config keeps them
    history = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", gpu_image).stdout
    for text in (history, json.dumps(config)):
        assert not any(value in text for value in test_secrets.values())
        assert not re.search(r"(AWS_SECRET_ACCESS_KEY|AWS_ACCESS_KEY_ID|RAY_AUTH_TOKEN)=", text)


PROBE = r"""
import ctypes, glob, json, os, torch, nvidia
lib_dirs = [p for root in nvidia.__path__ for p in glob.glob(os.path.join(root, "**", "lib"), recursive=True)]
def load(stem):
    paths = sorted(p for d in lib_dirs for p in glob.glob(os.path.join(d, stem + ".so*")))
    ctypes.CDLL(paths[0])
    return os.path.basename(paths[0])
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": list(torch.cuda.nccl.version()),
                  "cudnn": torch.backends.cudnn.version(), "cuda_available": torch.cuda.is_available(),
                  "libcudart": load("libcudart"), "libnccl": load("libnccl")}))
"""


def test_cuda_torch_answers_and_its_cuda_libraries_load_without_a_gpu(gpu_image):
    out = run_in(gpu_image, "python", "-c", PROBE)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    info = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\n[e2e] gpu image probe: {info}")
    assert info["torch"] == "2.14.1+cu130" and info["cuda"] == "13.0"
    assert info["nccl"][0] == 2 and info["nccl"] >= [2, 30, 0]
    assert info["libcudart"].startswith("libcudart.so.13") and info["libnccl"].startswith("libnccl.so.2")
    assert info["cudnn"] and info["cudnn"] >= 90000
    assert info["cuda_available"] is False  # no GPU here: the CPU path below is what runs


def test_ray_app_train_runs_the_default_job_inside_it_on_the_cpu(gpu_image):
    """configs/local.yaml as the image ships it (digits, 2 CPU workers, local Ray inside the container)."""
    t0 = time.monotonic()
    out = run_in(gpu_image, "ray-app", "train", "--config", "/app/configs/local.yaml", timeout=900,
                 flags=("--shm-size=1g", "-w", "/home/ray"))
    seconds = time.monotonic() - t0
    (LOG_DIR / "gpu-image-train.log").write_text(out.stdout + out.stderr)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = summary_of(out.stdout)
    print(f"\n[e2e] ray-app train in the gpu image (CPU): {seconds:.0f} s, {summary['epochs']} epochs, "
          f"eval_accuracy {summary['eval_accuracy']:.4f}")
    assert summary["run"] == "digits-ddp" and summary["epochs"] == 10 and summary["eval_accuracy"] >= 0.95
    assert "runs/digits-ddp/ckpt-" in summary["checkpoint"], summary["checkpoint"]


def test_a_cluster_of_its_containers_trains_across_two_workers(gpu_image, test_secrets, tmp_path):
    """Head + 2 worker containers of the gpu image (docker/compose.yaml's commands), moto S3 and Prometheus on the
    host; `ray job submit` of configs/cluster.yaml with the token: rank 0 and rank 1 on the two workers."""
    cluster = ContainerCluster(gpu_image, test_secrets, tmp_path, log_prefix="gpu-")
    t0 = time.monotonic()
    try:
        cluster.start()
        up = time.monotonic() - t0
        run, sid = f"e2e-gpu-image-{secrets.token_hex(3)}", f"e2e-job-{secrets.token_hex(3)}"
        out = cluster.submit(sid, ["--set", f"run.name={run}", "--set", f"train.epochs={EPOCHS}"], timeout=900)
        logs = cluster.job_logs(sid) or out.stdout
        (LOG_DIR / f"gpu-job-{run}.log").write_text(logs)
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
        assert cluster.job_status(sid) == "SUCCEEDED"
        placed = rank_placements(logs)
        assert set(placed) == {0, 1}, logs[-3000:]
        ips = {ip for _, ip in placed.values()}
        assert len(ips) == 2 and ips == {cluster.ip_of(w) for w in cluster.workers}, placed
        summary = summary_of(logs)
        assert summary["run"] == run and summary["epochs"] == EPOCHS
        assert cluster.s3.committed_steps(run)[-1] == summary["global_step"]
        print(f"\n[e2e] cluster of gpu-image containers up in {up:.0f} s; job of {EPOCHS} epochs across "
              f"{sorted(h for h, _ in placed.values())} in {time.monotonic() - t0 - up:.0f} s, "
              f"eval_accuracy {summary['eval_accuracy']:.4f}")
    finally:
        cluster.stop()
