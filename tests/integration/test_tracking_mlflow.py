"""Experiment tracking against a real ``mlflow server`` (SQLite backend, its own process on 127.0.0.1).

One ``ray-app train`` (2 CPU workers, gloo, MLflow and TensorBoard on) goes through, in order:

1. the server does not answer at the start (its process is SIGSTOPped: connections hang): one warning
   line, training runs; the server answers again: one line, and what was buffered is logged;
2. rank 0 SIGKILLed after a mid-epoch checkpoint: the restarted group continues the same MLflow run;
3. the server stopped for 15 s mid-run: one line when it goes, one when it is back, and the window's
   steps are logged after it returns;

then MLflow's own client reads back: one run; every step at most once, in order; each value equal to the
kit's progress line at that step; params equal to the resolved config (a checkpoint's config.json); and
TensorBoard's own reader gives the same scalars from the event files in the run's folder. The throughput
during an outage, beside a run without tracking, is bench/run.py's case, not a timed test here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.integration.faultlib import Run, committed_steps, workload
from tests.support.tools import venv_tool

pytestmark = pytest.mark.integration

OUTAGE_S = 15  # longer than the client's request timeout (10 s): a request meets the outage and fails
RUN = "tracked"
PACE_S = 0.08  # per batch: at most 12 steps/s, the test waits on the server and the restart, not on steps
PROGRESS = re.compile(r"\(RayTrainWorker pid=(\d+)\) epoch \d+ step (\d+)/\d+ loss ([\d.]+) lr ([\d.e+-]+) "
                      r"([\d,]+) samples/s")


class MlflowServer:
    """``mlflow server`` in its own session; ``pause``/``resume`` stop and continue every process of it."""

    def __init__(self, folder: Path, port: int):
        self.uri = f"http://127.0.0.1:{port}"
        self.log = open(folder / "mlflow-server.log", "w")
        self.proc = subprocess.Popen(
            [venv_tool("mlflow"), "server", "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
             "--default-artifact-root", str(folder / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1"], cwd=folder, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, Path(self.log.name).read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        pytest.fail(f"mlflow server not healthy after {timeout}s: {Path(self.log.name).read_text()[-3000:]}")

    def _signal(self, sig) -> None:
        os.killpg(self.proc.pid, sig)

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.resume()
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(15)
        self.log.close()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory, port_picker):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"), port_picker())
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def _wait(what: str, check, run: Run, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        assert run.proc.poll() is None, f"the run ended while waiting for {what}:\n{run.text[-4000:]}"
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}\n{run.text[-4000:]}")


def _lines(run: Run, word: str) -> list[tuple[float, str]]:
    return [(t, line) for t, line in run.lines if "tracking: MLflow" in line and word in line]


def _progress(run: Run) -> list[tuple[float, int, int, float, float, float]]:
    """(time, pid, step, loss, lr, samples/s) of rank 0's progress lines."""
    return [(t, int(m[1]), int(m[2]), float(m[3]), float(m[4]), float(m[5].replace(",", "")))
            for t, line in run.lines for m in [PROGRESS.search(line)] if m]


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)]


