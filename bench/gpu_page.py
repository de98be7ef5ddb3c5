"""The parts of the one-GPU check (bench/gpu.sh) that follow `bench/run.py --gpu`: DDP against FSDP, the GPU image's
own `ray-app train`, and the page.

    python bench/gpu_page.py strategies --out bench/gpu --timeout 120    # FSDP beside case (a)'s DDP run
    python bench/gpu_page.py image --out bench/gpu --timeout 150         # the GPU image on the GPU (Docker + NVIDIA runtime)

Each appends its section to OUT/RESULTS.md, the page `bench/run.py --gpu` wrote, and keeps its figures in
gpu-<part>.json beside that run's results.json (build/bench/gpu/ for the default OUT).
What cannot run here and why (no `train.strategy: fsdp` in this kit, no Docker with the NVIDIA runtime, no image)
is said on the page; a run that starts and fails exits 1 with one line naming it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import measure, parse  # noqa: E402

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
IMAGE_GPU = os.environ.get("IMAGE_GPU", "ray-app:0.1.0-gpu")  # = the Makefile's IMAGE_GPU


class CheckFailed(Exception):
    """A GPU path that started and broke: bench/gpu.sh fails with this line."""


# ---------------------------------------------------------------- DDP and FSDP

def fsdp_supported(config_keys: str) -> bool:
    """Does `ray-app config keys` list train.strategy with an fsdp choice?"""
    return any(line.split()[:1] == ["train.strategy"] and "fsdp" in line for line in config_keys.splitlines())


def case_a_kit_run(out: Path) -> dict:
    """Case (a)'s kit run (one worker, DDP, bf16) from the results.json `bench/run.py --gpu --out OUT` wrote."""
    from bench.run import results_json_path

    saved = json.loads(results_json_path(out).read_text())
    runs = [r for r in saved["runs"] if r["label"].startswith("a/kit ")]
    if not runs:
        raise CheckFailed(f"no case (a) kit run in {results_json_path(out)}: run bench/run.py --gpu first")
    return runs[0]


