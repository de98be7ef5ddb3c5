"""What ``ray-app train``'s summary says after faults: this launch's restarts (each with its cause, rank and
step, from the run journal), the wall time from the driver's start, the epoch's loss sums kept in the
checkpoint's state; and the line of a run that is already complete, naming the key that ended it."""

from __future__ import annotations

import json
import time

import pytest

from ray_app.driver import launcher
from ray_app.shared import journal
from ray_app.shared.catalog import Position, TrainState
from ray_app.shared.config import load_config
from ray_app.shared.errors import PeerLost, Preempted
from ray_app.shared.storage import LocalStorage


def _policy_decides(cfg, run: str, launch: str, errors: dict[int, BaseException]) -> None:
    """What Ray Train's controller does with a failed worker group: the kit's policy (pickled there) decides
    and journals it."""
    from ray import cloudpickle
    from ray.train import FailureConfig
    from ray.train.v2.api.exceptions import WorkerGroupError

    from ray_app.controller.failure_policy import KitFailurePolicy

    sent = KitFailurePolicy(FailureConfig(max_failures=3), journal_of=(cfg.run.storage, run, launch))
    cloudpickle.loads(cloudpickle.dumps(sent)).make_decision(WorkerGroupError("x", errors))


def _lost(rank: int, step: int) -> PeerLost:
    """A rank that lost its peer, as the worker raises it: with the step it was at (ray_app.worker.entry)."""
    error = PeerLost(f"rank {rank} lost a peer: RuntimeError: Connection closed by peer")
    error.step = step
    return error


@pytest.mark.timeout(60)
def test_the_summary_lists_this_launchs_restarts_and_counts_wall_seconds_from_the_drivers_start(tmp_path, monkeypatch):
    cfg = load_config(None, [f"run.storage={tmp_path}", "run.name=r"])
    storage = LocalStorage(str(tmp_path))
    old = journal.JournalWriter(storage, "r", source="policy")  # an earlier launch's restart: not this one's
    old.record("restart", launch="earlier", cause="rank 0: RuntimeError: before", rank=0, step=3)
    assert old.flush(5.0)

    def preflight(cfg_):  # the preflight and its waits count in the wall time
        time.sleep(0.3)
        return storage, None, set()

    def launch(cfg_, job, run, storage_path, fs=None):
        _policy_decides(cfg_, run, job["launch_id"], {0: _lost(0, 41), 1: RuntimeError("the actor died unexpectedly")})
        _policy_decides(cfg_, run, job["launch_id"], {0: Preempted("preempted at step 50"), 1: Preempted("x")})
        return {"global_step": 64, "train_loss": 0.37, "epochs": 2}

    monkeypatch.setattr(launcher, "preflight_train", preflight)
    monkeypatch.setattr(launcher, "launch", launch)
    monkeypatch.setattr(launcher, "DRIVER_START_UNIX", time.time() - 30.0)  # the driver started 30 s ago
    summary = launcher.run_training(cfg)
    assert summary["wall_seconds"] >= 30.3, summary
    assert summary["restarts"] == [
        {"kind": "restart", "cause": "rank 1: RuntimeError: the actor died unexpectedly", "rank": 1, "step": 41},
        {"kind": "preemption", "cause": "rank 0: Preempted: preempted at step 50", "rank": 0, "step": None},
    ], summary
    json.dumps(summary)  # the summary line is JSON

    monkeypatch.setattr(launcher, "launch", lambda cfg_, job, *a, **k: {"global_step": 64, "train_loss": 0.3})
    again = launcher.run_training(load_config(None, [f"run.storage={tmp_path}", "run.name=clean"]))
    assert again["restarts"] == [] and again["wall_seconds"] >= 30.3


@pytest.mark.timeout(30)
def test_a_restarts_rank_and_step_are_the_first_failed_ranks_else_the_hangs_else_the_others():
    from ray_app.controller.failure_policy import where_failed
    from ray_app.shared.errors import UserCodeError

    assert where_failed({1: RuntimeError("the actor died unexpectedly")}) == {"rank": 1, "step": None}
    assert where_failed({}) == {"rank": None, "step": None}  # a group that did not start
    user = UserCodeError("ValueError: bad", "Traceback ...", "fp", 1, 7)
    assert where_failed({0: _lost(0, 9), 1: user}) == {"rank": 1, "step": 7}  # its own step, not the others'
    hung = {1: RuntimeError("A worker health check has been hanging"), 0: _lost(0, 9)}
    assert where_failed(hung, hang_step=10) == {"rank": 1, "step": 10}  # the collective the hang's line names
    assert where_failed(hung) == {"rank": 1, "step": 9}  # the furthest step a rank that lost it reached


@pytest.mark.timeout(60)
@pytest.mark.parametrize("keys, line", [
    (["train.epochs=2"], "(train.epochs=2 reached); nothing to train. Raise train.epochs to train on"),
    (["train.epochs=5", "train.max_steps=40"],
     "(train.max_steps=40 reached); nothing to train. Raise train.max_steps to train on"),
    (["train.epochs=2", "train.max_steps=40"],
     "(train.epochs=2 and train.max_steps=40 reached); nothing to train. Raise train.epochs and train.max_steps"),
], ids=["epochs", "max_steps", "both"])
def test_a_complete_run_run_again_names_the_key_that_ended_it(keys, line, tmp_path, monkeypatch, capsys):
    from tests.support.checkpoints import write_checkpoint

    cfg = load_config(None, [f"run.storage={tmp_path}", "run.name=r", *keys])
    ckpt = write_checkpoint(tmp_path / "r", 40, epoch=2, config=cfg.to_dict(), metrics={"global_step": 40, "train_loss": 0.3})
    monkeypatch.setattr(launcher, "preflight_run", lambda cfg_: LocalStorage(str(tmp_path)))
    monkeypatch.setattr(launcher, "DRIVER_START_UNIX", time.time() - 30.0)
    summary = launcher.run_training(cfg)
    said = capsys.readouterr().err.strip()
    assert said.startswith(f"ray-app: run r is complete: {LocalStorage(str(tmp_path)).uri('r', ckpt.name)} is at epoch 2, "
                           "step 40 "), said
    assert line in said and said.endswith("or use another run.name for a new run"), said
    assert summary["complete"] and summary["restarts"] == [] and summary["wall_seconds"] >= 30, summary


@pytest.mark.timeout(30)
def test_the_epochs_loss_sums_round_trip_through_the_checkpoints_state_and_older_states_start_from_zero():
    sums = (0.1 + 0.2 + 1234.5678901234567, 2877.0)  # float64 values: JSON keeps every bit
    state = TrainState(Position(1, 5, 28, 320, 2), 2, {"eval_loss": 0.5}, {"mlflow_run_id": "x"}, sums)
    saved = json.loads(json.dumps(state.state_dict()))  # state.json
    back = TrainState.from_state_dict(saved, batch_size=32, world_size=2)
    assert back == state and back.epoch_loss == sums
    older = {k: v for k, v in saved.items() if not k.startswith("epoch_loss")}  # a checkpoint from before the sums
    assert TrainState.from_state_dict(older, batch_size=32, world_size=2).epoch_loss == (0.0, 0.0)
