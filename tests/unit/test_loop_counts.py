"""How often the loop evaluates, and what its summary and progress report, on real gloo groups of 1 and 3 ranks.

What a user would notice: E epochs cost E evaluation passes (not E + 1), `ray-app eval` one; the
summary's metrics are the last epoch's; a run cut short by ``train.max_steps`` inside its first epoch
still reports the loss it trained; the logged sample count is all ranks' exact total.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from ray_app.checkpoint import Checkpointer
from ray_app.config import load_config
from ray_app.loop import RunStats, Trainer, build_parts
from ray_app.storage import LocalStorage
from ray_app.tasks import Classification
from tests.unit.test_loop_ddp import FakeRuntime, RecordingMetrics, _finish, _init, _load_ranks, _spawn

N_TRAIN, N_EVAL, BATCH = 48, 13, 4


def tiny_data():
    """A data plug-in (by name: tests.unit.test_loop_counts:tiny_data): 48 train, 13 eval samples."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_TRAIN + N_EVAL, 4, generator=g)
    y = (x[:, 0] > 0).long()
    return TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), TensorDataset(x[N_TRAIN:], y[N_TRAIN:]), {}


class CountingTask(Classification):
    """Classification that counts its evaluate() calls in this process, and whose loss says it averages
    over rank + 1 samples: ranks report different sample counts."""

    def __init__(self):
        super().__init__()
        self.evaluate_calls = 0

    def loss(self, model, batch):
        mean, _ = super().loss(model, batch)
        return mean, dist.get_rank() + 1

    def evaluate(self, model, batch):
        self.evaluate_calls += 1
        return super().evaluate(model, batch)


BASE = ["data.name=tests.unit.test_loop_counts:tiny_data", "model.name=torch.nn:Linear",
        "model.args={in_features: 4, out_features: 2}", "task.name=tests.unit.test_loop_counts:CountingTask",
        f"data.batch_size={BATCH}", "train.epochs=3", "metrics.enabled=false", "train.warmup_epochs=0"]
CASES = {
    # an epoch-boundary end with a checkpoint every epoch (the usual run), progress at every step
    "three-epochs": ["checkpoint.every_epochs=1", "train.log_every_steps=1"],
    # train.max_steps inside the first epoch (4 batches per epoch per rank at 3 ranks, 12 at 1)
    "max-steps": ["checkpoint.every_epochs=1", "train.max_steps=2", "train.log_every_steps=100"],
}


def _passes(task, world: int) -> float:
    """evaluate() calls -> evaluation passes: one pass is this rank's eval batches."""
    return task.evaluate_calls / math.ceil(math.ceil(N_EVAL / world) / BATCH)


def _counts_worker(rank: int, world: int, port: int, out: str, storage: str) -> None:
    from ray_app import launch

    _init(rank, world, port)
    results = {}
    for name, extra in CASES.items():
        cfg = load_config(None, BASE + extra + [f"run.name={name}", f"run.storage={storage}"])
        rt, metrics = FakeRuntime(rank, world), RecordingMetrics()
        checkpointer = Checkpointer(LocalStorage(storage), name, rt.report, every_epochs=cfg.checkpoint.every_epochs,
                                    every_steps=cfg.checkpoint.every_steps)
        trainer = Trainer(cfg, rt, build_parts(cfg, rt), checkpointer, metrics)
        summary = trainer.fit()
        results[name] = {"summary": summary, "evals": metrics.evals, "progress": metrics.progress,
                         "passes": _passes(trainer.task, world)}
    # `ray-app eval`'s worker side, on the newest checkpoint
    cfg = load_config(None, BASE + ["run.name=three-epochs", f"run.storage={storage}"])
    result, trainer = launch._eval(cfg, FakeRuntime(rank, world), RunStats(),
                                   results["three-epochs"]["summary"]["checkpoint"])
    results["eval"] = {"result": result, "passes": _passes(trainer.task, world)}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    _finish()


@pytest.fixture(scope="module", params=[1, 3], ids=["world1", "world3"])
def counted(request, tmp_path_factory, port_picker):
    world = request.param
    out = tmp_path_factory.mktemp(f"counts{world}")
    _spawn(_counts_worker, world, port_picker(), str(out), str(out / "runs"))
    return world, _load_ranks(out, world)


@pytest.mark.timeout(180)
def test_e_epochs_evaluate_e_times_and_the_summary_is_the_last_epochs(counted):
    world, ranks = counted
    for r in ranks:
        run = r["three-epochs"]
        assert run["passes"] == 3 and len(run["evals"]) == 3, (world, run["passes"])
        s = run["summary"]
        assert s["epochs"] == 3
        assert s["eval_accuracy"] == run["evals"][-1]["accuracy"] and s["eval_loss"] == run["evals"][-1]["loss"]
        assert s["num_samples"] == N_EVAL


@pytest.mark.timeout(180)
def test_ray_app_eval_evaluates_once(counted):
    world, ranks = counted
    for r in ranks:
        assert r["eval"]["passes"] == 1
        assert r["eval"]["result"]["eval_accuracy"] == r["three-epochs"]["summary"]["eval_accuracy"]


@pytest.mark.timeout(180)
def test_max_steps_inside_the_first_epoch_reports_the_loss_it_trained(counted):
    world, ranks = counted
    for r in ranks:
        run = r["max-steps"]
        s = run["summary"]
        assert s["global_step"] == 2 and s["epochs"] == 0
        assert math.isfinite(s["train_loss"]), s["train_loss"]
        # the steps' loss, logged once at the stop: the same sums
        assert s["train_loss"] == run["progress"][-1]["train_loss"]
        assert run["passes"] == 1 and len(run["evals"]) == 1  # the final evaluation only


@pytest.mark.timeout(180)
def test_logged_samples_are_the_exact_total_of_all_ranks(counted):
    world, ranks = counted
    progress = ranks[0]["three-epochs"]["progress"]
    assert progress
    # one batch per step on every rank; rank r's task says each averages over r + 1 samples
    assert {p["samples"] for p in progress} == {sum(r + 1 for r in range(world))}
