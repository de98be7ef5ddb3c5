"""The DDP loop on real gloo process groups (torch.multiprocessing, no Ray).

What a user would notice: eval accuracy that does not depend on the number of
workers, a logged loss that is the true global mean, ranks that agree on the
parameters, a new data order every epoch, and a resumed run that ends exactly
where the uninterrupted one does.
"""

from __future__ import annotations

import inspect
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ray_app.shared.catalog import newest_good, verify
from ray_app.shared.config import load_config
from ray_app.shared.storage import LocalStorage
from ray_app.worker.checkpoint import Checkpointer, cleanup_local
from ray_app.worker.ddp import ExactSums, ResumableDistributedSampler, assert_identical_parameters, gather_eval_rows, global_mean, lr_lambda
from ray_app.worker.loop import Trainer
from ray_app.worker.metrics import NullMetrics
from ray_app.worker.parts import Runtime, build_parts
from ray_app.worker.progress import MetricsSink
from tests.support.evaluation import accuracy_and_loss, default_model_eval
from tests.support.ranks import rank_context
from tests.support.stand_ins import assert_stands_in_for

EVAL_N = 359  # the digits eval set size: divisible by neither 2 nor 3


# ---------------------------------------------------------------- helpers run in every spawned rank

def _init(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)  # 2 shared cores: no oversubscription
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))


def _finish() -> None:
    dist.barrier()
    dist.destroy_process_group()


def _entry(rank: int, fn, world: int, *args) -> None:
    fn(rank, world, *args)
    # Skip interpreter teardown: after a gloo group, torch 2.14's C++ static destructors
    # sometimes abort ("terminate called without an active exception", no Python frame;
    # 1 run in 30-50 here, after both ranks had returned and written their results).
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


def _spawn(fn, world: int, *args, start_method: str = "forkserver") -> None:
    """``world`` rank processes running ``fn(rank, world, *args)``; forked from a server that imported torch and
    the kit once (tests/support/ranks.py), or ``spawn``ed for ranks that read a variable at process start."""
    rank_context(start_method)
    mp.start_processes(_entry, args=(fn, world, *args), nprocs=world, join=True, start_method=start_method)