@pytest.mark.timeout(600)
def test_a_tracked_run_survives_a_late_server_a_killed_rank0_and_an_outage_with_each_step_once(mlflow_server, tmp_path):
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ray_app.worker.tracking import flat_params

    run_dir = tmp_path / RUN
    mlflow_server.pause()  # 1. the URI does not answer at the start
    run = Run(["--set", f"run.storage={tmp_path}", "--set", f"run.name={RUN}", *workload(200, log_every_steps=4, paced_s=PACE_S),
               "--set", "checkpoint.every_steps=20", "--set", f"tracking.mlflow_uri={mlflow_server.uri}",
               "--set", "tracking.tensorboard=true", "--set", "tracking.experiment=integration"])
    try:
        with run:
            _wait("the warning line and training past step 20",
                  lambda: _lines(run, "unreachable") and any(p[2] >= 20 for p in _progress(run)), run)
            assert len(_lines(run, "unreachable")) == 1, run.text[-3000:]
            mlflow_server.resume()
            _wait("the line saying MLflow is back", lambda: _lines(run, "reachable again"), run)

            # 2. rank 0 SIGKILLed after a checkpoint committed since MLflow answered (so it holds the run id)
            seen = committed_steps(run_dir)
            # the second commit after the line: its state was built after the run id was known
            _wait("two newer committed checkpoints",
                  lambda: len([s for s in committed_steps(run_dir) if s > max(seen or [0])]) >= 2, run)
            rank0 = _progress(run)[-1][1]
            victim = psutil.Process(rank0)
            assert victim in run.workers(), (rank0, run.workers())
            victim.send_signal(signal.SIGKILL)
            _wait("the restarted group's resume line", lambda: run.first(r"resumed from "), run)
            _wait("progress after the resume", lambda: [p for p in _progress(run) if p[1] != rank0], run)

            # 3. the server stopped for OUTAGE_S mid-run
            mlflow_server.pause()
            paused_at = time.monotonic()
            time.sleep(OUTAGE_S)
            mlflow_server.resume()
            window = [p[2] for p in _progress(run) if paused_at <= p[0] <= paused_at + OUTAGE_S]
            assert len(window) >= 3, f"training did not go on during the outage: {run.text[-3000:]}"
            client = MlflowClient(tracking_uri=mlflow_server.uri)
            _wait("the outage's steps in MLflow", lambda: [
                r for r in client.search_runs([client.get_experiment_by_name("integration").experiment_id])
                if max((s for s, _ in _history(client, r.info.run_id, "train_loss")), default=0) >= window[-1]], run)
            # the lines reach the driver through Ray's log streaming, after the metrics reached MLflow
            _wait("the second line saying MLflow is back", lambda: len(_lines(run, "reachable again")) >= 2, run)
            gone, back = _lines(run, "unreachable"), _lines(run, "reachable again")
            assert len(gone) == 2 and len(back) == 2, run.text[-4000:]
            assert paused_at <= gone[1][0] and back[1][0] >= paused_at + OUTAGE_S
        # the run is stopped here (Run's exit kills its session): what MLflow has is what it got

        exp = client.get_experiment_by_name("integration")
        (mrun,) = client.search_runs([exp.experiment_id])  # one MLflow run through the restart
        rid = mrun.info.run_id
        # a step between the last checkpoint and the kill is printed twice (the first attempt, then the replay
        # after the resume): its loss and lr are the same, its samples/s is each attempt's own, and MLflow
        # holds the one of whichever attempt got it there first
        printed: dict[int, tuple[float, float, float]] = {}
        printed_rates: dict[int, list[float]] = {}
        for _, _, step, loss, lr, sps in _progress(run):
            printed.setdefault(step, (loss, lr, sps))
            printed_rates.setdefault(step, []).append(sps)
        history = {k: _history(client, rid, k) for k in ("train_loss", "lr", "samples_per_second")}
        for key, points in history.items():
            steps = [s for s, _ in points]
            assert steps == sorted(set(steps)), f"{key}: a step twice or out of order: {steps}"
        loss_steps = [s for s, _ in history["train_loss"]]
        assert set(window) <= set(loss_steps), "the outage's steps were not logged after the server returned"
        assert {s for s in printed if s <= window[-1]} <= set(loss_steps), "a printed step is missing in MLflow"
        # the last values may be in MLflow before their lines reached the driver, when the run is stopped
        compared = [s for s in loss_steps if s in printed]
        assert len(compared) >= len(loss_steps) - 20, (len(compared), len(loss_steps))
        for i, (key, tol) in enumerate((("train_loss", {"abs": 6e-5}), ("lr", {"rel": 1e-3, "abs": 1e-6}))):
            for step, value in history[key]:
                if step in printed:
                    assert value == pytest.approx(printed[step][i], **tol), (key, step)
        for step, value in history["samples_per_second"]:
            if step in printed_rates:
                assert any(value == pytest.approx(r, abs=0.6) for r in printed_rates[step]), (step, printed_rates[step])
        evals = _history(client, rid, "eval_accuracy")
        assert evals and [s for s, _ in evals] == sorted({s for s, _ in evals})

        newest = sorted(run_dir.glob("ckpt-s*/manifest.json"))[-1].parent
        config = json.loads((newest / "config.json").read_text())
        params = flat_params(config)
        assert mrun.data.params == params
        state = json.loads((newest / "state.json").read_text())
        assert state["tracking"]["mlflow_run_id"] == rid
        assert mrun.data.tags["ray_app.world_size"] == "2" and mrun.data.tags["ray_app.model"] == "digits_cnn"
        assert any(v.endswith(newest.name) or "/ckpt-s" in v for k, v in mrun.data.tags.items()
                   if k.startswith("checkpoint.step_"))

        acc = EventAccumulator(str(run_dir / "tensorboard"))
        acc.Reload()
        tb = {s: e for s, e in ((e.step, e.value) for e in acc.Scalars("train_loss"))}
        tb_steps = [e.step for e in acc.Scalars("train_loss")]
        assert tb_steps == sorted(set(tb_steps)), "TensorBoard shows a step twice after the restart"
        both = set(tb) & {s for s, _ in history["train_loss"]}
        assert len(both) >= 10
        for step, value in history["train_loss"]:
            if step in tb:
                assert tb[step] == pytest.approx(value, rel=1e-6)
        sps = [(t, v) for t, _, _, _, _, v in _progress(run)]
        during = sorted(v for t, v in sps if paused_at <= t <= paused_at + OUTAGE_S)
        before = sorted(v for t, v in sps if paused_at - OUTAGE_S <= t < paused_at)
        print(f"\n[tracking] MLflow steps {len(loss_steps)} (compared with the kit's lines: {len(compared)}; outage "
              f"window steps {window[0]}..{window[-1]}), TensorBoard steps {len(tb_steps)}; lines: gone "
              f"{gone[1][0] - paused_at:.1f}s after the pause, back {back[1][0] - paused_at - OUTAGE_S:.1f}s after "
              f"it ended; median samples/s {before[len(before) // 2]:.0f} in the {OUTAGE_S}s before, "
              f"{during[len(during) // 2]:.0f} during")
    finally:
        mlflow_server.resume()
