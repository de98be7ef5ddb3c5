"""Faults beyond a killed worker, on a local Ray (CPU, gloo).

- a rank SIGSTOPped mid-epoch: the others' collectives give up after ``failure.hang_timeout_s``, Ray
  Train restarts the group from the newest checkpoint, the stopped process is killed; before that the
  other rank writes its hang report (stacks and collective counter) and the driver's one line names the
  stopped rank, the collective the other waits in and the step; the summary's ``restarts`` tells that one
  restart (cause, rank, step), and every epoch's loss, the one the restart cut included, is the uninterrupted
  run's;
- a SIGTERM to the driver: the workers checkpoint at the next step boundary and the run stops (143);
  the same command again resumes there;

each run ends on the uninterrupted run's parameters, bit for bit. A SIGTERM to a worker (a preemption
notice) is test_chaos.py's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.integration.faultlib import STEPS_PER_EPOCH, Run, assert_bit_identical, committed_steps, final_model, summary_of, workload

pytestmark = pytest.mark.integration

EPOCHS = 10  # ~0.4 s an epoch at 2 workers: a stop sent at step 8 lands well before the end (at 3 it could not)
HANG_TIMEOUT_S = 15
WORKLOAD = workload(EPOCHS)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> tuple[dict, str]:
    """The uninterrupted run: its summary and its output."""
    storage = tmp_path_factory.mktemp("reference")
    run = Run(["--set", f"run.storage={storage}", "--set", "run.name=ref", *WORKLOAD])
    assert run.wait() == 0, run.text[-4000:]
    summary = summary_of(run.text)
    assert summary["global_step"] == EPOCHS * STEPS_PER_EPOCH and summary["restarts"] == [], summary
    return summary, run.text


@pytest.fixture(scope="module")
def reference(reference_run) -> dict:
    """The uninterrupted run's final parameters."""
    return final_model(reference_run[0])


def epoch_losses(text: str) -> list[tuple[int, str]]:
    """Every "epoch N done: train loss L" line of a run's output, in order (an epoch may end twice: before
    a failure and again after the restart)."""
    return [(int(e), loss) for e, loss in re.findall(r"epoch (\d+) done: train loss (\S+)", text)]