def eval_table(n: int = EVAL_N, classes: int = 10):
    """An eval set whose 'model' is the identity: each sample is its own logits row."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(n, classes, generator=g) * 3
    targets = torch.randint(0, classes, (n,), generator=g)
    return logits, targets


def hard_values(n: int = EVAL_N) -> torch.Tensor:
    """Values whose float64 sum depends on the order it is taken in: both signs, magnitudes 1e-12..1e12,
    a subnormal."""
    g = torch.Generator().manual_seed(5)
    v = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-12, 13, (n,), generator=g)
    v[7] = 5e-324
    return v


UNEQUAL = {0: 3, 1: 10, 2: 1}  # samples per rank for the global-mean check


def rank_losses(rank: int) -> torch.Tensor:
    return torch.rand(UNEQUAL[rank], generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64) * 4


def _collectives_worker(rank: int, world: int, port: int, out: str) -> None:
    _init(rank, world, port)
    result = {}
    # practice 5: exact eval through the padded DistributedSampler
    logits, targets = eval_table()
    ds = TensorDataset(logits, targets, torch.arange(EVAL_N))
    sampler = DistributedSampler(ds, world, rank, shuffle=False, drop_last=False)
    idx_seen, preds, tgts, losses = [], [], [], []
    for x, y, i in DataLoader(ds, batch_size=16, sampler=sampler):
        idx_seen.append(i)
        preds.append(x.argmax(1))
        tgts.append(y)
        losses.append(F.cross_entropy(x, y, reduction="none"))
    local_idx = torch.tensor(list(iter(sampler)))
    assert torch.equal(local_idx, torch.cat(idx_seen))  # the order the loop assumes
    columns = torch.stack([torch.cat(preds).double(), torch.cat(tgts).double(), torch.cat(losses).double()], dim=1)
    idx, rows = gather_eval_rows(local_idx, columns, world)
    p, t, loss = rows[:, 0], rows[:, 1], rows[:, 2]
    result["eval"] = {"indices": idx.tolist(), "accuracy": (p == t).double().mean().item(),
                      "loss": loss.mean().item(), "num_samples": int(idx.numel()),
                      "padded_count": len(local_idx) * world}
    # practice 5 without gathering: masked, exact sums of every rank's values, one all_reduce
    values = torch.stack([F.cross_entropy(logits, targets, reduction="none").double(), hard_values()], dim=1)
    keep = torch.arange(len(local_idx)) * world + rank < EVAL_N  # = build_parts' eval_set.keep
    sums = ExactSums(2, torch.device("cpu"))
    for start in range(0, len(local_idx), 16):  # batch by batch, as the loop adds them
        sums.add(values[local_idx[start:start + 16]], keep[start:start + 16])
    sums.all_reduce()
    result["reduced"] = {"means": sums.means(), "num_samples": sums.num_samples()}
    # practice 4: sample-weighted global mean of unequal per-rank sums
    mine = rank_losses(rank)
    result["global_mean"] = global_mean(mine.sum(), torch.tensor(float(len(mine))))
    # practice 1: DDP makes differently initialized replicas identical; the check notices when they differ
    torch.manual_seed(rank)  # deliberately different init per rank
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    try:
        assert_identical_parameters(model)
        result["raised_without_ddp"] = False
    except RuntimeError:
        result["raised_without_ddp"] = True
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    assert_identical_parameters(ddp)  # raises if DDP's broadcast did not happen
    result["params_after_ddp"] = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    del ddp  # its reducer holds the process group
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    _finish()


# ---------------------------------------------------------------- fakes for the Trainer

class SimulatedCrash(RuntimeError):
    """Raised on every rank right after a chosen checkpoint is committed (a worker group dying)."""


class FakeRuntime:
    """What RayRuntime gives the loop: topology, DDP wrapping, a report that is a barrier.

    ``async_upload``: like Ray Train's async mode, uploads run one at a time on a background
    thread while training goes on; the simulated crash then comes at the report *after*
    checkpoint ``crash_after`` (that newer checkpoint never gets uploaded), so the one
    resumed from was copied and uploaded while training continued.
    """

    def __init__(self, rank: int, world_size: int, crash_after_checkpoint: int | None = None,
                 async_upload: bool = False):
        self.rank, self.world_size, self.device = rank, world_size, torch.device("cpu")
        self.crash_after = crash_after_checkpoint
        self.calls: list[tuple[str, int | None]] = []
        self.checkpoint_names: list[tuple[str, str]] = []  # (dir_name, metrics["checkpoint"]) of each checkpoint report
        self.pool = ThreadPoolExecutor(max_workers=1) if async_upload else None
        self.uploads = []

    def prepare_model(self, model, bucket_cap_mb: int = 25):
        return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)

    def drain(self) -> None:
        for fut in self.uploads:
            fut.result()

    def report(self, metrics: dict, local_dir=None, dir_name=None, upload=None) -> None:
        kind = "checkpoint" if dir_name else "metrics"
        self.calls.append((kind, metrics.get("global_step")))
        if dir_name:
            self.checkpoint_names.append((dir_name, metrics["checkpoint"]))
        checkpoints = sum(1 for k, _ in self.calls if k == "checkpoint")
        if self.pool is not None and kind == "checkpoint" and self.crash_after is not None \
                and checkpoints == self.crash_after + 1:
            self.drain()  # the earlier uploads finished; this one dies with the worker
            dist.barrier()
            raise SimulatedCrash(f"stopped at checkpoint {checkpoints}, before its upload")
        if local_dir is not None:  # only the writer rank has a local checkpoint
            def job():
                upload(Path(local_dir), dir_name)
                cleanup_local(Path(local_dir))
            if self.pool is not None:
                self.uploads.append(self.pool.submit(job))
            else:
                job()
        dist.barrier()  # like ray.train.report: every rank waits for the commit
        if self.pool is None and kind == "checkpoint" and checkpoints == self.crash_after:
            raise SimulatedCrash(f"stopped after checkpoint {checkpoints}")


class RecordingMetrics:
    """A metrics sink that remembers what the loop told it."""

    def __init__(self):
        self.progress, self.evals, self.paces, self.started = [], [], [], None

    def start(self, **info):
        self.started = info

    def on_step(self, step_seconds): ...

    def on_progress(self, **kw):
        self.progress.append(kw)

    def on_eval(self, values):
        self.evals.append(values)

    def on_checkpoint(self, **kw): ...

    def on_gpu_memory(self, **kw): ...

    def on_rank_pace(self, rows):
        self.paces.append(rows)

    def checkpoint_state(self):
        return {}

    def close(self): ...


BASE = ["data.name=digits", "model.name=digits_cnn", "data.batch_size=32", "train.epochs=2",
        "train.warmup_epochs=0.5", "train.log_every_steps=7", "metrics.enabled=false", "checkpoint.keep=10"]
NO_CKPT = ["checkpoint.every_epochs=0", "checkpoint.every_steps=0"]
ACCUM2 = ["train.grad_accum=2", "train.clip_grad_norm=1.0"]

# name -> (overrides, crash after checkpoint number, reference run)
# digits: 1438 train samples -> 719 per rank -> 23 batches per epoch (12 optimizer steps with grad_accum=2)
REFERENCES = {"ref-accum1": NO_CKPT, "ref-accum2": NO_CKPT + ACCUM2}
INTERRUPTED = {
    # checkpoints at steps 5, 10 (crash: epoch 0, batch 10)
    "mid-epoch": (["checkpoint.every_steps=5", "checkpoint.every_epochs=1"], 2, "ref-accum1", 10),
    # steps 5, 10, 15, 20, epoch end 23, 25 (crash: epoch 1, batch 2)
    "mid-second-epoch": (["checkpoint.every_steps=5", "checkpoint.every_epochs=1"], 6, "ref-accum1", 25),
    "epoch-boundary": (["checkpoint.every_steps=0", "checkpoint.every_epochs=1"], 1, "ref-accum1", 23),
    # steps 4, 8 (crash: epoch 0, batch 16 of 23)
    "accum2-mid-epoch": (["checkpoint.every_steps=4", "checkpoint.every_epochs=1"] + ACCUM2, 2, "ref-accum2", 8),
    "accum2-epoch-boundary": (["checkpoint.every_steps=0", "checkpoint.every_epochs=1"] + ACCUM2, 1,
                              "ref-accum2", 12),
    # async: resumed from step 10, whose state was copied and uploaded while steps 11-15 ran
    # (the crash comes at checkpoint 3, step 15, before its upload)
    "async-mid-epoch": (["checkpoint.every_steps=5", "checkpoint.every_epochs=1", "checkpoint.upload=async"], 2,
                        "ref-accum1", 10),
    # async across an epoch end: checkpoint at step 23 (epoch end), crash at step 25 before its upload
    "async-epoch-boundary": (["checkpoint.every_steps=5", "checkpoint.every_epochs=1", "checkpoint.upload=async"], 5,
                             "ref-accum1", 23),
}


def _fit(rank: int, world: int, cfg, crash_after=None):
    storage = LocalStorage(cfg.run.storage)
    staged = cfg.checkpoint.upload == "async"
    rt = FakeRuntime(rank, world, crash_after, async_upload=staged)
    metrics = RecordingMetrics()
    checkpointer = Checkpointer(storage, cfg.run.name, rt.report, every_epochs=cfg.checkpoint.every_epochs,
                                every_steps=cfg.checkpoint.every_steps, warn=print, staged=staged)
    trainer = Trainer(cfg, rt, build_parts(cfg, rt), checkpointer, metrics)
    epoch_losses = []  # each epoch's train loss, as its "epoch N done" line says it
    said = trainer.progress.epoch_train_loss
    trainer.progress.epoch_train_loss = lambda **kw: epoch_losses.append(said(**kw)) or epoch_losses[-1]
    try:
        summary = trainer.fit()
        rt.drain()  # Ray Train waits for pending uploads when the train function returns
    except SimulatedCrash:
        summary = None
    return {"summary": summary, "calls": rt.calls, "checkpoint_names": rt.checkpoint_names,
            "resumed_from_step": trainer.resumed_from_step,
            "params": {k: v.clone() for k, v in trainer.module.state_dict().items()},
            "progress": metrics.progress, "evals": metrics.evals, "last_step_shown": trainer.progress.total_steps,
            "epoch_losses": epoch_losses}


def _trainer_worker(rank: int, world: int, port: int, out: str, storage: str) -> None:
    _init(rank, world, port)
    results = {}
    for name, overrides in REFERENCES.items():
        cfg = load_config(None, BASE + overrides + [f"run.name={name}", f"run.storage={storage}"])
        results[name] = _fit(rank, world, cfg)
    for name, (overrides, crash_after, _, _) in INTERRUPTED.items():
        cfg = load_config(None, BASE + overrides + [f"run.name={name}", f"run.storage={storage}"])
        crashed = _fit(rank, world, cfg, crash_after)
        resumed = _fit(rank, world, cfg)  # a new worker group: same config, same run name
        results[name] = {"crashed": crashed, "resumed": resumed}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    _finish()


def _load_ranks(out: Path, world: int) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world)]


def _same_params(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- collectives (2 and 3 ranks)

@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def collectives(request, tmp_path_factory, port_picker):
    world = request.param
    out = tmp_path_factory.mktemp(f"collectives{world}")
    _spawn(_collectives_worker, world, port_picker(), str(out))
    return world, _load_ranks(out, world)


def test_eval_accuracy_and_loss_equal_single_process_exactly(collectives):
    world, ranks = collectives
    acc, loss = accuracy_and_loss(*eval_table())
    for r in ranks:  # every rank computes the same global metric
        ev = r["eval"]
        assert ev["num_samples"] == EVAL_N
        assert sorted(ev["indices"]) == list(range(EVAL_N))
        assert ev["accuracy"] == acc
        assert ev["loss"] == loss
        assert ev["padded_count"] > EVAL_N  # the sampler did pad: duplicates were really removed


@pytest.mark.timeout(120)
def test_reduced_eval_means_equal_a_single_process_fsum_exactly(collectives):
    """Masked sums and counts, all-reduced, at 2 and 3 ranks: padding excluded, and the mean of values whose
    naive float sum depends on their order equals math.fsum(values) / n of one process, bit for bit."""
    world, ranks = collectives
    logits, targets = eval_table()
    losses = F.cross_entropy(logits, targets, reduction="none").double().tolist()
    hard = hard_values().tolist()
    assert math.fsum(hard) != sum(hard) or math.fsum(hard[::-1]) != sum(hard[::-1])  # the order matters here
    for r in ranks:
        assert r["reduced"]["num_samples"] == EVAL_N
        assert r["reduced"]["means"] == [math.fsum(losses) / EVAL_N, math.fsum(hard) / EVAL_N]


def test_global_mean_is_sample_weighted(collectives):
    world, ranks = collectives
    all_losses = torch.cat([rank_losses(r) for r in range(world)])
    expected = all_losses.sum().item() / len(all_losses)
    unweighted = sum(rank_losses(r).mean().item() for r in range(world)) / world
    for r in ranks:
        assert r["global_mean"] == pytest.approx(expected, rel=1e-12, abs=0)
        assert r["global_mean"] != pytest.approx(unweighted, rel=1e-3)


def _protocol_methods(protocol) -> dict:
    return {name: inspect.signature(getattr(protocol, name)) for name in dir(protocol)
            if not name.startswith("_") and callable(getattr(protocol, name))}


@pytest.mark.parametrize("protocol, implementations", [
    (Runtime, ("ray_app.worker.entry:RayRuntime", "tests.unit.test_loop_ddp:FakeRuntime")),
    (MetricsSink, ("ray_app.worker.metrics:NullMetrics", "ray_app.worker.metrics:PrometheusMetrics",
                   "ray_app.worker.tracking:FanOutSink", "ray_app.worker.tracking:MlflowSink", "ray_app.worker.tracking:TensorBoardSink",
                   "ray_app.shared.journal:JournalSink",
                   "tests.unit.test_loop_ddp:RecordingMetrics")),
], ids=["Runtime", "MetricsSink"])
def test_real_objects_and_test_fakes_satisfy_the_loops_protocols(protocol, implementations):
    import importlib

    wanted = _protocol_methods(protocol)
    assert wanted
    for path in implementations:
        module, _, name = path.partition(":")
        cls = getattr(importlib.import_module(module), name)
        for method, sig in wanted.items():
            assert callable(getattr(cls, method, None)), f"{path} has no {method}"
            have = inspect.signature(getattr(cls, method))
            # the parameters the loop passes (names and kinds) are accepted
            for p in list(sig.parameters.values())[1:]:
                if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                    continue
                params = have.parameters
                assert p.name in params or any(q.kind is q.VAR_KEYWORD for q in params.values()), \
                    f"{path}.{method} does not take {p.name}"



def test_the_recording_metrics_sink_is_called_as_the_null_sink():
    assert_stands_in_for(RecordingMetrics, NullMetrics)

def test_identical_parameters_check(collectives):
    world, ranks = collectives
    assert all(r["raised_without_ddp"] for r in ranks)
    torch.manual_seed(0)  # rank 0's init is what every rank holds after wrapping
    rank0_init = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).state_dict()
    for r in ranks:
        assert _same_params(r["params_after_ddp"], rank0_init)


# ---------------------------------------------------------------- sampler and LR schedule (no process group)

def test_sampler_shards_are_disjoint_and_cover_the_data():
    n, world = 100, 3
    shards = [list(ResumableDistributedSampler(range(n), world, r, shuffle=True, seed=0)) for r in range(world)]
    assert all(len(s) == 34 for s in shards)  # 100 -> 3 x 34 with 2 padded repeats
    assert set().union(*shards) == set(range(n))
    flat = sum(shards, [])
    assert len(flat) - len(set(flat)) == 2
    even = [set(ResumableDistributedSampler(range(90), world, r, shuffle=True, seed=0)) for r in range(world)]
    assert all(not (even[a] & even[b]) for a in range(world) for b in range(a + 1, world))


def test_set_epoch_changes_the_order_deterministically():
    s = ResumableDistributedSampler(range(200), 2, 0, shuffle=True, seed=5)
    s.set_epoch(0)
    e0 = list(s)
    s.set_epoch(1)
    e1 = list(s)
    s.set_epoch(0)
    assert e0 != e1 and list(s) == e0
    other = ResumableDistributedSampler(range(200), 2, 0, shuffle=True, seed=5)
    other.set_epoch(1)
    assert list(other) == e1  # another process (a resumed worker) gets the same order


@pytest.mark.parametrize("k", [0, 1, 3, 6, 7])
def test_set_start_yields_the_tail_of_distributed_samplers_epoch(k):
    batch, world = 8, 2
    s = ResumableDistributedSampler(range(103), world, 1, shuffle=True, seed=3)
    s.set_epoch(4)
    full = list(s)
    torchs = DistributedSampler(range(103), world, 1, shuffle=True, seed=3)
    torchs.set_epoch(4)
    assert full == list(torchs)  # at the start: torch's own order, padding included
    s.set_start(k * batch * world)  # k batches read on every rank
    tail = list(s)
    assert tail == full[k * batch:]
    assert len(s) == len(tail)
    loader_batches = list(DataLoader(list(range(103)), batch_size=batch, sampler=s))
    assert [x.tolist() for x in loader_batches] == [full[i:i + batch] for i in range(k * batch, len(full), batch)]


@pytest.mark.parametrize(("n", "old", "new", "k"), [(103, 2, 3, 4), (103, 3, 2, 2), (96, 4, 1, 5), (50, 1, 4, 3)])
def test_a_resume_at_another_world_size_reads_the_rest_of_the_epoch_once(n, old, new, k):
    """k batches of 4 read on each of ``old`` ranks, then the epoch goes on over ``new``: every sample not
    yet read is read once, and what is read twice is no more than padding (as DistributedSampler pads:
    fewer than ``new`` samples at the epoch's end, and fewer than ``new`` again for the re-dealt rest)."""
    batch = 4
    before = [ResumableDistributedSampler(range(n), old, r, shuffle=True, seed=7) for r in range(old)]
    for sampler in before:
        sampler.set_epoch(2)
    read = [i for sampler in before for i in list(sampler)[:k * batch]]
    after = [ResumableDistributedSampler(range(n), new, r, shuffle=True, seed=7) for r in range(new)]
    rest = []
    for sampler in after:
        sampler.set_epoch(2)
        sampler.set_start(k * batch * old)
        rest.append(list(sampler))
        assert len(sampler) == len(rest[-1])
    assert len({len(r) for r in rest}) == 1  # every rank the same number of batches: collectives stay matched
    flat = [i for r in rest for i in r]
    assert len(set(read)) == len(read) and set(read) | set(flat) == set(range(n))
    assert set(range(n)) - set(read) <= set(flat)  # nothing left out
    padding = len(flat) - (n - len(read))
    assert 0 <= padding < 2 * new, padding  # nothing else read twice


def test_lr_warmup_then_cosine():
    f = lr_lambda(4, 20)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0
    assert f(12) == pytest.approx(0.5)
    assert f(20) == pytest.approx(0.0, abs=1e-12) and f(30) == pytest.approx(0.0, abs=1e-12)
    decay = [f(s) for s in range(4, 21)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    g = lr_lambda(0, 10)
    assert g(0) == 1.0 and g(5) == pytest.approx(0.5) and g(10) == pytest.approx(0.0, abs=1e-12)
    assert g(3) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.3)))