def strategies(out: Path, timeout: float) -> dict:
    from bench.run import WORKLOADS

    keys = subprocess.run([str(measure.BIN / "ray-app"), "config", "keys"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    if keys.returncode != 0:
        raise CheckFailed(f"ray-app config keys failed (exit {keys.returncode}): {keys.stderr.strip()[-300:]}")
    ddp = case_a_kit_run(out)
    part = {"ddp": _figures(ddp), "fsdp": None}
    if not fsdp_supported(keys.stdout):
        part["fsdp_not_run"] = ("this kit has no `train.strategy: fsdp` (`ray-app config keys` lists no "
                                "train.strategy with fsdp); the row fills in once it has")
        return part
    overrides = (*WORKLOADS["gpu"]["compute"], "train.strategy=fsdp")
    workdir = Path(tempfile.mkdtemp(prefix="rbg-", dir="/tmp"))
    try:
        ctx = measure.Context(workdir=workdir, timeout=timeout)
        fsdp = measure.run(measure.Spec("kit", overrides, workers=1), ctx, "fsdp")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if fsdp["rc"] != 0 or not fsdp.get("steady_sps"):
        raise CheckFailed(f"ray-app train --set train.strategy=fsdp on the GPU failed (exit {fsdp['rc']}; "
                          f"steady samples/s {fsdp.get('steady_sps')})")
    part["fsdp"] = _figures(fsdp)
    part["same_losses"] = parse.same_losses(ddp.get("losses", []), fsdp.get("losses", []), tol=1e-2)
    part["mfu"] = mfu_figures(overrides, part["ddp"]["steady_sps"], part["fsdp"]["steady_sps"])
    return part


def mfu_figures(overrides: tuple[str, ...], ddp_sps, fsdp_sps) -> dict:
    """Model FLOP utilization of both runs (the same model: FLOPs per sample counted once, bench/flops.py)."""
    from bench import flops, report

    fps = flops.flops_per_sample(overrides)
    peak, where = flops.peak_flops(report.gpu_name())
    return {"flops_per_sample": fps, "peak": where, "ddp": flops.mfu(fps, ddp_sps, peak),
            "fsdp": flops.mfu(fps, fsdp_sps, peak)}


def _figures(run: dict) -> dict:
    s = run.get("summary") or {}
    losses = run.get("losses") or []
    return {"steady_sps": run.get("steady_sps"), "wall_s": run.get("wall_s"), "train_loss": s.get("train_loss"),
            "eval_accuracy": s.get("eval_accuracy"), "last_logged_loss": losses[-1][1] if losses else None,
            "ckpt_blocked_s": run.get("ckpt_blocked_s")}


def strategies_section(part: dict) -> list[str]:
    ddp, fsdp = part["ddp"], part.get("fsdp")
    rows = ["## DDP and FSDP (one GPU, bf16, the workload of case (a))", "",
            "| strategy | steady samples/s | train loss | eval accuracy | wall s |", "| --- | --- | --- | --- | --- |",
            _strategy_row("ddp (case (a)'s kit run)", ddp)]
    if fsdp is None:
        rows += ["| fsdp | not run | | | |", "", f"FSDP not run: {part['fsdp_not_run']}."]
    else:
        rows.append(_strategy_row("fsdp (train.strategy=fsdp)", fsdp))
        q = parse.ratio(fsdp["steady_sps"], ddp["steady_sps"])
        rows += ["", f"FSDP / DDP samples/s: {_num(q, 3)}; the same losses at the logged steps (within 1 %): "
                 f"{ {True: 'yes', False: 'NO', None: 'n/a'}[part.get('same_losses')] }. On one GPU FSDP shards "
                 "nothing: this row checks the path runs and what its wrapping costs."]
        m = part.get("mfu")
        if m:
            rows += ["", f"MFU ({m['flops_per_sample'] / 1e9:.2f} GFLOP/sample fwd+bwd by FlopCounterMode; peak "
                     f"{m['peak']}): DDP {_num(m['ddp'], 3)}, FSDP {_num(m['fsdp'], 3)}."]
    return rows


def _strategy_row(name: str, f: dict) -> str:
    return (f"| {name} | {_num(f['steady_sps'], 1)} | {_num(f['train_loss'], 4)} | {_num(f['eval_accuracy'], 4)} "
            f"| {_num(f['wall_s'], 1)} |")


def _num(v, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


# ---------------------------------------------------------------- the GPU image

def docker_nvidia_problem() -> str | None:
    """None when a Docker engine answers and has the NVIDIA runtime, else what is missing."""
    if shutil.which("docker") is None:
        return "no docker CLI on this machine"
    out = subprocess.run(["docker", "info", "--format", "{{json .Runtimes}}"], capture_output=True, text=True,
                         timeout=30)
    if out.returncode != 0:
        return "no Docker engine answers (docker info failed)"
    if "nvidia" not in out.stdout:
        return "Docker has no NVIDIA runtime (install the NVIDIA container toolkit and configure Docker with it)"
    return None


PROBE = ("import json, torch; print(json.dumps({'cuda': torch.version.cuda, 'available': torch.cuda.is_available(), "
         "'devices': torch.cuda.device_count(), 'name': torch.cuda.get_device_name(0) if torch.cuda.is_available() "
         "else None, 'bf16': torch.cuda.is_available() and torch.cuda.is_bf16_supported(), "
         "'nccl': list(torch.cuda.nccl.version())}))")


def image(timeout: float) -> dict:
    problem = docker_nvidia_problem()
    if problem:
        return {"not_run": problem}
    if subprocess.run(["docker", "image", "inspect", IMAGE_GPU], capture_output=True, timeout=30).returncode != 0:
        return {"not_run": f"no image {IMAGE_GPU} on this machine (build it first: make image-gpu, or "
                           "make image-gpu-offline; then run bench/gpu.sh again)"}
    run = ["docker", "run", "--rm", "--gpus", "1", "--shm-size=8g", "-w", "/home/ray", IMAGE_GPU]
    t0 = time.time()
    probe = subprocess.run([*run, "python", "-c", PROBE], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        raise CheckFailed(f"{IMAGE_GPU}: torch in the container failed (exit {probe.returncode}): "
                          f"{probe.stderr.strip()[-300:]}")
    info = json.loads(probe.stdout.strip().splitlines()[-1])
    if not info["available"]:
        raise CheckFailed(f"{IMAGE_GPU}: torch in the container sees no GPU with --gpus 1 ({info})")
    train = subprocess.run([*run, "ray-app", "train", "--config", "/app/configs/local.yaml",
                            "--set", "scaling.use_gpu=true", "--set", "scaling.num_workers=1",
                            "--set", "train.precision=bf16-mixed"], capture_output=True, text=True,
                           timeout=max(30.0, timeout - (time.time() - t0)))
    if train.returncode != 0:
        raise CheckFailed(f"{IMAGE_GPU}: ray-app train on the GPU failed (exit {train.returncode}): "
                          f"{(train.stderr or train.stdout).strip().splitlines()[-1:]}")
    summary = json.loads(train.stdout.strip().splitlines()[-1])
    return {"image": IMAGE_GPU, "probe": info, "wall_s": round(time.time() - t0, 1),
            "summary": {k: summary.get(k) for k in ("epochs", "global_step", "train_loss", "eval_accuracy",
                                                    "train_seconds", "steady_samples_per_second")}}


def image_section(part: dict) -> list[str]:
    rows = ["## The GPU image's own `ray-app train`", ""]
    if "not_run" in part:
        return rows + [f"Not run: {part['not_run']}."]
    p, s = part["probe"], part["summary"]
    return rows + [
        f"`docker run --gpus 1 {part['image']}`: torch CUDA {p['cuda']}, {p['devices']} x {p['name']}, bf16 "
        f"{'yes' if p['bf16'] else 'no'}, NCCL {'.'.join(map(str, p['nccl']))}.",
        f"`ray-app train --config /app/configs/local.yaml` (digits, one worker on the GPU, bf16): {s['epochs']} "
        f"epochs, eval accuracy {_num(s['eval_accuracy'], 4)}, train loss {_num(s['train_loss'], 4)}, "
        f"{_num(s['train_seconds'], 1)} s of training, {part['wall_s']} s with the container's start."]


# ---------------------------------------------------------------- main

def append(out: Path, lines: list[str]) -> None:
    with open(out / "RESULTS.md", "a") as f:
        f.write("\n" + "\n".join(lines) + "\n")


def page_missing(out: Path, script: str) -> bool:
    """Whether the GPU page this part adds to is missing (said in one line): bench/run.py --gpu writes it first."""
    if (out / "RESULTS.md").is_file():
        return False
    print(f"{script}: {out / 'RESULTS.md'} does not exist: bench/run.py --gpu --out {out} writes it first",
          file=sys.stderr)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=("strategies", "image"))
    p.add_argument("--out", default=str(BENCH / "gpu"))
    p.add_argument("--timeout", type=float, default=150, help="seconds this part may take")
    args = p.parse_args(argv)
    out = Path(args.out)
    if page_missing(out, "gpu_page.py"):
        return 2
    try:
        part = strategies(out, args.timeout) if args.part == "strategies" else image(args.timeout)
    except (CheckFailed, subprocess.TimeoutExpired) as exc:
        print(f"bench/gpu.sh: {args.part}: {exc}", file=sys.stderr)
        return 1
    from bench.run import results_json_path

    results_json_path(out).with_name(f"gpu-{args.part}.json").write_text(json.dumps(part, indent=1, default=str) + "\n")
    append(out, strategies_section(part) if args.part == "strategies" else image_section(part))
    print(f"[gpu] {args.part}: " + json.dumps(part, default=str)[:400], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
