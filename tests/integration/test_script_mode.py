"""Script mode on a real Ray: a torchrun-style DDP script, unchanged, under ``ray-app run``.

- the script (the source article's structure) prints the same losses, eval accuracies and final
  parameters under ``ray-app run`` on 2 CPU workers as under ``torchrun --standalone --nproc-per-node 2``,
  with torchrun's environment on every rank;
- bad input: a missing script exits 2 with one line before Ray starts; a script that raises exits 1 with
  its traceback once, retried once and not to the end of failure.max_failures;
- the same script through ``ray job submit --working-dir .`` is e2e/test_cluster.py's (a cluster of containers);
- a worker SIGKILLed mid-run: with ``ray_app.script.save``/``load`` the run resumes from the newest save
  and ends on the uninterrupted run's parameters; without them it restarts from its beginning and finishes;
- a driver that stops answering (SIGSTOP: its Ray and its workers live on, as behind a lost driver host),
  then SIGKILLed: the same command run again takes the run over, and the first driver's workers commit
  nothing after that (the lease's fence in ``save``).
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

import pytest

from tests.support.ddp_script import lines_of, write_scripts
from tests.support.processes import run_cli, train_workers

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
ENV = {"RAY_ADDRESS": None, "OMP_NUM_THREADS": "1"}  # torchrun sets 1 thread per rank; Ray's workers get the same
EPOCHS = ["--epochs", "3"]


def env_of(marks: Path) -> dict[int, dict]:
    """Each rank's environment as the script wrote it (printed lines of two ranks are not reliable under
    torchrun: they share the output and may overwrite each other)."""
    return {r: json.loads((marks / f"env-{r}.json").read_text()) for r in (0, 1)}


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return write_scripts(tmp_path_factory.mktemp("torchrun-style"))


def torchrun(project: Path, args: list[str]) -> tuple[int, str]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full_env.pop("RAY_ADDRESS", None)
    t0 = time.monotonic()
    p = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "train.py", *args],
                       cwd=project, env=full_env, capture_output=True, text=True, timeout=300)
    print(f"torchrun {' '.join(args)}: rc {p.returncode} in {time.monotonic() - t0:.1f}s")
    return p.returncode, p.stdout + p.stderr


@pytest.fixture(scope="module")
def reference(project, tmp_path_factory) -> dict:
    """The script under torchrun: what it prints on rank 0, and each rank's environment."""
    marks = tmp_path_factory.mktemp("torchrun-marks")
    _, text = torchrun(project, [*EPOCHS, "--mark", str(marks)])  # torch 2.14 on CPU may SIGABRT a rank at exit
    lines = lines_of(text)
    assert lines and lines[-1].startswith("final parameters"), text[-3000:]
    return {"lines": lines, "env": env_of(marks)}


def ray_app(args: list[str], cwd: Path, env: dict | None = None, timeout: float = 600):
    t0 = time.monotonic()
    rc, out, err = run_cli(args, env={**ENV, **(env or {})}, timeout=timeout, cwd=cwd, console_script=True)
    print(f"ray-app {' '.join(args)}: rc {rc} in {time.monotonic() - t0:.1f}s")
    return rc, out, err