# ---------------------------------------------------------------- the Trainer: 2 ranks, stop and resume

@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory, port_picker):
    out = tmp_path_factory.mktemp("trainer")
    storage = out / "runs"
    _spawn(_trainer_worker, 2, port_picker(), str(out), str(storage))
    return _load_ranks(out, 2), LocalStorage(str(storage))


def test_ranks_agree_on_parameters_at_the_end(trainer_runs):
    ranks, _ = trainer_runs
    for name in REFERENCES:
        assert _same_params(ranks[0][name]["params"], ranks[1][name]["params"])
    for name in INTERRUPTED:
        assert _same_params(ranks[0][name]["resumed"]["params"], ranks[1][name]["resumed"]["params"])


def test_training_learns_digits_and_reports_the_summary(trainer_runs):
    ranks, _ = trainer_runs
    s = ranks[0]["ref-accum1"]["summary"]
    assert s["global_step"] == 46 and s["epochs"] == 2 and s["resumed_from_step"] == 0
    assert s["eval_accuracy"] > 0.5 and s["num_samples"] == EVAL_N
    assert math.isfinite(s["train_loss"])
    assert ranks[0]["ref-accum2"]["summary"]["global_step"] == 24
    # logged losses are global: every rank logs the same value at the same step
    losses0 = [p["train_loss"] for p in ranks[0]["ref-accum1"]["progress"]]
    losses1 = [p["train_loss"] for p in ranks[1]["ref-accum1"]["progress"]]
    assert losses0 and losses0 == losses1


