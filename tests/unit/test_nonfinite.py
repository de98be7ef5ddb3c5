"""Divergence on a real gloo group of 2 ranks: ``train.nonfinite`` stop / skip / ignore.

Rank 1 alone sees a non-finite loss at one step (``loss + inf``: its gradients stay finite, so only the
kit's own check can notice it), and rank 0 must act at the same step. What a user would notice: ``stop``
ends every rank at that step with one line naming the newest good checkpoint, which is finite and
resumes; ``skip`` drops exactly that step and counts it; no checkpoint with non-finite parameters is
committed (``ignore`` with parameters that become NaN).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

from ray_app.shared.catalog import list_checkpoints
from ray_app.shared.config import load_config
from ray_app.shared.errors import Diverged
from ray_app.shared.storage import LocalStorage
from ray_app.shared.tasks import Classification
from ray_app.worker.checkpoint import Checkpointer, load_uri
from ray_app.worker.loop import Trainer
from ray_app.worker.parts import build_parts
from tests.unit.test_loop_counts import BATCH
from tests.unit.test_loop_ddp import FakeRuntime, RecordingMetrics, _finish, _init, _load_ranks, _spawn

BAD_STEP = 5  # 48 samples / 2 ranks / batch 4 = 6 steps per epoch; checkpoints every 2 steps


class DivergingTask(Classification):
    """Classification whose loss on rank 1 is ``loss + inf`` (or ``loss * inf``) at optimizer step BAD_STEP."""

    def __init__(self, how: str = "add", at: int = BAD_STEP):
        super().__init__()
        self.how, self.at, self.calls = how, at, 0

    def loss(self, model, batch):
        mean, n = super().loss(model, batch)
        self.calls += 1
        if self.at and self.calls == self.at and dist.get_rank() == 1:
            mean = mean + math.inf if self.how == "add" else mean * math.inf
        return mean, n


BASE = ["data.name=tests.unit.test_loop_counts:tiny_data", "model.name=torch.nn:Linear",
        "model.args={in_features: 4, out_features: 2}", f"data.batch_size={BATCH}", "train.epochs=2",
        "metrics.enabled=false", "train.warmup_epochs=0", "checkpoint.every_steps=2", "train.log_every_steps=1"]


def _trainer(storage: str, name: str, rank: int, mode: str, task: DivergingTask, resume: bool = False):
    cfg = load_config(None, BASE + [f"run.name={name}", f"run.storage={storage}", f"train.nonfinite={mode}"])
    rt = FakeRuntime(rank, 2)
    ckpt = Checkpointer(LocalStorage(storage), name, rt.report, every_epochs=0, every_steps=2)
    parts = build_parts(cfg, rt)
    parts.task = task
    trainer = Trainer(cfg, rt, parts, ckpt, RecordingMetrics())
    trainer.task = task
    return trainer


def _nonfinite_worker(rank: int, world: int, port: int, out: str, storage: str) -> None:
    _init(rank, world, port)
    results = {}
    # stop: both ranks raise at BAD_STEP, naming the newest good checkpoint; that one resumes to the end
    try:
        _trainer(storage, "stop", rank, "stop", DivergingTask()).fit()
        results["stop"] = None
    except Diverged as exc:
        results["stop"] = str(exc)
    dist.barrier()
    results["stop_checkpoints"] = [n for n in list_checkpoints(LocalStorage(storage), "stop")]
    resumed = _trainer(storage, "stop", rank, "stop", DivergingTask(at=0))
    results["stop_resumed"] = resumed.fit()
    # skip: exactly that step dropped on every rank, counted
    skip = _trainer(storage, "skip", rank, "skip", DivergingTask())
    results["skip"] = skip.fit()
    results["skip_params_finite"] = all(bool(torch.isfinite(p).all()) for p in skip.module.parameters())
    # ignore, gradients that become inf: the parameters go NaN and no checkpoint of them is committed
    ignore = _trainer(storage, "ignore", rank, "ignore", DivergingTask(how="mul"))
    results["ignore"] = ignore.fit()
    dist.barrier()
    results["ignore_checkpoints"] = [n for n in list_checkpoints(LocalStorage(storage), "ignore")]
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    _finish()


@pytest.fixture(scope="module")
def diverged(tmp_path_factory, port_picker):
    out = tmp_path_factory.mktemp("nonfinite")
    _spawn(_nonfinite_worker, 2, port_picker(), str(out), str(out / "runs"))
    return out / "runs", _load_ranks(out, 2)


def _step(name: str) -> int:
    return int(name.removeprefix("ckpt-s").split("-")[0])


@pytest.mark.timeout(180)
def test_stop_ends_every_rank_at_the_step_naming_a_finite_checkpoint_that_resumes(diverged):
    runs, ranks = diverged
    for r in ranks:  # rank 0's loss was finite: it stopped at the same step as rank 1
        assert r["stop"] is not None and r["stop"].startswith(f"training diverged at step {BAD_STEP}:"), r["stop"]
        assert "\n" not in r["stop"]
    newest = max(ranks[0]["stop_checkpoints"], key=_step)
    assert _step(newest) == BAD_STEP - 1  # every 2 steps: 2, 4; nothing at or after the bad step
    assert newest in ranks[0]["stop"] and newest in ranks[1]["stop"]
    loaded = load_uri(LocalStorage(str(runs)).uri("stop", newest), rank=None, model_only=True)
    assert all(bool(torch.isfinite(t).all()) for t in loaded.model.values())
    for r in ranks:  # the same command resumes from it and trains to the end
        assert r["stop_resumed"]["resumed_from_step"] == BAD_STEP - 1 and r["stop_resumed"]["global_step"] == 12


@pytest.mark.timeout(180)
def test_skip_drops_that_step_on_every_rank_and_counts_it(diverged):
    _, ranks = diverged
    for r in ranks:
        assert r["skip"]["skipped_steps"] == 1 and r["skip"]["global_step"] == 12
        assert math.isfinite(r["skip"]["train_loss"]) and r["skip_params_finite"]


@pytest.mark.timeout(180)
def test_no_checkpoint_with_non_finite_parameters_is_committed(diverged):
    runs, ranks = diverged
    steps = sorted(_step(n) for n in ranks[0]["ignore_checkpoints"])
    assert steps == [2, 4], steps  # NaN from step 5 on: 6, 8, 10, 12 and the final one are not committed
    for name in ranks[0]["ignore_checkpoints"]:
        loaded = load_uri(LocalStorage(str(runs)).uri("ignore", name), rank=None, model_only=True)
        assert all(bool(torch.isfinite(t).all()) for t in loaded.model.values())
