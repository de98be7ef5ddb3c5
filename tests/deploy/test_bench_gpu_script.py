"""bench/gpu.sh without a GPU: on a machine with none it ends within seconds with one line and exit 2; what it
cannot run on a GPU machine (no `train.strategy: fsdp`, no Docker with the NVIDIA runtime) the page says, and
why. The GPU runs themselves need a GPU (bench/README.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench import gpu_page
from tests.support.tools import REPO

SCRIPT = REPO / "bench" / "gpu.sh"


def run_without_gpu(tmp_path, nvidia_smi: str | None) -> tuple[subprocess.CompletedProcess, float]:
    """bench/gpu.sh with a PATH of its own: no nvidia-smi at all, or a stand-in that prints ``nvidia_smi``'s
    script (what nvidia-smi does on a machine whose driver finds no GPU)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "timeout", "grep"):
        os.symlink(f"/usr/bin/{tool}" if os.path.exists(f"/usr/bin/{tool}") else f"/bin/{tool}", bin_dir / tool)
    if nvidia_smi is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/bash\n{nvidia_smi}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    t0 = time.monotonic()
    out = subprocess.run(["/bin/bash", str(SCRIPT)], capture_output=True, text=True, timeout=60,
                         env={"PATH": str(bin_dir), "HOME": str(tmp_path)})
    return out, time.monotonic() - t0


@pytest.mark.parametrize("nvidia_smi", [None, 'echo "No devices were found"; exit 6', "exit 0"],
                         ids=["no-nvidia-smi", "driver-finds-no-gpu", "lists-none"])
def test_without_a_gpu_it_ends_within_seconds_with_one_line_and_exit_2(tmp_path, nvidia_smi):
    out, seconds = run_without_gpu(tmp_path, nvidia_smi)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout == "" and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("bench/gpu.sh: no NVIDIA GPU found")
    assert seconds < 5
    assert not (tmp_path / ".venv").exists()


def test_fsdp_runs_only_where_the_kit_lists_the_strategy():
    keys = subprocess.run([sys.executable, "-m", "ray_app", "config", "keys"], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert keys.returncode == 0, keys.stderr
    has_strategy = any(line.split()[:1] == ["train.strategy"] for line in keys.stdout.splitlines())
    assert gpu_page.fsdp_supported(keys.stdout) == (has_strategy and "fsdp" in keys.stdout)
    listed = "train.strategy                 str    ddp             ddp (default) | fsdp (FSDP2 fully_shard)."
    assert gpu_page.fsdp_supported(keys.stdout + "\n" + listed)
    assert not gpu_page.fsdp_supported("train.strategy  str  ddp  ddp only.\ntrain.fsdp_note str x fsdp")


def test_the_page_says_what_was_not_run_and_why():
    ddp = {"steady_sps": 5123.4, "wall_s": 41.0, "train_loss": 1.2345, "eval_accuracy": 0.5, "last_logged_loss": 1.3,
           "ckpt_blocked_s": None}
    text = "\n".join(gpu_page.strategies_section({"ddp": ddp, "fsdp": None,
                                                   "fsdp_not_run": "this kit has no `train.strategy: fsdp`"}))
    assert "| ddp (case (a)'s kit run) | 5123.4 | 1.2345 | 0.5000 | 41.0 |" in text
    assert "| fsdp | not run |" in text and "FSDP not run: this kit has no `train.strategy: fsdp`." in text
    both = gpu_page.strategies_section({"ddp": ddp, "fsdp": {**ddp, "steady_sps": 4610.0}, "same_losses": True})
    assert "FSDP / DDP samples/s: 0.900" in "\n".join(both) and "(within 1 %): yes" in "\n".join(both)
    assert "MFU" not in "\n".join(both)  # no FLOP count, no MFU line
    mfu = {"flops_per_sample": 7.9e9, "peak": "H200 data sheet, dense bf16", "ddp": 0.41, "fsdp": 0.385}
    with_mfu = "\n".join(gpu_page.strategies_section({"ddp": ddp, "fsdp": {**ddp, "steady_sps": 4610.0},
                                                       "same_losses": True, "mfu": mfu}))
    assert "MFU (7.90 GFLOP/sample fwd+bwd by FlopCounterMode; peak H200 data sheet, dense bf16): DDP 0.410, " \
           "FSDP 0.385." in with_mfu
    missing = "\n".join(gpu_page.image_section({"not_run": "Docker has no NVIDIA runtime"}))
    assert "Not run: Docker has no NVIDIA runtime." in missing