def test_trainer_eval_matches_a_single_process_evaluation(trainer_runs):
    ranks, _ = trainer_runs
    s = ranks[0]["ref-accum1"]["summary"]
    acc, loss = default_model_eval(ranks[0]["ref-accum1"]["params"])
    assert s["eval_accuracy"] == acc
    assert s["eval_loss"] == pytest.approx(loss, rel=1e-5)  # batch composition moves the last float bits


def test_every_rank_reports_the_same_number_of_times(trainer_runs):
    ranks, _ = trainer_runs
    for name in REFERENCES:
        assert ranks[0][name]["calls"] == ranks[1][name]["calls"]
        assert len(ranks[0][name]["calls"]) == 2  # one per epoch, the last epoch's with the run's end
    for name in INTERRUPTED:
        for phase in ("crashed", "resumed"):
            assert ranks[0][name][phase]["calls"] == ranks[1][name][phase]["calls"]


def test_every_rank_reports_the_writers_checkpoint_directory(trainer_runs):
    """Ray Train takes one checkpoint per report from all ranks: each rank names the directory rank 0 writes."""
    ranks, storage = trainer_runs
    for name in INTERRUPTED:
        for phase in ("crashed", "resumed"):
            names = ranks[0][name][phase]["checkpoint_names"]
            assert names and names == ranks[1][name][phase]["checkpoint_names"], (name, phase)
            assert all(uri == storage.uri(name, d) for d, uri in names)
        for d, _ in ranks[0][name]["resumed"]["checkpoint_names"]:  # every one of them uploaded and committed
            assert verify(storage, f"{name}/{d}").ok, (name, d)