def test_the_script_prints_the_same_losses_under_ray_app_run_as_under_torchrun(project, reference, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    rc, out, err = ray_app(["run", "--set", f"run.storage={tmp_path}", "train.py", *EPOCHS, "--mark", str(marks)],
                           project)
    assert rc == 0, f"{out[-3000:]}\n{err[-3000:]}"
    assert lines_of(out + err) == reference["lines"]  # every logged step, every eval, the final parameters
    assert len([ln for ln in reference["lines"] if " loss " in ln]) == 3 * 10 // 5  # ceil(151 / 16) = 10 steps/epoch
    env = env_of(marks)
    for rank in (0, 1):
        for got in (env[rank], reference["env"][rank]):
            assert {k: got[k] for k in ("RANK", "LOCAL_RANK", "ROLE_RANK")} == dict.fromkeys(
                ("RANK", "LOCAL_RANK", "ROLE_RANK"), str(rank))
            assert got["WORLD_SIZE"] == got["LOCAL_WORLD_SIZE"] == got["ROLE_WORLD_SIZE"] == "2"
            assert got["GROUP_RANK"] == "0" and None not in (got["MASTER_ADDR"], got["MASTER_PORT"])
    assert env[0]["TORCHELASTIC_RUN_ID"] == "train"  # the run, named after the script


# ---------------------------------------------------------------- bad input

def test_a_missing_script_exits_2_with_one_line_before_ray_starts(project):
    t0 = time.monotonic()
    rc, out, err = ray_app(["run", "tran.py", "--epochs", "3"], project)
    assert rc == 2 and out == "", (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("ray-app: error: SCRIPT tran.py: no such file"), err
    assert time.monotonic() - t0 < 20 and not (project / "runs").exists()  # Ray never started


def test_a_script_that_raises_exits_1_with_its_traceback_once_and_is_not_retried_to_the_end(project, tmp_path):
    rc, out, err = ray_app(["run", "--set", f"run.storage={tmp_path}", "--set", "failure.max_failures=3",
                            "fails.py"], project)
    assert rc == 1, f"{out[-3000:]}\n{err[-3000:]}"
    text = out + err
    assert text.count("Traceback") == 1, text[-5000:]
    assert "fails.py" in err and "in step" in err and "runpy" not in err
    assert "ray_app/worker/script.py" not in err and "ray_app/worker/entry.py" not in err  # the script's frames only
    assert err.strip().splitlines()[-1].startswith("ray-app: training failed: ValueError: bad batch 3 on rank")
    # the second attempt failed at the same place: a bug, not a fault; failure.max_failures=3 is not used up
    assert 1 <= text.count("attempt started") <= 2, text[-5000:]
    assert text.count("ray-app: notice: the script asks for backend 'nccl'") == text.count("attempt started")


# ---------------------------------------------------------------- a cluster: ray job submit

# ---------------------------------------------------------------- a worker SIGKILLed mid-run

def _committed(run_dir: Path) -> int:
    return len(list(run_dir.glob("ckpt-s*/manifest.json")))


def run_and_kill(project: Path, args: list[str], ready) -> tuple[int, str]:
    """``ray-app run ARGS`` from the project; when ``ready()``, SIGKILL one training worker from outside."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full_env.pop("RAY_ADDRESS", None)
    t0 = time.monotonic()
    proc = subprocess.Popen([str(BIN / "ray-app"), "run", *args], cwd=project, env=full_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None and not ready():
            time.sleep(0.05)
        assert proc.poll() is None and ready(), "the run ended (or stalled) before the kill"
        workers = train_workers(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[-1].pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    print(f"ray-app run {' '.join(args)} (one worker killed): rc {proc.returncode} in {time.monotonic() - t0:.1f}s")
    return proc.returncode, out


SLOW = ["--epochs", "8", "--sleep", "0.6"]


@pytest.fixture(scope="module")
def uninterrupted(project) -> str:
    """The checkpointing script's final parameters under torchrun (there save() saves nothing, load() is None)."""
    _, text = torchrun(project, [*SLOW, "--sleep", "0", "--checkpoint"])
    lines = lines_of(text)
    assert lines and lines[-1].startswith("final parameters"), text[-3000:]
    return lines[-1]


def test_a_killed_worker_resumes_from_the_newest_save_and_ends_on_the_same_parameters(project, uninterrupted, tmp_path):
    run_dir = tmp_path / "resume"
    at_kill = []

    def ready():
        at_kill[:] = [_committed(run_dir)]
        return at_kill[0] >= 2

    rc, out = run_and_kill(project, ["--set", f"run.storage={tmp_path}", "--set", "run.name=resume", "train.py",
                                     *SLOW, "--checkpoint"], ready)
    assert rc == 0, out[-4000:]
    resumed = [int(n) for n in re.findall(r"ray-app: resuming from \S+ \(save (\d+)\)", out)]
    assert resumed and resumed[0] >= at_kill[0], (resumed, at_kill)  # lost at most the save in flight
    assert lines_of(out)[-1] == uninterrupted
    # the restart is one line; the surviving rank's failed collective is not the script's error
    assert len(re.findall(r"ray-app: rank \d+.*; the worker group restarts from the newest committed checkpoint "
                          r"\(restart 1 of", out)) == 1, out[-4000:]
    assert "Error in training function" not in out, out[-4000:]


def test_a_killed_worker_without_checkpoints_restarts_the_script_and_finishes(project, uninterrupted, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    rc, out = run_and_kill(project, ["--set", f"run.storage={tmp_path}", "train.py", *SLOW, "--mark", str(marks)],
                           lambda: (marks / "epoch-1").exists())
    assert rc == 0, out[-4000:]
    assert "resuming from" not in out
    assert len([ln for ln in lines_of(out) if ln.startswith("epoch 0 ")]) == 2  # from its beginning, twice
    assert lines_of(out)[-1] == uninterrupted


# ---------------------------------------------------------------- a driver lost while its workers live on

def _saves(run_dir: Path) -> list[tuple[float, str]]:
    """(manifest's time, the script's tag) of each committed save of the run."""
    import torch

    out = []
    for manifest in run_dir.glob("ckpt-s*/manifest.json"):
        state = torch.load(manifest.parent / "state.pt", weights_only=True)
        out.append((json.loads(manifest.read_text())["created"], state["tag"]))
    return sorted(out)


@pytest.mark.timeout(420)
def test_a_lost_drivers_script_workers_commit_nothing_once_the_run_is_taken_over(project, tmp_path):
    stale = 8.0
    args = ["--set", f"run.storage={tmp_path}", "--set", "run.name=fenced", "--set", f"run.lease_stale_s={stale}",
            "--set", "scaling.num_workers=1", "train.py", "--epochs", "80", "--sleep", "0.4", "--checkpoint"]
    run_dir = tmp_path / "fenced"
    full_env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full_env.pop("RAY_ADDRESS", None)
    first = subprocess.Popen([str(BIN / "ray-app"), "run", *args, "--tag", "first"], cwd=project, env=full_env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    second_log = tmp_path / "second.log"
    try:
        deadline = time.time() + 240
        while time.time() < deadline and len(_saves(run_dir)) < 2 and first.poll() is None:
            time.sleep(0.2)
        assert first.poll() is None and len(_saves(run_dir)) >= 2, "the first run never saved twice"
        first.send_signal(signal.SIGSTOP)  # the driver only: its lease is no longer renewed, its workers go on
        time.sleep(stale / 2 + 1)  # a lease that missed its renewals: the second driver waits until it is stale
        with open(second_log, "w") as log:
            second = subprocess.Popen([str(BIN / "ray-app"), "run", *args, "--epochs", "2", "--tag", "second"],
                                      cwd=project, env=full_env, stdout=log, stderr=subprocess.STDOUT, text=True)
            taken_at = None
            while second.poll() is None and time.time() < deadline + 120:
                if taken_at is None and "ray-app: taking over run" in second_log.read_text():
                    taken_at = time.time()
                time.sleep(0.1)
            second.wait(timeout=60)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    text = second_log.read_text()
    assert second.returncode == 0 and taken_at is not None, text[-4000:]
    saves = _saves(run_dir)
    late = [(at - taken_at, tag) for at, tag in saves if tag == "first" and at > taken_at + 1.0]
    assert not late, (late, text[-3000:])  # the first driver's workers: nothing after the take-over
    assert any(tag == "second" for _, tag in saves) or "resuming from" in text, text[-3000:]
