"""bench/RESULTS.md, results.png and results.json (under build/) from the runner's figures."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from bench import parse

METHOD = """\
- **Same work.** The twin (`bench/twin.py`) reads the same config and `--set` values as `ray-app train`, builds
  the model and data with the kit's own factories and takes its seeding, train sampler (`DistributedSampler`'s
  order) and optimizer with LR schedule (SGD momentum 0.9) from `ray_app.worker.loop`; the loop is its own, plain
  torch: DDP with its defaults, global-mean loss every `train.log_every_steps`, exact evaluation after every
  epoch, gloo, `OMP_NUM_THREADS=1`, launched by `torchrun --standalone`. The "same losses" note compares the
  loss both print at each logged step.
- **Steady-state samples/s**: global samples of the optimizer steps after the 5th, over the wall time from
  the end of step 5 to the end of the last step (evaluation between epochs included, as in the kit's
  summary key `steady_samples_per_second`, rank 0's clock). The twin counts the same way in process. Should a
  kit summary lack the key, its progress lines are used (each line carries its interval's samples/s) and the
  twin's step-only rate is compared instead (`steady_step_samples_per_second`).
- **Time to first step**: from the moment the runner starts the process (`ray-app train`, `ray job submit`,
  or `torchrun`) to the end of the first optimizer step. The twin stamps it in process; the kit: the summary's
  `first_step_unix` when present, else the first scrape of rank 0's exporter (polled at 20 Hz) showing
  `ray_app_step_seconds_count >= 1`. Phases come from Ray's own logs of that run (session start, driver
  core-worker log, Ray Train's controller/worker sys logs) and the twin's in-process stamps.
- **Checkpoint cost** (a 294 MB state to `moto_server`, an S3 API server on 127.0.0.1 sharing the 2 cores):
  blocked time per checkpoint is the summary's `checkpoint_blocked_seconds / checkpoints_written` (else the
  exporter's `ray_app_checkpoint_blocked_seconds` sum/count); for async that is the snapshot plus Ray's report
  barrier, and the wait for the parameter copy before the next optimizer step. End-to-end is first step ->
  process exit against the same run that checkpoints only at the end ("final": every run that keeps its
  model pays that one commit); "final" against no checkpoint at all is shown too.
- **Recovery**: a non-rank-0 worker gets SIGKILL right after the first committed checkpoint; the figure is
  SIGKILL -> first optimizer step of the restarted worker group (kit: Ray Train restart; twin:
  `torchrun --max-restarts 1` and a `torch.save` checkpoint at the same cadence).
- **Exporter on** means rank 0 serves `/metrics` and the bench scrapes it every 5 s (every 0.5 s in (d) and
  (e), and 20 Hz until the first step); **off** is `metrics.enabled=false`. Its cost is 1 - the median of the
  per-round on/off ratios (each round runs both back to back, so slow load drifts cancel within a pair).
- **Preemption agreement** (p): the kit as in (a) and (b) against the same run with
  `failure.preemption_checkpoint=false` (no SIGTERM handler, no per-step flag); cost as for the exporter.
- **Every rank's pace** (r): the kit as in (a) and (b) (a log interval every 5 steps: each one an `all_gather`
  of every rank's timing sums) against the same run with `metrics.rank_pace=false` (no timing marks, no
  forward hooks, no `all_gather`); cost as for the exporter.
- **The run journal** (j): the kit as in (a) and (b) against the same command with `RAY_APP_JOURNAL=0` in
  every process (`bench/variants.py no-journal`: no events written, no goodput computed); cost as for the
  exporter.
- **Script mode** (s): the twin itself, unchanged, under `ray-app run` (Ray Train's workers, its process group,
  a private Ray started by the command) against the twin under `torchrun`; the script measures both the same
  way in process. Its time to first step is shown beside the plug-in mode's (`ray-app train`, the same
  workload, the run of case (a)).