@pytest.mark.parametrize("name", list(INTERRUPTED))
def test_resumed_run_is_bit_identical_to_the_uninterrupted_one(trainer_runs, name):
    ranks, storage = trainer_runs
    _, crash_after, reference, step = INTERRUPTED[name]
    crashed, resumed, ref = ranks[0][name]["crashed"], ranks[0][name]["resumed"], ranks[0][reference]
    assert crashed["summary"] is None
    staged = name.startswith("async")
    assert [k for k, _ in crashed["calls"]].count("checkpoint") == crash_after + staged
    assert (crashed["calls"][-1 - staged]) == ("checkpoint", step)
    assert resumed["resumed_from_step"] == step
    assert resumed["summary"]["resumed_from_step"] == step
    assert resumed["summary"]["global_step"] == ref["summary"]["global_step"]
    assert not _same_params(crashed["params"], ref["params"])  # the crash really stopped it early
    for key, tensor in ref["params"].items():
        assert torch.equal(resumed["params"][key], tensor), key
    assert resumed["summary"]["eval_accuracy"] == ref["summary"]["eval_accuracy"]
    assert resumed["summary"]["eval_loss"] == ref["summary"]["eval_loss"]
    # each epoch's train loss (its line, the summary's for the last) is over all of its steps, those before the
    # crash too: their global sums came with the checkpoint, the steps re-done after it counted once. The sums
    # are float64 sums of the same float32 terms (loss x samples), cut at the checkpoint: equal to float64
    # precision (in practice to the bit; the sum then divided once), far inside 1e-9
    ended = len(resumed["epoch_losses"])
    assert ended and resumed["epoch_losses"] == pytest.approx(ref["epoch_losses"][-ended:], rel=1e-9, abs=0)
    assert resumed["summary"]["train_loss"] == pytest.approx(ref["summary"]["train_loss"], rel=1e-9, abs=0)
    # the run ends on a committed checkpoint of the final step
    newest = newest_good(storage, name).name
    assert newest is not None and int(newest[len("ckpt-s"):].split("-")[0]) == ref["summary"]["global_step"]
    assert resumed["summary"]["checkpoint"] == storage.uri(name, newest)
    assert resumed["summary"]["checkpoints_written"] >= 1 and resumed["summary"]["checkpoint_blocked_seconds"] > 0