def test_a_stopped_rank_is_detected_within_the_hang_timeout_and_the_run_ends_bit_identical(reference, reference_run,
                                                                                         tmp_path):
    run_dir = tmp_path / "hang"
    run = Run(["--set", f"run.storage={tmp_path}", "--set", "run.name=hang", *WORKLOAD,
               "--set", "checkpoint.every_steps=12", "--set", f"failure.hang_timeout_s={HANG_TIMEOUT_S}",
               "--set", "failure.storage_retry_s=5"])
    victim, stopped_at, before = None, None, []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and run.proc.poll() is None:
            before = committed_steps(run_dir)
            if any(s > STEPS_PER_EPOCH and s % STEPS_PER_EPOCH for s in before):  # a mid-epoch checkpoint
                break
            time.sleep(0.1)
        workers = run.workers()
        assert len(workers) == 2 and run.proc.poll() is None, (workers, run.text[-3000:])
        victim = workers[-1]
        victim.send_signal(signal.SIGSTOP)  # alive, holding its sockets, answering nothing
        stopped_at = time.monotonic()
        rc = run.wait()
    finally:
        if victim is not None and victim.is_running():
            victim.send_signal(signal.SIGCONT)
    assert rc == 0, run.text[-5000:]
    resumed_at = run.first(r"resumed from ")
    assert resumed_at is not None and resumed_at > stopped_at, run.text[-5000:]
    seconds = resumed_at - stopped_at
    print(f"\n[faults] SIGSTOP -> resumed group loaded its checkpoint in {seconds:.1f}s "
          f"(hang_timeout_s {HANG_TIMEOUT_S}, so {seconds - HANG_TIMEOUT_S:.1f}s of detection slack and restart)")
    # detected by the hang timeout, not before it, and not by torch's default of 30 minutes: the upper
    # bound leaves a loaded machine minutes for the restart and the checkpoint load
    assert HANG_TIMEOUT_S - 1 <= seconds <= HANG_TIMEOUT_S + 600, seconds
    assert not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE  # the stopped process was killed
    # the restart is one line naming the rank that failed; the survivor's collective timeout is not shown
    restarts = re.findall(r"^(?:\(TrainController pid=\d+\) )?ray-app: (rank \d+.*); the worker group restarts from the newest committed checkpoint "
                          r"\(restart (\d+) of \d+: failure\.max_failures\)$", run.text, re.M)
    assert [n for _, n in restarts] == ["1"], run.text[-5000:]
    assert "Error in training function" not in run.text and "Traceback" not in run.text, run.text[-5000:]
    hang_step, stopped = _the_hang_report_names_the_stopped_rank(run, victim.pid, run_dir)
    print(f"[faults] the hang line {run.first(r'ray-app: hang: ') - stopped_at:.1f}s after the SIGSTOP")

    summary = summary_of(run.text)
    assert summary["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert summary["resumed_from_step"] >= max(before) > STEPS_PER_EPOCH, (summary, before)
    # the hang was at a step after the checkpoint the group resumed from, within its cadence (every 12 steps)
    assert summary["resumed_from_step"] < hang_step <= summary["resumed_from_step"] + 13, (hang_step, summary)
    assert_bit_identical(final_model(summary), reference)
    # the summary tells the restart: its cause as its line says it, the stopped rank, the step of the hang's line
    print(f"[faults] the summary's restarts: {summary['restarts']}")
    assert [(r["kind"], r["cause"], r["rank"], r["step"]) for r in summary["restarts"]] == \
        [("restart", restarts[0][0], stopped, hang_step)], (summary["restarts"], hang_step)
    # every epoch's loss, the one the restart cut included, and the summary's (the last epoch's) are over the
    # whole epoch, the steps re-done after the restart counted once: the uninterrupted run's (the sums came with
    # the checkpoint resumed from; the same float32 terms in float64 sums, then one division: equal to 1e-6
    # relative and in practice to the bit)
    ref_summary, ref_text = reference_run
    uninterrupted = dict(epoch_losses(ref_text))
    assert len(uninterrupted) == EPOCHS and all(loss == uninterrupted[e] for e, loss in epoch_losses(run.text)), \
        (epoch_losses(run.text), uninterrupted)
    assert summary["train_loss"] == pytest.approx(ref_summary["train_loss"], rel=1e-6), (summary, ref_summary)


def _the_hang_report_names_the_stopped_rank(run: Run, victim_pid: int, run_dir: Path) -> tuple[int, int]:
    """The driver's one hang line names the stopped rank (each rank's line says its pid), the collective the
    other rank waits in and the step; that rank's stacks and counter are in the folder the line names, the
    stopped one wrote nothing. Returns the step and the stopped rank."""
    ranks = {int(pid): int(rank) for pid, rank in re.findall(r"pid=(\d+)(?:, ip=\S+)?\) rank (\d+)/2 on host", run.text)}
    stopped, other = ranks[victim_pid], 1 - ranks[victim_pid]
    lines = re.findall(r"ray-app: (hang: .*)$", run.text, re.M)
    assert len(lines) == 1, run.text[-5000:]
    m = re.fullmatch(r"hang: rank (\d) \(host (\S+); no report: stopped or gone\) did not reach (.+) #(\d+) at step "
                     r"(\d+) that rank (\d) waits in; stacks in (\S+)/", lines[0])
    assert m and (int(m.group(1)), int(m.group(6))) == (stopped, other), lines[0]
    folder = Path(m.group(7))
    assert folder.parent == run_dir / "reports", folder
    assert sorted(f.name for f in folder.iterdir()) == [f"rank-{other}.json", f"rank-{other}.txt", "verdict.json"]
    assert json.loads((folder / "verdict.json").read_text())["did_not_arrive"] == [stopped]
    report = json.loads((folder / f"rank-{other}.json").read_text())
    assert (report["name"], report["seq"], report["step"], report["inside"]) == \
        (m.group(3), int(m.group(4)), int(m.group(5)), True), report
    stacks = (folder / f"rank-{other}.txt").read_text()
    # first the thread that entered the collective: Ray Train's training thread, in the kit's loop
    first = stacks.split('\nThread "')[0]
    assert first.startswith('Thread "TrainingThread') and ", entered the collective)" in first, stacks
    assert "in fit" in first and 'Thread "MainThread"' in stacks, stacks
    # the run journal has the same line, before the restart it explains
    shown = json.loads(subprocess.run([sys.executable, "-m", "ray_app", "runs", "show", str(run_dir), "--json"],
                                      capture_output=True, text=True, timeout=60, check=True).stdout)
    kinds = [(e["kind"], e.get("cause", "")) for e in shown["events"] if e["kind"] in ("hang_report", "restart")]
    assert kinds[:1] == [("hang_report", lines[0])] and kinds[1][0] == "restart", kinds
    print(f"\n[faults] {lines[0]}")
    return int(m.group(5)), stopped


def test_a_sigterm_to_the_driver_stops_the_run_at_a_checkpoint_and_a_resubmit_loses_no_step(reference, tmp_path):
    """A SIGTERM to the driver's process group (a terminal closed, a job scheduler's stop; `ray job stop` and
    `docker stop` reach the driver the same way): the local Ray's processes are in a session of their own, so
    the workers checkpoint at the next step boundary, the driver exits 143 with one line; the same command
    again resumes there and ends bit-identical."""
    args = ["--set", f"run.storage={tmp_path}", "--set", "run.name=stop", *WORKLOAD]
    with Run(args) as run:
        logged = run.wait_for_step(8)  # early: most of the run is left for the stop to land in
        assert run.proc.poll() is None, run.text[-3000:]
        os.killpg(run.proc.pid, signal.SIGTERM)  # the driver's whole process group, as a terminal's close does
        signalled_at = time.monotonic()
        rc = run.wait()
    assert rc == 143, run.text[-5000:]
    m = re.search(r"stopped: checkpoint (\S+) at step (\d+) committed", run.text)
    assert m, run.text[-5000:]
    step = int(m.group(2))
    assert step >= logged[-1] and step < EPOCHS * STEPS_PER_EPOCH, (step, logged)
    assert step in committed_steps(tmp_path / "stop")
    assert run.text.count("ray-app: stopped at step") == 1 and "Traceback" not in run.text, run.text[-5000:]
    print(f"\n[faults] driver SIGTERM -> checkpoint at step {step} committed and the driver exited "
          f"{run.first(r'ray-app: stopped at step') - signalled_at:.1f}s after the signal")

    again = Run(args)
    assert again.wait() == 0, again.text[-5000:]
    assert re.search(rf"resumed from \S+ckpt-s0*{step}-", again.text), again.text[-5000:]
    summary = summary_of(again.text)
    assert summary["resumed_from_step"] == step and summary["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert_bit_identical(final_model(summary), reference)
    # the journal: two launches, the first ended by the stop (143, its line), the second resumed at its step
    shown = json.loads(subprocess.run([sys.executable, "-m", "ray_app", "runs", "show", str(tmp_path / "stop"),
                                       "--json"], capture_output=True, text=True, timeout=60, check=True).stdout)
    ends = [(e["exit_code"], e["line"].split(";")[0]) for e in shown["events"] if e["kind"] == "end"]
    assert ends == [(143, f"ray-app: stopped at step {step}"), (0, "")], ends
    attempts = [e["resumed_from_step"] for e in shown["events"] if e["kind"] == "attempt"]
    assert attempts == [0, step] and shown["state"] == "finished", attempts