- **Streamed shards** (h, `--cases h`): before the runs, `ray-app data write` packs workload (a)'s synthetic
  set (4096 + 1024 samples of 12 KB) into 1 MB shards on `moto_server`, an S3 API server on 127.0.0.1 sharing
  the 2 cores; "streamed" trains with `data.name=shards` and `data.path` there (prefetch 2, the default),
  "map-style" the same workload from the tensors in memory. Same model, batch and steps; both keep
  `run.storage` on the same server, so only the data source differs (and with it the epoch's order: the
  losses are not compared). Figure: the median of the per-round ratios of steady samples/s; the CPU sampler
  follows both runs' process trees and the S3 server.
- **A Hugging Face language model** (l, `--cases l`): `bench/lm.py`'s Llama-architecture model and text
  (`model.name=hf`, `data.name=text`, `task.name=causal_lm`, `train.strategy=fsdp`); the twin loads the same
  folder with `from_pretrained` and writes the causal-LM loss out; "loop" is the kit's own `build_parts` and
  `Trainer` without Ray under `torchrun` (`bench/loop_alone.py`). Tokens/s = steady samples/s x the target
  tokens of a sequence (`seq_len - 1`; every training sequence is full).
- **Scaling**: the 1-worker runs stop after 48 optimizer steps (`train.max_steps`; same per-worker batch).
- Medians over the rounds; each round runs every case once, its variants in turn, in reverse order on every
  other round (A B, B A, ...). The machine is shared: the 1-minute load average at each run's start is in the
  last table. `--merge` reports re-run cases together with the other cases of an earlier bench (the machine
  table says which came from when); each case's figures come from one bench, also where two cases share a
  process.