# ---------------------------------------------------------------- any batch structure, a collate_fn of the data's

class _Records(torch.utils.data.Dataset):
    """Items are dicts holding a tensor and a tuple; the data's own collate_fn nests them further."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(n)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "extra": (self.y[i], i)}


def collate_records(items):
    return {"inputs": {"x": torch.stack([it["x"] for it in items])},
            "target": [torch.stack([it["extra"][0] for it in items])], "ids": [it["extra"][1] for it in items]}


def nested_data():
    """A data plug-in handing over its collate_fn in info (used by name: tests.unit.test_loop_ddp:nested_data)."""
    return _Records(40), _Records(13), {"num_features": 4, "collate_fn": collate_records}


class NestedTask:
    """Checks what reaches it: the collated structure, tensors on the runtime's device."""

    def __init__(self):
        self.batches = 0

    def _split(self, model, batch):
        assert set(batch) == {"inputs", "target", "ids"} and isinstance(batch["ids"], list)
        x, (y,) = batch["inputs"]["x"], batch["target"]
        assert x.device.type == y.device.type == "cpu" and x.shape[1] == 4
        self.batches += 1
        return model(x), y

    def loss(self, model, batch):
        logits, y = self._split(model, batch)
        return F.cross_entropy(logits, y), len(y)

    def evaluate(self, model, batch):
        logits, y = self._split(model, batch)
        return {"hits": (logits.argmax(1) == y).double()}


