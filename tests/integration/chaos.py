"""Chaos: one ``ray-app train`` run on a local Ray (CPU, 2 gloo workers) into which N faults are injected
at random, each after the group has recovered from the previous one; then the run must end (exit 0) on
the parameters of an uninterrupted run of the same config, bit for bit.

The faults, each to a random rank's worker process:

- ``kill``: SIGKILL. Ray Train restarts the group from the newest committed checkpoint: at most one
  checkpoint interval (``checkpoint.every_steps``) of steps is lost; it counts against
  ``failure.max_failures``.
- ``term``: SIGTERM, a preemption notice, sent only while the group trains (after one of its progress
  lines): every rank checkpoints at the next step boundary and the group restarts from there. No step
  is lost and the restart does not count: ``failure.max_failures`` is exactly the kills plus the stops.
- ``stop``: SIGSTOP, a hang: detected after ``failure.hang_timeout_s``, the group restarts from the
  newest committed checkpoint (at most one interval lost); the stopped process is killed afterwards
  if Ray has not.

The plan (kind, rank, steps after the group's first step past its resume) comes from ``--seed``,
printed first, so a run can be replayed; the first faults take every kind once and every rank once. A recovery is the
restarted group's ``resumed from ...`` line followed by one more trained step; its seconds run from
the signal to that line.

    python -m tests.integration.chaos --faults 20 --seed 7 --kinds kill,term,stop --out build/chaos.json

Exits 1 if any check fails (each is listed in the report's ``problems``).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from tests.integration.faultlib import STEPS_PER_EPOCH, Run, differing_parameters, final_model, summary_of, workload

SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}
WORLD_SIZE = 2
EVERY_STEPS = 8  # checkpoint interval: the most a kill or a stop may lose
MAX_GAP = 2 * EVERY_STEPS  # a fault lands 0..MAX_GAP steps after its group's first step: any phase of the interval
# steps a fault may move the run on beyond its gap: the group's first step, a notice agreed two steps
# after it arrives, and the lines the driver had not seen yet when it signalled
SLACK_STEPS = 12
TAIL_STEPS = 16  # none in the last steps: a SIGTERM once the loop is over is Ray's exit, not a notice
HANG_TIMEOUT_S = 10  # the least failure.hang_timeout_s allows
RECOVERY_TIMEOUT_S = 240

WORKER_LINE = re.compile(r"^\(RayTrainWorker pid=(\d+)[^)]*\) (.*)$")
ANNOUNCE = re.compile(r"^rank (\d+)/\d+ on host ")
PROGRESS = re.compile(r"^epoch \d+ step (\d+)/\d+ ")
RESUMED = re.compile(r"^resumed from \S+ at epoch \d+ batch \d+ step (\d+)")
PREEMPTED = re.compile(r"^preempted: checkpoint \S+ at step (\d+) committed")


@dataclass
class Fault:
    """One planned fault and, once it happened, what the run made of it."""

    kind: str
    rank: int
    gap: int  # steps after the group's first step past its resume (the first fault: past the first checkpoint)
    pid: int | None = None
    target_step: int | None = None
    injected_at_step: int | None = None  # the newest step the driver had seen when it signalled
    last_step_before_restart: int | None = None  # the newest step the faulted group logged
    preempted_at_step: int | None = None  # term: the step of the checkpoint every rank agreed on
    resumed_from_step: int | None = None
    steps_lost: int | None = None
    recovery_s: float | None = None  # signal -> the restarted group's "resumed from" line
    first_step_s: float | None = None  # signal -> the restarted group's first step
    victim_left_stopped: bool | None = None  # stop: still there after the recovery (then killed here)
    signalled_at: float = field(default=0.0, repr=False)


def plan(n: int, kinds: list[str], seed: int) -> list[Fault]:
    """N faults: the first ones take each kind once and each rank once (in a random order), the rest any."""
    rng = random.Random(seed)
    chosen = rng.sample(kinds, min(n, len(kinds)))
    chosen += [rng.choice(kinds) for _ in range(n - len(chosen))]
    ranks = rng.sample(range(WORLD_SIZE), min(n, WORLD_SIZE))
    ranks += [rng.randrange(WORLD_SIZE) for _ in range(n - len(ranks))]
    return [Fault(kind, rank, rng.randint(0, MAX_GAP)) for kind, rank in zip(chosen, ranks, strict=True)]


def epochs_for(n: int) -> int:
    """Enough epochs for N faults in the worst case, and a tail without any."""
    steps = EVERY_STEPS + 1 + n * (MAX_GAP + SLACK_STEPS) + TAIL_STEPS
    return max(2, math.ceil(steps / STEPS_PER_EPOCH))


def train_args(storage: Path | str, name: str, epochs: int, max_failures: int, storage_retry_s: float = 5,
               hang_timeout_s: float = HANG_TIMEOUT_S) -> list[str]:
    return ["--set", f"run.storage={storage}", "--set", f"run.name={name}",
            *workload(epochs, log_every_steps=1),  # a progress line every step: the driver aims at steps
            "--set", f"checkpoint.every_steps={EVERY_STEPS}", "--set", f"failure.hang_timeout_s={hang_timeout_s:g}",
            "--set", f"failure.storage_retry_s={storage_retry_s:g}", "--set", f"failure.max_failures={max_failures}"]


class Watch:
    """The run's worker lines as they arrive: which process is which rank of the current group, the
    newest step each rank-0 process logged, and the resumes and preemption checkpoints so far."""

    def __init__(self, run: Run):
        self.run, self.seen = run, 0
        self.ranks: dict[int, int] = {}  # rank -> pid, of the group that announced since the last fault
        self.rank0: int | None = None
        self.steps: dict[int, int] = {}  # pid -> newest step it logged
        self.first_step_at: dict[int, float] = {}  # pid -> when its first step line arrived
        self.resumes: list[tuple[float, int, int]] = []  # (arrival, pid, step)
        self.preempted: list[int] = []

    def poll(self) -> None:
        lines = self.run.lines
        while self.seen < len(lines):
            t, raw = lines[self.seen]
            self.seen += 1
            m = WORKER_LINE.match(raw)
            if m:
                self._note(t, int(m.group(1)), m.group(2))

    def _note(self, t: float, pid: int, text: str) -> None:
        if m := PROGRESS.match(text):
            self.steps[pid] = max(self.steps.get(pid, 0), int(m.group(1)))
            self.first_step_at.setdefault(pid, t)
        elif m := ANNOUNCE.match(text):
            self.ranks[int(m.group(1))] = pid
            if m.group(1) == "0":
                self.rank0 = pid
        elif m := RESUMED.match(text):
            self.resumes.append((t, pid, int(m.group(1))))
            self.rank0 = pid
        elif m := PREEMPTED.match(text):
            self.preempted.append(int(m.group(1)))

    def new_group(self) -> None:
        """After a signal: the next announcements are the restarted group's."""
        self.ranks, self.rank0 = {}, None

    @property
    def step(self) -> int:
        """The newest step the current group's rank 0 logged (0 before its first)."""
        return self.steps.get(self.rank0, 0) if self.rank0 is not None else 0

    def ready(self, past: int) -> bool:
        """Every rank of the current group announced and its rank 0 logged a step after ``past``."""
        return len(self.ranks) == WORLD_SIZE and self.step > past