"""


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_gib() -> str:
    try:
        import psutil

        return f"{psutil.virtual_memory().total / 2**30:.1f}"
    except Exception:
        return "?"


def kit_version() -> str:
    """The commit the kit was measured at (``-dirty``: with uncommitted changes)."""
    import subprocess

    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=Path(__file__).resolve().parents[1],
                              capture_output=True, text=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def machine_details() -> dict:
    import ray
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"gpu": f"{gpus} x {gpu_name()}" if gpus else "none",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": _cpu_model(),
            "cores": os.cpu_count(), "memory_gib": _mem_gib(), "python": platform.python_version(),
            "torch": torch.__version__, "ray": ray.__version__, "kit": kit_version(), "gpus": gpus,
            "load_average": load_average()}


def dataparallel_note(gpus: int) -> str:
    if gpus >= 2:
        return f"DataParallel baseline: {gpus} GPUs present; run bench/gpu.sh for the GPU figures."
    return (f"DataParallel baseline (one process, many GPUs, from the source article): skipped -- it needs at "
            f"least 2 CUDA GPUs and this machine has {gpus}.")


# ---------------------------------------------------------------- tables

def _num(v, digits=2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    return f"{v:,.{digits}f}" if abs(v) < 1000 else f"{v:,.0f}"


def table_lines(rows: list[dict]) -> list[str]:
    out = ["| case | metric | kit | twin / reference | ratio | target | met |",
           "| --- | --- | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        note = f" ({r['note']})" if r.get("note") else ""
        out.append(f"| ({r['case']}) | {r['metric']}{note} | {_num(r['kit'])} | {_num(r['ref'])} | "
                   f"{_num(r['ratio'], 3)} | {r['target']} | {_num(r['ok'])} |")
    return out


def _median_phases(runs: list[dict]) -> dict[str, float]:
    labels = []
    for run in runs:
        for k in run.get("breakdown", {}):
            if k not in labels:
                labels.append(k)
    return {k: parse.median(r.get("breakdown", {}).get(k) for r in runs) for k in labels}


def startup_lines(runner) -> list[str]:
    out = []
    if "c" in runner.cases:
        out += ["", "## (c) Where start-up time goes (medians, seconds)", ""]
        out += _phase_tables(runner, "c", ("kit cold", "kit warm", "twin"))
        if runner.cluster_start_s:
            out.append(f"Starting the warm cluster itself (`ray start --head`, until its job API answers): "
                       f"{_num(parse.median(runner.cluster_start_s))} s (not counted in warm).")
    if "v" in runner.cases:
        from bench.variants import VARIANTS

        out += ["", "## (v) Start-up experiments: the kit, cold, with one change (bench/variants.py)", ""]
        names = tuple(runner.plan.specs["v"])
        out += [f"- `{k}`: {VARIANTS[k][2]}" for k in names] + [""]
        out += _phase_tables(runner, "v", names)
    return out


def _phase_tables(runner, case: str, names) -> list[str]:
    out = []
    for name in names:
        runs = runner.runs(case, name)
        ph = _median_phases(runs)
        first = parse.median(r.get("first_step_s") for r in runs)
        out.append(f"**{name}** -- first step after {_num(first)} s")
        out.append("")
        out += ["| phase | s |", "| --- | ---: |"] + [f"| {k} | {_num(v)} |" for k, v in ph.items()]
        out.append("")
        out += _cpu_table(runs)
    return out


def _cpu_table(runs: list[dict]) -> list[str]:
    """CPU seconds before the first step by process role (medians over the runs that sampled them)."""
    sampled = [r["cpu_before_first_step"] for r in runs if r.get("cpu_before_first_step")]
    if not sampled:
        return []
    roles: list[str] = []
    for c in sampled:
        roles += [k for k in c["roles"] if k not in roles]
    rows = []
    for role in roles:
        n = parse.median(c["roles"].get(role, [0, 0.0])[0] for c in sampled)
        rows.append((role, n, parse.median(c["roles"].get(role, [0, 0.0])[1] for c in sampled)))
    rows.sort(key=lambda x: -(x[2] or 0))
    total = parse.median(c["total"] for c in sampled)
    cores = os.cpu_count() or 1
    out = [f"CPU used before the first step, by process (median of {len(sampled)} run(s)): **{_num(total)} CPU s**, "
           f"at least {_num(total / cores)} s of wall time on {cores} cores", "",
           "| process | count | CPU s |", "| --- | ---: | ---: |"]
    out += [f"| `{role}` | {_num(n, 0)} | {_num(s)} |" for role, n, s in rows if (s or 0) >= 0.05]
    out.append("")
    return out


def detail_lines(runner) -> list[str]:
    out = []
    if "d" in runner.cases:
        out += ["", "## (d) Checkpoints to moto_server (an S3 API server on 127.0.0.1; \"folder\": to a local folder)",
                ""]
        for name in runner.plan.specs["d"]:
            for r in runner.runs("d", name):
                size = f"{r['ckpt_bytes'] / 1e6:.0f} MB per checkpoint, " if r.get("ckpt_bytes") else ""
                e2e = r["t_end"] - r["first_step_unix"] if r.get("first_step_unix") else None
                cpu = r.get("cpu_in_run") or {}
                s3_cpu = (cpu.get("roles") or {}).get("moto_server", [0, None])[1]
                cpu_note = (f", CPU in the run {_num(cpu['total'])} s (the S3 server's {_num(s3_cpu)} s)"
                            if cpu else "")
                out.append(f"- {name}: {size}blocked/ckpt {_num(r.get('ckpt_blocked_s'))} s "
                           f"({r.get('ckpt_blocked_source') or 'n/a'}), wall {_num(r['wall_s'])} s, "
                           f"first step -> exit {_num(e2e)} s{cpu_note}")
    if "e" in runner.cases:
        out += ["", "## (e) Recovery detail", ""]
        for side in ("kit", "twin"):
            for r in runner.runs("e", side):
                extra = r.get("restart_events_s") or r.get("restart_phases_s") or {}
                out.append(f"- {side}: SIGKILL -> first step {_num(r.get('recovery_s'))} s "
                           f"(resumed from step {r.get('resumed_from_step')}); seconds after the kill: "
                           + ", ".join(f"{k} {_num(v)}" for k, v in extra.items()))
    return out


def runs_lines(runner) -> list[str]:
    out = ["", "## Every run", "", "| run | exit | load (1 min) | wall s | first step s | steady samples/s | sources |",
           "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for res in runner.all_runs():
        src = ", ".join(f"{k.split('_source')[0]}: {res[k]}" for k in res if k.endswith("_source") and res[k])
        out.append(f"| {res['label']} ({res['kind']}, {res['launch']}, {res['workers']} w) | {res['rc']} | "
                   f"{res['load1']:.1f} | {_num(res['wall_s'])} | {_num(res.get('first_step_s'))} | "
                   f"{_num(res.get('steady_sps'), 1)} | {src} |")
    return out


TITLES = {"full": "# Benchmarks: the kit vs bare torchrun",
          "smoke": "# Benchmarks: the kit vs bare torchrun (SMOKE: tiny sizes, the numbers mean nothing)",
          "gpu": "# GPU benchmarks: the kit (one worker, bf16) vs a bare single-process loop"}


def write(out: Path, rows: list[dict], runner, machine: dict, mode: str, results_json: Path) -> None:
    loads = [r["load1"] for r in runner.all_runs()]
    head = [TITLES[mode],
            "", "Generated by `make bench` (`bench/run.py`); see the method below.", "",
            "| machine | |", "| --- | --- |",
            f"| CPU | {machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB |",
            f"| GPU | {machine['gpu']} |",
            f"| software | Python {machine['python']}, torch {machine['torch']}, Ray {machine['ray']}, "
            f"kit at {machine.get('kit', '?')} -> {machine.get('kit_after', '?')} |",
            f"| load average before / after | {machine['load_average']} / {machine.get('load_average_after', '?')} |",
            f"| 1-min load at each run's start | min {min(loads, default=0):.1f}, "
            f"median {parse.median(loads) or 0:.1f}, max {max(loads, default=0):.1f} |",
            f"| date, duration | {machine['date']}, {machine.get('bench_minutes', '?')} min, "
            f"{runner.rounds} interleaved round(s) |"]
    head += [f"| merged | {m} |" for m in machine.get("merged", [])]
    head += ["", "## Figures", ""]
    body = head + table_lines(rows) + ["", dataparallel_note(machine["gpus"])]
    body += startup_lines(runner) + detail_lines(runner) + ["", "## Method", "", METHOD] + runs_lines(runner)
    (out / "RESULTS.md").write_text("\n".join(body) + "\n")
    results_json.write_text(json.dumps(
        {"machine": machine, "rows": rows, "runs": list(runner.results.values()),
         "earlier": runner.saved_earlier(), "cluster_start_s": runner.cluster_start_s,
         "shards_written": runner.shards_written, "addon_cost": runner.addon_cost}, indent=1, default=str))
    chart(out / "results.png", rows, runner)


# ---------------------------------------------------------------- chart

def chart(path: Path, rows: list[dict], runner) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 6), gridspec_kw={"width_ratios": [1, 1.6]})
    thr = [r for r in rows if r["ratio"] is not None and (
        (r["case"] in ("a", "b") and "steady samples/s" in r["metric"]) or r["case"] == "f")]
    labels = [f"({r['case']}) " + ("kit / twin" if r["case"] != "f" else
                                   "efficiency, " + ("kit" if ", kit" in r["metric"] else "twin")) for r in thr]
    ax1.bar(labels, [r["ratio"] for r in thr], color=["tab:green" if r["ok"] else "tab:orange" for r in thr])
    for y in (0.97, 0.98):
        ax1.axhline(y, color="grey", lw=0.8, ls="--")
    ax1.set_ylim(0, 1.1)
    ax1.set_ylabel("ratio (kit / twin; efficiency for f)")
    ax1.set_title("throughput")
    ax1.tick_params(axis="x", labelrotation=20, labelsize=8)
    _startup_bars(ax2, runner)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _startup_bars(ax, runner) -> None:
    ax.set_title("time to first step: phases (medians)")
    ax.set_xlabel("seconds from process start")
    if "c" not in runner.cases:
        return
    names = ["kit cold", "kit warm", "twin"]
    cmap = __import__("matplotlib").colormaps["tab20"]
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        left = 0.0
        for label, sec in _median_phases(runner.runs("c", name)).items():
            if sec is None:
                continue
            idx = seen.setdefault(label, len(seen))
            ax.barh(i, sec, left=left, color=cmap(idx % 20), label=label)
            left += max(sec, 0)
    ax.set_yticks(range(len(names)), names)
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3)