def _nested_worker(rank: int, world: int, port: int, out: str) -> None:
    _init(rank, world, port)
    cfg = load_config(None, ["data.name=tests.unit.test_loop_ddp:nested_data", "data.batch_size=4",
                             "model.name=torch.nn:Linear", "model.args={in_features: 4, out_features: 2}",
                             "task.name=tests.unit.test_loop_ddp:NestedTask", "train.epochs=1", "metrics.enabled=false"]
                      + NO_CKPT + [f"run.storage={out}"])
    rt = FakeRuntime(rank, world)
    parts = build_parts(cfg, rt)
    checkpointer = Checkpointer(LocalStorage(cfg.run.storage), cfg.run.name, rt.report, every_epochs=0, every_steps=0)
    summary = Trainer(cfg, rt, parts, checkpointer, RecordingMetrics()).fit()
    torch.save({"summary": summary, "collate": parts.train_loader.collate_fn.__name__ == "collate_records",
                "batches": parts.task.batches}, os.path.join(out, f"rank{rank}.pt"))
    _finish()


def test_nested_batches_and_the_datas_collate_fn_reach_the_task(tmp_path, port_picker):
    _spawn(_nested_worker, 2, port_picker(), str(tmp_path))
    ranks = _load_ranks(tmp_path, 2)
    assert all(r["collate"] for r in ranks)
    # 20 train samples per rank in batches of 4 (5 steps), eval 7 per rank (13 padded to 14) in 2 batches,
    # once: the epoch's end is also the run's
    assert [r["batches"] for r in ranks] == [5 + 2] * 2
    assert ranks[0]["summary"]["num_samples"] == 13 and 0 <= ranks[0]["summary"]["eval_hits"] <= 1