def wait_for(run: Run, watch: Watch, condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        watch.poll()
        if condition():
            return True
        if run.proc.poll() is not None:
            watch.poll()
            return condition()
        time.sleep(0.01)
    return False


def inject(run: Run, watch: Watch, fault: Fault) -> str | None:
    """Signal the fault's rank once the current group reached the fault's step; None, or what went wrong."""
    if not wait_for(run, watch, lambda: watch.ready(fault.target_step - 1), RECOVERY_TIMEOUT_S):
        return f"the run never reached step {fault.target_step} (exit {run.proc.poll()})"
    pid = watch.ranks[fault.rank]
    if pid not in {p.pid for p in run.workers()}:
        return f"rank {fault.rank}'s process {pid} is not a training worker of the run"
    fault.pid, fault.injected_at_step = pid, watch.step
    try:
        psutil.Process(pid).send_signal(SIGNALS[fault.kind])
    except psutil.NoSuchProcess:
        return f"rank {fault.rank}'s process {pid} ended before its signal"
    fault.signalled_at = time.monotonic()
    return None


def recover(run: Run, watch: Watch, fault: Fault, faulted_rank0: int) -> str | None:
    """Wait until the restarted group resumed and trained a step; fill in the fault's figures."""
    resumes, preempted = len(watch.resumes), len(watch.preempted)  # as at the signal: nothing was read since
    watch.new_group()
    if not wait_for(run, watch, lambda: len(watch.resumes) > resumes and watch.ready(watch.resumes[-1][2]),
                    RECOVERY_TIMEOUT_S):
        return f"no recovery within {RECOVERY_TIMEOUT_S}s (exit {run.proc.poll()})"
    at, _, step = watch.resumes[-1]
    fault.resumed_from_step = step
    fault.recovery_s = round(at - fault.signalled_at, 2)
    fault.first_step_s = round(watch.first_step_at[watch.rank0] - fault.signalled_at, 2)
    fault.last_step_before_restart = watch.steps.get(faulted_rank0, 0)
    fault.steps_lost = fault.last_step_before_restart - step
    if fault.kind == "term" and len(watch.preempted) > preempted:
        fault.preempted_at_step = watch.preempted[preempted]
    if fault.kind == "stop":
        fault.victim_left_stopped = stop_leftover(fault.pid)
    return None


def stop_leftover(pid: int) -> bool:
    """Kill a stopped process Ray left behind; whether there was one."""
    try:
        victim = psutil.Process(pid)
        if victim.status() == psutil.STATUS_ZOMBIE:
            return False
        victim.send_signal(signal.SIGKILL)
        victim.send_signal(signal.SIGCONT)
        return True
    except psutil.NoSuchProcess:
        return False


def fault_problems(fault: Fault, number: int) -> list[str]:
    """The bounds a recovered fault must keep."""
    out, name = [], f"fault {number} ({fault.kind} rank {fault.rank} at step {fault.injected_at_step})"
    if fault.kind == "term":
        if fault.preempted_at_step is None or fault.preempted_at_step != fault.resumed_from_step:
            out.append(f"{name}: resumed from step {fault.resumed_from_step}, not from the preemption checkpoint "
                       f"(step {fault.preempted_at_step})")
        if fault.steps_lost != 0:
            out.append(f"{name}: {fault.steps_lost} steps lost, a notice must lose none")
    elif not 0 <= fault.steps_lost <= EVERY_STEPS:
        out.append(f"{name}: {fault.steps_lost} steps lost, more than one checkpoint interval ({EVERY_STEPS})")
    if fault.kind == "stop" and fault.recovery_s < HANG_TIMEOUT_S - 1:
        out.append(f"{name}: recovered in {fault.recovery_s}s, before the hang timeout ({HANG_TIMEOUT_S}s) could fire")
    return out


def chaos_run(run: Run, faults: list[Fault], total_steps: int) -> list[str]:
    """Inject every fault, each once the group recovered from the one before; the problems found."""
    watch = Watch(run)
    past = EVERY_STEPS  # the first fault comes after the first committed checkpoint
    for number, fault in enumerate(faults, 1):
        fault.target_step = past + 1 + fault.gap
        if fault.target_step > total_steps - TAIL_STEPS:
            return [f"fault {number}: step {fault.target_step} is in the run's last {TAIL_STEPS} steps (too few epochs)"]
        problem = inject(run, watch, fault)
        if problem is None:
            problem = recover(run, watch, fault, faulted_rank0=watch.rank0)
        if problem:
            return [f"fault {number} ({fault.kind} rank {fault.rank}): {problem}"]
        print(f"chaos: fault {number}/{len(faults)}: {fault.kind} rank {fault.rank} at step {fault.injected_at_step}"
              f" -> resumed from step {fault.resumed_from_step} after {fault.recovery_s:.1f}s, "
              f"{fault.steps_lost} steps lost", flush=True)
        past = fault.resumed_from_step
    return []


def per_kind(faults: list[Fault]) -> dict:
    out = {}
    for kind in sorted({f.kind for f in faults}):
        seconds = [f.recovery_s for f in faults if f.kind == kind and f.recovery_s is not None]
        out[kind] = {"count": len(seconds), "median_recovery_s": round(statistics.median(seconds), 2) if seconds else None,
                     "max_recovery_s": max(seconds, default=None)}
    return out


def write_log(run: Run, path: Path) -> None:
    """The run's output, each line after the second it arrived at (from the run's start)."""
    path.write_text("".join(f"{t - run.t0:8.2f} {line}\n" for t, line in run.lines))


def reference_run(storage: Path | str, epochs: int, max_failures: int, logs: Path, **settings) -> Run:
    """The same config, uninterrupted (its output is kept in ``logs``/reference.log)."""
    run = Run(train_args(storage, "reference", epochs, max_failures, **settings))
    run.wait(timeout=900)
    write_log(run, logs / "reference.log")
    return run


def end_problems(run: Run, rc: int, faults: list[Fault], total_steps: int, reference: dict) -> tuple[list[str], bool]:
    """The run's outcome: exit 0, one restart per fault, the last step, no leftover process, the same parameters."""
    if rc != 0:  # None: stopped here after a problem already listed
        return ([] if rc is None else [f"the chaos run exited {rc}"]), False
    out = []
    resumes = len(re.findall(r"\) resumed from ", run.text))
    if resumes != len(faults):
        out.append(f"{resumes} restarts for {len(faults)} faults")
    found = re.search(r"Traceback|Graceful shutdown of backend failed", run.text)
    if found:  # the lines around it, so a CI log shows which process printed it and why
        excerpt = "\n".join(run.text[:found.start()].splitlines()[-3:] + run.text[found.start():].splitlines()[:25])
        out.append(f"a traceback in the run's output (each restart is one line):\n{excerpt}")
    summary = summary_of(run.text)
    if summary["global_step"] != total_steps:
        out.append(f"the run ended at step {summary['global_step']}, not {total_steps}")
    leftover = leftover_processes([f.pid for f in faults if f.pid])
    if leftover:
        out.append(f"signalled processes still there: {leftover}")
    differ = differing_parameters(final_model(summary), reference)
    if differ:
        out.append(f"final parameters differ from the uninterrupted run's: {differ}")
    return out, not differ


def leftover_processes(pids: list[int], grace_s: float = 10) -> list[int]:
    """The signalled processes still alive ``grace_s`` after the run ended (Ray's shutdown takes a moment)."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def run_chaos(n: int, seed: int, kinds: list[str], storage: Path | str, logs: Path | None = None,
              before_chaos=None, storage_retry_s: float = 5, hang_timeout_s: float = HANG_TIMEOUT_S) -> dict:
    """The whole experiment: the reference run, the chaos run, the report (``problems`` empty if it held).

    ``storage``: both runs' ``run.storage`` (a folder, or ``s3://bucket/prefix`` with the AWS variables in
    this process's environment); ``logs``: a folder for their output (default: ``storage``);
    ``before_chaos``: called between the two runs (a test arms a storage outage there); a run that waits
    out an outage sets ``storage_retry_s`` above it and ``hang_timeout_s`` above the wait."""
    settings = {"storage_retry_s": storage_retry_s, "hang_timeout_s": hang_timeout_s}
    logs = Path(storage) if logs is None else logs
    faults = plan(n, kinds, seed)
    epochs = epochs_for(n)
    total_steps = epochs * STEPS_PER_EPOCH
    max_failures = sum(f.kind != "term" for f in faults)  # exactly: a notice's restart must not count
    print(f"chaos: seed {seed} (replay: --seed {seed} --faults {n} --kinds {','.join(kinds)}); "
          f"{epochs} epochs x {STEPS_PER_EPOCH} steps, failure.max_failures={max_failures}; plan: "
          + " ".join(f"{f.kind}:r{f.rank}+{f.gap}" for f in faults), flush=True)
    ref = reference_run(storage, epochs, max_failures, logs, **settings)
    reference_s = round(time.monotonic() - ref.t0, 1)
    report = {"seed": seed, "faults": n, "kinds": kinds, "epochs": epochs, "total_steps": total_steps,
              "world_size": WORLD_SIZE, "checkpoint_every_steps": EVERY_STEPS, "hang_timeout_s": hang_timeout_s,
              "max_failures": max_failures, "reference_seconds": reference_s, "storage": str(storage)}
    if ref.proc.returncode != 0:
        print(ref.text[-4000:])
        return {**report, "exit_code": None, "bit_identical": False, "chaos_seconds": 0, "per_fault": [],
                "per_kind": {}, "problems": [f"the reference run exited {ref.proc.returncode}"]}
    print(f"chaos: reference run done in {reference_s:.0f}s", flush=True)
    reference = final_model(summary_of(ref.text))
    if before_chaos is not None:
        before_chaos()
    run = Run(train_args(storage, "chaos", epochs, max_failures, **settings))
    run_seconds = None
    try:
        problems = chaos_run(run, faults, total_steps)
        rc = None if problems else run.wait(timeout=RECOVERY_TIMEOUT_S + 300)
        run_seconds = round(time.monotonic() - run.t0, 2)  # the driver's whole life, as the journal counts it
    except subprocess.TimeoutExpired:
        problems, rc = ["the chaos run did not end after its last fault"], None
    finally:
        run.stop()
        for f in faults:
            if f.kind == "stop" and f.pid:
                stop_leftover(f.pid)
    write_log(run, logs / "chaos.log")
    ended, identical = end_problems(run, rc, faults, total_steps, reference)
    problems += ended
    for number, fault in enumerate(faults, 1):
        if fault.steps_lost is not None:
            problems += fault_problems(fault, number)
    return {**report, "exit_code": rc, "bit_identical": identical, "chaos_seconds": round(time.monotonic() - run.t0, 1),
            "run_seconds": run_seconds, "journal": runs_show(f"{str(storage).rstrip('/')}/chaos"),
            "per_fault": [{k: v for k, v in asdict(f).items() if k != "signalled_at"} for f in faults],
            "per_kind": per_kind(faults), "problems": problems}


def runs_show(run_uri: Path | str) -> dict | None:
    """``ray-app runs show RUN_URI --json``: the run's journal, its timeline and wall time split (None if it fails)."""
    proc = subprocess.run([sys.executable, "-m", "ray_app", "runs", "show", str(run_uri), "--json"],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        print(f"chaos: runs show exited {proc.returncode}: {proc.stderr[-2000:]}")
        return None
    return json.loads(proc.stdout)


def print_report(report: dict) -> None:
    print(f"\nchaos: seed {report['seed']}, {report['faults']} faults, exit {report['exit_code']}, "
          f"bit-identical {report['bit_identical']}, chaos run {report['chaos_seconds']:.0f}s "
          f"(reference {report['reference_seconds']:.0f}s)")
    print(f"{'#':>3} {'kind':5} {'rank':>4} {'step':>5} {'resumed':>7} {'lost':>4} {'recovery_s':>10}")
    for number, f in enumerate(report["per_fault"], 1):
        print(f"{number:>3} {f['kind']:5} {f['rank']:>4} {f['injected_at_step'] or '-':>5} "
              f"{f['resumed_from_step'] or '-':>7} {f['steps_lost'] if f['steps_lost'] is not None else '-':>4} "
              f"{f['recovery_s'] or '-':>10}")
    for kind, s in report["per_kind"].items():
        print(f"chaos: {kind}: {s['count']} faults, recovery median {s['median_recovery_s']}s, max {s['max_recovery_s']}s")
    for problem in report["problems"]:
        print(f"chaos: FAILED: {problem}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.integration.chaos", description=(
        "N random faults (SIGKILL, SIGTERM, SIGSTOP of a random rank's worker) in one ray-app train run on a local "
        "Ray; exit 1 unless it ends on an uninterrupted run's parameters, bit for bit, within the steps-lost bounds."))
    parser.add_argument("--faults", type=int, default=20, help="how many faults to inject (default 20)")
    parser.add_argument("--seed", type=int, default=None, help="the plan's seed (default: a random one, printed)")
    parser.add_argument("--kinds", default="kill,term,stop", help="comma-separated, from kill,term,stop")
    parser.add_argument("--out", type=Path, help="write the JSON report here, the chaos run's output next to it (.log)")
    parser.add_argument("--storage", type=Path, help="run.storage of both runs (default: a temporary folder, removed "
                        "if every check held)")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or set(kinds) - set(SIGNALS) or args.faults < 1:
        parser.error(f"--kinds takes some of {','.join(SIGNALS)} and --faults at least 1")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    if args.storage and any((args.storage / name).exists() for name in ("reference", "chaos")):
        parser.error(f"--storage {args.storage} has runs of an earlier chaos run (they would be resumed); use another")
    storage = args.storage or Path(tempfile.mkdtemp(prefix="ray-app-chaos-"))
    storage.mkdir(parents=True, exist_ok=True)
    report = run_chaos(args.faults, seed, kinds, storage)
    print_report(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        shutil.copyfile(storage / "chaos.log", args.out.with_suffix(".log"))
    if report["problems"]:
        print(f"chaos: the runs' folders and logs are in {storage}", file=sys.stderr)
        return 1
    if args.storage is None:
        shutil.rmtree(storage, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
