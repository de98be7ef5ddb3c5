"""How often the loop evaluates, and what its summary and progress report, on real gloo groups of 1 and 3 ranks.

What a user would notice: E epochs cost E evaluation passes (not E + 1), `ray-app eval` one; the
summary's metrics are the last epoch's; a run cut short by ``train.max_steps`` inside its first epoch
still reports the loss it trained; the logged sample count is all ranks' exact total.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from ray_app.shared.config import load_config
from ray_app.shared.errors import ConfigError
from ray_app.shared.storage import LocalStorage
from ray_app.shared.tasks import Classification
from ray_app.worker.checkpoint import Checkpointer
from ray_app.worker.loop import Trainer
from ray_app.worker.parts import build_parts
from ray_app.worker.progress import RunStats
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


class RowsTask(CountingTask):
    """A task whose metric needs every value (a median): the kit gathers them for it, in the data set's order."""

    def summarize_rows(self, rows: dict) -> dict:
        return {"rows": len(rows["loss"]), "median_loss": rows["loss"].median().item()}


class CollectiveTraffic:
    """Counts the elements each rank sends through all_gather and all_reduce while it is active."""

    def __init__(self, monkeypatch_target):
        self.target, self.sent = monkeypatch_target, {"all_gather": 0, "all_reduce": 0}

    def __enter__(self):
        self.saved = {name: getattr(self.target, name) for name in self.sent}
        for name, fn in self.saved.items():
            def counted(*args, _name=name, _fn=fn, **kwargs):
                tensor = args[1] if _name == "all_gather" else args[0]
                self.sent[_name] += tensor.numel()
                return _fn(*args, **kwargs)
            setattr(self.target, name, counted)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(self.target, name, fn)


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
    from ray_app.worker import entry as worker

    _init(rank, world, port)
    results = {}
    for name, extra in CASES.items():
        cfg = load_config(None, BASE + extra + [f"run.name={name}", f"run.storage={storage}"])
        rt, metrics = FakeRuntime(rank, world), RecordingMetrics()
        checkpointer = Checkpointer(LocalStorage(storage), name, rt.report, every_epochs=cfg.checkpoint.every_epochs,
                                    every_steps=cfg.checkpoint.every_steps)
        trainer = Trainer(cfg, rt, build_parts(cfg, rt), checkpointer, metrics)
        summary = trainer.fit()
        results[name] = {"summary": summary, "evals": list(metrics.evals), "progress": list(metrics.progress),
                         "passes": _passes(trainer.task, world)}
        if name == "three-epochs":  # what one evaluation sends, for a task of means and one of every row
            with CollectiveTraffic(dist) as means_only:
                trainer.evaluate()
            trainer.evaluator.task = RowsTask()
            with CollectiveTraffic(dist) as rows:
                rows_result = trainer.evaluate()
            results["traffic"] = {"means": means_only.sent, "rows": rows.sent, "rows_result": rows_result}
    # `ray-app eval`'s worker side, on the newest checkpoint
    cfg = load_config(None, BASE + ["run.name=three-epochs", f"run.storage={storage}"])
    result, trainer = worker._eval(cfg, FakeRuntime(rank, world), RunStats(),
                                   results["three-epochs"]["summary"]["checkpoint"])
    results["eval"] = {"result": result, "passes": _passes(trainer.task, world)}
    # the driver of `ray-app eval` reads only the config: a damaged model is found here, as bad input
    if rank == 0:
        path = Path(result["checkpoint"]) / "model" / "__0_0.distcp"  # rank 0's share of the model
        data = bytearray(path.read_bytes())
        data[-20] ^= 1
        path.write_bytes(bytes(data))
    dist.barrier()
    try:
        worker._eval(cfg, FakeRuntime(rank, world), RunStats(), result["checkpoint"])
        results["damaged"] = None
    except ConfigError as exc:
        results["damaged"] = str(exc)
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
        assert "failed verification: model/__0_0.distcp does not match its manifest (sha256)" in r["damaged"]  # exit 2, one line


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


@pytest.mark.timeout(180)
def test_evaluation_all_reduces_sums_and_counts_and_gathers_rows_only_for_a_task_that_needs_them(counted):
    world, ranks = counted
    for r in ranks:
        t = r["traffic"]
        # means: no gather; the all_reduce holds per-metric sums and one count, whatever the eval set's size
        assert t["means"]["all_gather"] == 0
        assert t["means"]["all_reduce"] < 500
        # summarize_rows: each rank's rows (index + 2 metrics) are gathered, padding dropped before the hook
        assert t["rows"]["all_gather"] == math.ceil(N_EVAL / world) * 3
        assert t["rows_result"]["eval_rows"] == N_EVAL
        assert t["rows_result"]["eval_accuracy"] == r["three-epochs"]["summary"]["eval_accuracy"]