def test_to_device_moves_every_tensor_of_any_structure():
    from collections import namedtuple

    from ray_app.worker.ddp import first_dim, to_device

    Pair = namedtuple("Pair", "a b")
    batch = {"x": torch.zeros(3, 2), "rest": [Pair(torch.ones(3), "label"), (torch.arange(3), 7)]}
    moved = to_device(batch, torch.device("meta"))
    assert moved["x"].device.type == "meta" and isinstance(moved["rest"][0], Pair)
    assert moved["rest"][0].a.device.type == "meta" and moved["rest"][0].b == "label"
    assert moved["rest"][1][0].device.type == "meta" and moved["rest"][1][1] == 7
    assert first_dim(batch) == 3 and first_dim([("no tensors",)]) == 0


class _RecordingLambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR that records which private attributes are set on it (from outside or by itself) once built."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.__dict__["private_writes"] = []

    def __setattr__(self, name, value):
        if "private_writes" in self.__dict__ and name.startswith("_"):
            self.private_writes.append(name)
        super().__setattr__(name, value)


@pytest.mark.timeout(30)
def test_resumed_hyperparameters_are_set_through_public_attributes_only():
    from ray_app.worker.resume import apply_hyperparameters

    cfg = load_config(None, ["train.lr=0.2", "train.optimizer=sgd", "train.momentum=0.5", "train.weight_decay=0.01"])
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = _RecordingLambdaLR(optimizer, lr_lambda(2, 10))
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    scheduler.private_writes.clear()  # the scheduler's own steps write its private state
    apply_hyperparameters(cfg, optimizer, scheduler)
    assert scheduler.private_writes == []
    group = optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(0.2 * lr_lambda(2, 10)(4))
    assert (group["momentum"], group["weight_decay"], scheduler.base_lrs) == (0.5, 0.01, [0.2])
    optimizer.step()
    scheduler.step()  # the schedule goes on from the config's LR
    assert scheduler.get_last_lr() == [group["lr"]] == [pytest.approx(0.2 * lr_lambda(2, 10)(5))]
