"""FSDP2 (``train.strategy=fsdp``) and the checkpoints every rank writes, on real gloo process groups
(torch.multiprocessing, no Ray).

What a user would notice: an FSDP run stopped mid-epoch resumes and ends bit-identical to the uninterrupted
one (sync and async checkpoints, gradient accumulation and clipping on); one stopped at 2 workers resumes at
3 and one stopped at 3 at 2; a DDP checkpoint continues under FSDP and back; every rank wrote its share;
``checkpoints export`` equals the unsharded parameters; an evaluation of the checkpoint at 1, 2 and 3 workers
equals a single-process evaluation of the export.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from ray_app.shared import catalog
from ray_app.shared.config import load_config
from ray_app.shared.storage import LocalStorage
from ray_app.worker.checkpoint import Checkpointer, CheckpointFiles, load_uri
from ray_app.worker.loop import Trainer
from ray_app.worker.metrics import NullMetrics
from ray_app.worker.parts import build_parts
from tests.support.evaluation import default_model_eval
from tests.unit.test_loop_ddp import ACCUM2, BASE, NO_CKPT, FakeRuntime, RecordingMetrics, SimulatedCrash, _finish, _init, _spawn

pytestmark = pytest.mark.timeout(300)

FSDP = ["train.strategy=fsdp"] + ACCUM2  # accumulation (no gradient sync on the first micro-step) and clipping
EVERY5 = ["checkpoint.every_steps=5", "checkpoint.every_epochs=1"]
# digits: 23 batches per rank per epoch at 2 workers -> 12 optimizer steps per epoch with grad_accum=2
RUNS = {  # name -> (overrides, crash after checkpoint number or None)
    "fsdp-ref": (FSDP + NO_CKPT, None),
    "fsdp-mid": (FSDP + EVERY5, 1),  # crash after step 5, mid-epoch 0
    "fsdp-async": (FSDP + EVERY5 + ["checkpoint.upload=async"], 1),
    "fsdp-async-process": (FSDP + EVERY5 + ["checkpoint.upload=async", "checkpoint.async_writer=process"], 1),
    "ddp-1": (ACCUM2 + ["train.epochs=1"], None),
    # BatchNorm: running statistics every rank moves by its own batch (FSDP syncs no buffer of its own)
    "bn-ref": (FSDP + NO_CKPT + ["model.name=tests.support.unsharded_model:bn_net"], None),
    "bn-mid": (FSDP + EVERY5 + ["model.name=tests.support.unsharded_model:bn_net"], 1),
    "bn-ddp-ref": (ACCUM2 + NO_CKPT + ["model.name=tests.support.unsharded_model:bn_net"], None),
    "bn-ddp-mid": (ACCUM2 + EVERY5 + ["model.name=tests.support.unsharded_model:bn_net"], 1),
    # scalar parameters (FSDP shards none): replicated, their gradients averaged
    "scalar-ref": (FSDP + NO_CKPT + ["model.name=tests.support.unsharded_model:ScalarNet"], None),
    "scalar-mid": (FSDP + EVERY5 + ["model.name=tests.support.unsharded_model:ScalarNet"], 1),
}


def _cfg(storage: str, name: str, overrides: list[str]):
    return load_config(None, BASE + overrides + [f"run.name={name}", f"run.storage={storage}"])


def _full(model) -> dict:
    return {k: v.clone() for k, v in get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()}


def _fit(rank: int, world: int, cfg, crash_after=None) -> dict:
    staged = cfg.checkpoint.upload == "async"
    rt = FakeRuntime(rank, world, crash_after, async_upload=staged)
    metrics = RecordingMetrics()
    ckpt = Checkpointer(LocalStorage(cfg.run.storage), cfg.run.name, rt.report, every_epochs=cfg.checkpoint.every_epochs,
                        every_steps=cfg.checkpoint.every_steps, resume_from=cfg.run.resume_from, warn=print,
                        staged=staged, wait_s=60, writer=cfg.checkpoint.async_writer)
    trainer = Trainer(cfg, rt, build_parts(cfg, rt), ckpt, metrics)
    try:
        summary = trainer.fit()
        rt.drain()
    except SimulatedCrash:
        summary = None
        try:  # a real crash ends the process and its writer; here the next run shares them: let this share end
            ckpt._join_share()
        except Exception:
            pass
    return {"summary": summary, "params": _full(trainer.model), "resumed_from_step": trainer.resumed_from_step,
            "losses": [p["train_loss"] for p in metrics.progress],
            "buffers": {k: b.clone() for k, b in trainer.model.named_buffers()}}  # this rank's own


def _evaluate(rank: int, world: int, cfg, uri: str) -> dict:
    rt = FakeRuntime(rank, world)
    parts = build_parts(cfg, rt)
    load_uri(uri, rank=None, model_only=True).load_into(parts.model)
    return Trainer(cfg, rt, parts, None, NullMetrics()).evaluate()


def _first_worker(rank: int, world: int, port: int, out: str, storage: str) -> None:
    _init(rank, world, port)
    results = {}
    for name, (overrides, crash_after) in RUNS.items():
        cfg = _cfg(storage, name, overrides)
        results[name] = _fit(rank, world, cfg, crash_after)
        if crash_after is not None:
            results[name] = {"crashed": results[name], "resumed": _fit(rank, world, cfg)}
    # a DDP checkpoint continues under FSDP (it trains the second epoch), an FSDP one under DDP (nothing left)
    results["fsdp-from-ddp"] = _fit(rank, world, _cfg(storage, "fsdp-from-ddp", FSDP + ["train.epochs=2",
                                                       f"run.resume_from={storage}/ddp-1"]))
    results["ddp-from-fsdp"] = _fit(rank, world, _cfg(storage, "ddp-from-fsdp", ACCUM2 + [
        f"run.resume_from={storage}/fsdp-mid"]))
    # stopped at 2 workers, resumed at 3 in the next spawn
    results["to3"] = _fit(rank, world, _cfg(storage, "to3", FSDP + EVERY5), crash_after=1)
    results["eval2"] = _evaluate(rank, world, _cfg(storage, "e", FSDP), f"{storage}/fsdp-mid")
    torch.save(results, os.path.join(out, f"first{rank}.pt"))
    _finish()


def _world3_worker(rank: int, world: int, port: int, out: str, storage: str) -> None:
    _init(rank, world, port)
    results = {"to3": _fit(rank, world, _cfg(storage, "to3", FSDP + EVERY5)),
               "to2": _fit(rank, world, _cfg(storage, "to2", FSDP + EVERY5), crash_after=1),
               "eval3": _evaluate(rank, world, _cfg(storage, "e", FSDP), f"{storage}/fsdp-mid")}
    torch.save(results, os.path.join(out, f"world3-{rank}.pt"))
    _finish()


def _single_file_into_fsdp(rank: int, world: int, storage: str) -> dict:
    """A checkpoint of the earlier single-file format (rank 0's model.pt and optimizer.pt, by parameter index)
    loaded into a model sharded over ``world`` ranks, optimizer included."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from ray_app.worker.strategy import FULL, fully_shard_model
    from tests.support.checkpoints import write_checkpoint

    if rank == 0:
        write_checkpoint(os.path.join(storage, "single-file"), 3)
    dist.barrier()
    torch.manual_seed(123)  # other weights than the checkpoint's
    model = fully_shard_model(torch.nn.Linear(5, 4), torch.device("cpu"), world)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    load_uri(os.path.join(storage, "single-file"), rank).load_into(model, optimizer)
    state = get_optimizer_state_dict(model, optimizer, options=FULL)["state"]
    return {"params": _full(model), "momentum": {k: v["momentum_buffer"].clone() for k, v in state.items()}}


def _last_worker(rank: int, world: int, port: int, out: str, storage: str) -> None:
    _init(rank, world, port)
    results = {"eval1": _evaluate(rank, world, _cfg(storage, "e", FSDP), f"{storage}/fsdp-mid")}
    if world == 2:
        results["to2"] = _fit(rank, world, _cfg(storage, "to2", FSDP + EVERY5))
        results["single_file"] = _single_file_into_fsdp(rank, world, storage)
    torch.save(results, os.path.join(out, f"last{world}-{rank}.pt"))
    _finish()


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory, port_picker):
    out = tmp_path_factory.mktemp("fsdp")
    storage = str(out / "runs")
    _spawn(_first_worker, 2, port_picker(), str(out), storage)
    _spawn(_world3_worker, 3, port_picker(), str(out), storage)
    _spawn(_last_worker, 1, port_picker(), str(out), storage)
    _spawn(_last_worker, 2, port_picker(), str(out), storage)
    load = lambda f: torch.load(out / f, weights_only=True)  # noqa: E731
    return {"first": load("first0.pt"), "first1": load("first1.pt"), "world3": load("world3-0.pt"), "last1": load("last1-0.pt"),
            "last2": load("last2-0.pt"), "storage": LocalStorage(storage), "root": storage}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", ["fsdp-mid", "fsdp-async", "fsdp-async-process"])
def test_an_fsdp_run_stopped_mid_epoch_resumes_bit_identical(fsdp_runs, name):
    r, ref = fsdp_runs["first"][name], fsdp_runs["first"]["fsdp-ref"]
    assert r["crashed"]["summary"] is None and r["resumed"]["resumed_from_step"] == 5
    assert not _equal(r["crashed"]["params"], ref["params"])  # the crash stopped it early
    assert r["resumed"]["summary"]["global_step"] == ref["summary"]["global_step"] == 24
    assert _equal(r["resumed"]["params"], ref["params"])
    assert r["resumed"]["summary"]["eval_loss"] == ref["summary"]["eval_loss"]
    assert ref["summary"]["eval_accuracy"] > 0.5


def test_batchnorm_statistics_follow_rank_0_so_a_resume_and_its_evaluation_are_exact(fsdp_runs):
    """As DDP broadcasts rank 0's buffers before a forward, so does the kit under FSDP; under both, before a
    checkpoint (whose writing is dealt over the ranks). Every rank evaluates with rank 0's running statistics,
    a checkpoint holds them whichever rank writes them, and a run resumed mid-epoch ends with the uninterrupted
    run's buffers on every rank and its evaluation, exactly (without: a rank's own copy was written, and
    continued by every rank after a resume)."""
    ranks = [fsdp_runs["first"], fsdp_runs["first1"]]
    for strategy in ("", "ddp-"):  # under DDP: its checkpoints deal the buffers to the ranks to write
        for runs in ranks:
            ref, resumed = runs[f"bn-{strategy}ref"], runs[f"bn-{strategy}mid"]["resumed"]
            assert resumed["resumed_from_step"] == 5 and ref["buffers"]
            assert _equal(resumed["params"], ref["params"]) and _equal(resumed["buffers"], ref["buffers"])
        assert _equal(ranks[0][f"bn-{strategy}ref"]["buffers"], ranks[1][f"bn-{strategy}ref"]["buffers"])
        ref, resumed = ranks[0][f"bn-{strategy}ref"]["summary"], ranks[0][f"bn-{strategy}mid"]["resumed"]["summary"]
        assert {k: v for k, v in resumed.items() if k.startswith("eval_")} == \
            {k: v for k, v in ref.items() if k.startswith("eval_")}, (strategy, resumed, ref)


def test_a_run_with_scalar_parameters_resumes_bit_identical(fsdp_runs):
    ref, r = fsdp_runs["first"]["scalar-ref"], fsdp_runs["first"]["scalar-mid"]
    assert r["resumed"]["resumed_from_step"] == 5 and ref["params"]["temperature"].dim() == 0
    assert not torch.equal(ref["params"]["temperature"], torch.tensor(1.0))  # it learned
    assert _equal(r["resumed"]["params"], ref["params"]), "the resumed run ends elsewhere"
    assert r["resumed"]["summary"]["eval_loss"] == ref["summary"]["eval_loss"]


def test_every_rank_writes_its_share_and_the_manifest_covers_them_all(fsdp_runs):
    storage = fsdp_runs["storage"]
    found = catalog.newest_good(storage, "fsdp-mid")
    files = found.verification.manifest["files"]
    assert found.verification.manifest["format"] == catalog.SHARDED_FORMAT
    for rank in (0, 1):
        assert {f"model/__{rank}_0.distcp", f"optim/__{rank}_0.distcp", f"rng/rank_{rank}.pt",
                f"parts/rank_{rank}.json"} <= files.keys()
    assert "model.pt" not in files  # no rank wrote the whole model
    share = [files[f"model/__{r}_0.distcp"]["bytes"] for r in (0, 1)]
    assert min(share) > 0.3 * sum(share)  # each rank holds about half of the sharded parameters


def test_a_ddp_checkpoint_continues_under_fsdp_and_back(fsdp_runs):
    first = fsdp_runs["first"]
    from_ddp = first["fsdp-from-ddp"]
    assert from_ddp["resumed_from_step"] == 12 and from_ddp["summary"]["global_step"] == 24
    assert from_ddp["summary"]["eval_accuracy"] > 0.5
    back = first["ddp-from-fsdp"]  # the FSDP run's final checkpoint: nothing left to train, its parameters
    assert back["resumed_from_step"] == 24 and _equal(back["params"], first["fsdp-mid"]["resumed"]["params"])


def test_an_fsdp_run_stopped_at_2_workers_resumes_at_3_and_one_stopped_at_3_at_2(fsdp_runs):
    stopped, resumed = fsdp_runs["first"]["to3"], fsdp_runs["world3"]["to3"]
    assert stopped["summary"] is None and resumed["resumed_from_step"] == 5
    # the rest of epoch 0 (5 steps of 2 batches of 32 at 2 ranks read: 640 of DistributedSampler's 1440 at 3)
    # dealt out over 3 ranks, then a whole epoch at 3: the optimizer steps each part takes, grad_accum=2
    rest = math.ceil(math.ceil((1440 - 5 * 2 * 32 * 2) / 3) / 32)
    whole = math.ceil(math.ceil(1438 / 3) / 32)
    assert resumed["summary"]["global_step"] == 5 + math.ceil(rest / 2) + math.ceil(whole / 2), resumed["summary"]
    assert resumed["summary"]["epochs"] == 2 and resumed["summary"]["eval_accuracy"] > 0.3  # chance: 0.1
    # the loss continues: at the first progress line (step 7) it is where the uninterrupted 2-worker run's is
    assert resumed["losses"][0] == pytest.approx(fsdp_runs["first"]["fsdp-ref"]["losses"][0], rel=0.02)
    stopped, resumed = fsdp_runs["world3"]["to2"], fsdp_runs["last2"]["to2"]
    assert stopped["summary"] is None and resumed["resumed_from_step"] == 5
    assert resumed["summary"]["epochs"] == 2 and resumed["summary"]["eval_accuracy"] > 0.3  # chance: 0.1


def test_export_is_the_unsharded_parameters_and_evaluation_at_1_2_3_workers_equals_it(fsdp_runs, tmp_path):
    from ray_app.driver.cli import main

    out = tmp_path / "model.pt"
    assert main(["checkpoints", "export", f"{fsdp_runs['root']}/fsdp-mid", "--out", str(out)]) == 0
    exported = torch.load(out, weights_only=True)
    assert _equal(exported, fsdp_runs["first"]["fsdp-mid"]["resumed"]["params"])
    accuracy, loss = default_model_eval(exported)
    for key, world in (("eval1", "last1"), ("eval2", "first"), ("eval3", "world3")):
        result = fsdp_runs[world][key]
        assert result["eval_accuracy"] == accuracy, key
        assert result["eval_loss"] == pytest.approx(loss, rel=1e-5), key


def test_a_single_file_checkpoint_still_loads_under_both_strategies(fsdp_runs, tmp_path):
    """A checkpoint of the earlier format (rank 0's model.pt, optimizer.pt by parameter index) is found and
    loaded as before, and into a model sharded over 2 ranks: its weights and its optimizer's momentum."""
    from tests.support.checkpoints import tiny_payload, write_checkpoint

    path = write_checkpoint(tmp_path / "old", 7)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == catalog.SINGLE_FILE_FORMAT
    loaded = load_uri(str(tmp_path / "old"), rank=0)
    assert loaded.sharded is None and loaded.global_step == 7
    model = torch.nn.Linear(5, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loaded.load_into(model, optimizer)  # a plain module (DDP's inside) takes it as it is
    written = tiny_payload(3)
    assert _equal(model.state_dict(), tiny_payload(7).model)
    sharded = fsdp_runs["last2"]["single_file"]
    assert _equal(sharded["params"], written.model)
    for index, name in enumerate(("weight", "bias")):
        assert torch.equal(sharded["momentum"][name], written.optimizer["state"][index]["momentum_buffer"]), name


# ---------------------------------------------------------------- memory: a model whose state dominates

WIDE, LAYERS = 2560, 8  # 8 x 2560 x 2560 = 52.4M parameters: 210 MB of fp32 weights, 839 MB with AdamW's state


def _rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the resident high-water mark starts again from the current size


def _memory_worker(rank: int, world: int, port: int, out: str, strategy: str) -> None:
    from ray_app.worker.strategy import fully_shard_model

    _init(rank, world, port)
    torch.manual_seed(0)
    base = _rss_mb("VmRSS:")
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDE, WIDE, bias=False) for _ in range(LAYERS)])
    rt = FakeRuntime(rank, world)
    model = fully_shard_model(model, rt.device, world) if strategy == "fsdp" else rt.prepare_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, WIDE)

    def step() -> None:
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # gradients stay allocated, as between steps of a real loop

    step()
    for upload in ("sync", "async"):
        _reset_peak()
        step()
        train_peak = _rss_mb("VmHWM:") - base
        ckpt = Checkpointer(LocalStorage(os.path.join(out, "runs")), f"{strategy}-{upload}", rt.report,
                            staged=upload == "async", wait_s=60)
        _reset_peak()
        files = CheckpointFiles({}, catalog.TrainState(catalog.Position(global_step=3), world), {}, {})
        ckpt.save_shards(model, optimizer, files if rank == 0 else None, {},
                         {"global_step": 3}, rank=rank, world_size=world, name=f"ckpt-s000000003-{strategy}-{upload}")
        ckpt.wait_committed()
        torch.save({"train_peak": train_peak, "checkpoint_peak": _rss_mb("VmHWM:") - base},
                   os.path.join(out, f"mem-{strategy}-{upload}-{rank}.pt"))
    _finish()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def memory(tmp_path_factory, port_picker, monkeypatch_module):
    out = tmp_path_factory.mktemp("memory")
    # every allocation above 64 KiB its own mapping, returned when freed: the resident size is what is live
    # (glibc's default threshold grows to 32 MiB after a free, and freed heap is kept: a high-water mark of that
    # measures the allocator's history, not the state)
    monkeypatch_module.setenv("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    found = {}
    for strategy in ("ddp", "fsdp"):
        _spawn(_memory_worker, 2, port_picker(), str(out), strategy, start_method="spawn")  # reads the variable
        for upload in ("sync", "async"):
            found[strategy, upload] = [torch.load(out / f"mem-{strategy}-{upload}-{r}.pt", weights_only=True)
                                      for r in (0, 1)]
    print("\n[memory] per-rank peak MB above the start (train, checkpoint):",
          {f"{s}-{u}": [(round(m["train_peak"]), round(m["checkpoint_peak"])) for m in v] for (s, u), v in found.items()})
    return found


def test_fsdp_holds_at_most_0_6x_of_ddps_peak_per_rank(memory):
    for upload in ("sync", "async"):
        ddp = max(m["train_peak"] for m in memory["ddp", upload])
        fsdp = max(m["train_peak"] for m in memory["fsdp", upload])
        assert fsdp <= 0.6 * ddp, (fsdp, ddp)


def test_a_sync_checkpoint_adds_at_most_10_percent_and_an_async_one_at_most_the_ranks_share(memory):
    state_mb = 4 * WIDE * WIDE * LAYERS * 4 / 2**20  # weights + gradients + AdamW's two moments, fp32
    for strategy in ("ddp", "fsdp"):
        for m in memory[strategy, "sync"]:
            assert m["checkpoint_peak"] <= 1.10 * m["train_peak"], (strategy, m)
        share = (state_mb - state_mb / 4) / 2  # the weights and moments (no gradients) spread over 2 ranks
        for m in memory[strategy, "async"]:
            assert m["checkpoint_peak"] - m["train_peak"] <= 1.1 * share, (strategy, m, share)


def _norm_worker(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ray_app.worker.strategy import grad_norm

    _init(rank, world, port)
    torch.manual_seed(3)
    # 33 rows: the shards are uneven (17 and 16), as a model's odd sizes make them
    model = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    x = torch.randn(8, 7, generator=torch.Generator().manual_seed(5)) * 40
    mesh = init_device_mesh("cpu", (world,))
    for unit in (model[0], model[2]):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(x).square().sum().backward()
    norm = grad_norm(model)
    clipped = grad_norm(model, 1.0)  # the norm before clipping; the gradients scaled to 1.0
    after = grad_norm(model)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"norm": norm, "clipped": clipped, "after": after, "grads": grads}, out)
    _finish()


def test_fsdp_gradient_norm_and_clipping_equal_the_unsharded_models(port_picker, tmp_path):
    """The global gradient norm under FSDP (each rank's shards, one all_reduce) is the unsharded model's, and
    clipping scales the gradients as ``clip_grad_norm_`` does on the whole model."""
    out = str(tmp_path / "norm.pt")
    _spawn(_norm_worker, 2, port_picker(), out)
    got = torch.load(out, weights_only=True)
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    x = torch.randn(8, 7, generator=torch.Generator().manual_seed(5)) * 40
    model(x).square().sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert expected > 10  # the clip did scale
    torch.testing.assert_close(got["norm"], expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(got["clipped"], expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(got["after"], torch.tensor(1.0), rtol=1e-4, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-5, atol=1e-6)


def _scalar_batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(20 + rank)  # each rank its own two micro-batches
    return [torch.randn(6, 1, 8, 8, generator=g) * 3 for _ in range(2)]


def _scalar_worker(rank: int, world: int, port: int, out: str) -> None:
    from ray_app.worker.strategy import fully_shard_model, grad_norm, no_sync
    from tests.support.unsharded_model import ScalarNet

    _init(rank, world, port)
    torch.manual_seed(3)
    model = fully_shard_model(ScalarNet(1, 8, 10), torch.device("cpu"), world)
    first, last = _scalar_batches(rank)
    with no_sync(model):  # a non-final accumulation micro-step: nothing reduced
        model(first).square().mean().backward()
    model(last).square().mean().backward()
    norm = grad_norm(model, 1.0)
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
             for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"norm": norm, "grads": grads}, out)
    _finish()


def test_scalar_parameters_are_replicated_and_their_gradients_averaged_with_the_shards(port_picker, tmp_path):
    """FSDP shards every parameter along its first dimension and refused a 0-d one (a learned temperature, a
    gain) from inside torch on every rank. The kit keeps them whole on every rank: after two accumulation
    micro-steps on each rank's own data, every gradient (sharded or scalar) and the clipped global norm are the
    unsharded model's on the ranks' data averaged."""
    from tests.support.unsharded_model import ScalarNet

    out = str(tmp_path / "scalars.pt")
    _spawn(_scalar_worker, 2, port_picker(), out)
    got = torch.load(out, weights_only=True)
    torch.manual_seed(3)
    model = ScalarNet(1, 8, 10)
    loss = sum(model(x).square().mean() for rank in range(2) for x in _scalar_batches(rank)) / 2
    loss.backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert expected > 1  # the clip did scale
    torch.testing.assert_close(got["norm"], expected, rtol=1e-5, atol=0)
    assert got["grads"].keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-5, atol=1e-6)


def test_a_share_that_does_not_fit_in_shared_memory_is_refused_before_any_buffer(tmp_path):
    """checkpoint.async_writer=process stages into /dev/shm; a share bigger than its free space is a clear error
    (a tmpfs that fills while a buffer is written would kill the worker with SIGBUS)."""
    import os

    from ray_app.shared.errors import ConfigError
    from ray_app.worker import sharded

    model = {"w": torch.zeros(1000, 10), "b": torch.zeros(10, dtype=torch.float64)}
    optim = {"state": {"w": {"exp_avg": torch.zeros(1000, 10), "step": torch.tensor(3.0)}}, "param_groups": [{"lr": 1.0}]}
    need = sharded.share_bytes(model, optim)
    assert need == 40000 + 80 + 40000 + 4
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    sharded.check_shared_memory(need, 0, str(tmp_path))  # fits
    with pytest.raises(ConfigError, match=r"checkpoint.async_writer=process: rank 1's share .* does not fit in "
                                          r".*checkpoint.async_writer=thread"):
        sharded.check_shared_memory(free + 2**30, 1, str(tmp_path))


class _Experts(torch.nn.Module):
    """A block holding a ModuleList of its own (a mixture's experts): a ModuleList inside a ModuleList."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList([torch.nn.Linear(6, 6) for _ in range(2)])
        self.norm = torch.nn.LayerNorm(6)

    def forward(self, x):
        return self.norm(x + sum(e(x) for e in self.experts))


class _MoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(4, 6)
        self.layers = torch.nn.ModuleList([_Experts() for _ in range(2)])
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _nested_worker(rank: int, world: int, port: int, out: str) -> None:
    from ray_app.worker.strategy import fully_shard_model

    _init(rank, world, port)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(5))
    grads = {}
    for units in ("", "_Experts,Linear"):  # the default; a block's class and the class of modules inside it
        torch.manual_seed(3)
        model = fully_shard_model(_MoE(), torch.device("cpu"), world, units=units)
        model(x).square().sum().backward()
        grads[units] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(grads, out)
    _finish()


def test_a_model_with_modulelists_inside_its_blocks_shards_and_trains(port_picker, tmp_path):
    """The default units are a model's stacks of blocks, never splitting tied weights. Units are sharded
    innermost first: a block holding a ModuleList (experts) shards under the default units
    (the outermost ModuleList's blocks) and with a block's class and its children's classes named, and the
    gradients equal the unsharded model's (sharding a block before the modules inside it fails in FSDP)."""
    from ray_app.shared.errors import ConfigError
    from ray_app.worker.strategy import shard_units

    assert [type(u).__name__ for u in shard_units(_MoE(), "")] == ["_Experts", "_Experts"]
    # nanoGPT's shape: a ModuleDict namespace holding the embedding (tied to the head) and a ModuleList of
    # blocks: the blocks are the units, the embedding stays in the root's with the head; torchtitan's shape:
    # a ModuleDict of blocks
    wte = torch.nn.Embedding(5, 6)
    nano = torch.nn.Module()
    nano.transformer = torch.nn.ModuleDict({"wte": wte, "h": torch.nn.ModuleList([_Experts(), _Experts()]),
                                            "ln_f": torch.nn.LayerNorm(6)})
    nano.lm_head = torch.nn.Linear(6, 5, bias=False)
    nano.lm_head.weight = wte.weight
    assert shard_units(nano, "") == list(nano.transformer["h"])
    titan = torch.nn.Module()
    titan.tok = torch.nn.Embedding(5, 6)
    titan.layers = torch.nn.ModuleDict({str(i): _Experts() for i in range(3)})
    assert shard_units(titan, "") == list(titan.layers.values())
    # a parameter lives in one unit: a default unit tied to a module outside it stays in the root's unit,
    # a named one is a one-line ConfigError naming both
    tied = torch.nn.Module()
    tied.wte, tied.mid, tied.head = torch.nn.Embedding(5, 6), torch.nn.Linear(6, 6), torch.nn.Linear(6, 5, bias=False)
    tied.head.weight = tied.wte.weight
    assert shard_units(tied, "") == [tied.mid]
    with pytest.raises(ConfigError, match=r"train.fsdp_units=Embedding: wte.weight is tied to head.weight, outside "
                                          r"its unit \(Embedding\)"):
        shard_units(tied, "Embedding")
    out = str(tmp_path / "nested.pt")
    _spawn(_nested_worker, 2, port_picker(), out)
    got = torch.load(out, weights_only=True)
    torch.manual_seed(3)
    model = _MoE()
    model(torch.randn(8, 4, generator=torch.Generator().manual_seed(5))).square().sum().backward()
    for units in ("", "_Experts,Linear"):
        assert set(got[units]) == {n for n, _ in model.named_parameters()}
        for name, p in model.named_parameters():
            torch.testing.assert_close(got[units][name], p.grad, rtol=1e-5, atol=1e-6)


def test_a_unit_of_two_dtypes_is_one_config_error_before_any_module_changes():
    """fully_shard gathers a unit as one buffer: a unit of two dtypes ended with torch's AssertionError from
    every rank at the first step; now one line naming the unit, a parameter of each dtype and the fix, raised
    before the mesh or any unit is made (no process group needed here)."""
    from torch import nn

    from ray_app.shared.errors import ConfigError
    from ray_app.worker.strategy import fully_shard_model

    class Block(nn.Module):
        def __init__(self, half=False):
            super().__init__()
            self.fc, self.gate = nn.Linear(4, 4), nn.Linear(4, 4)
            if half:
                self.gate.to(torch.bfloat16)

    class Net(nn.Module):
        def __init__(self, half=False, root_half=False):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block(half)])
            self.head = nn.Linear(4, 2)
            self.temp = nn.Parameter(torch.ones(1))
            self.scale = nn.Parameter(torch.tensor(1.0, dtype=torch.float16))  # a scalar: in no unit
            if root_half:
                self.head.to(torch.float64)

    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match=r"the unit blocks.1 \(Block\) holds parameters of 2 dtypes \("
                                          r"blocks.1.gate.weight is bfloat16, blocks.1.fc.weight is float32\)"):
        fully_shard_model(Net(half=True), cpu, 2)
    with pytest.raises(ConfigError, match=r"the root's unit \(Net: what no unit holds\) holds parameters of 2 "
                                          r"dtypes \(temp is float32, head.weight is float64\).*fsdp_units=Block,"):
        fully_shard_model(Net(root_half=True), cpu, 2, units="Block")
    refused = Net(half=True)
    with pytest.raises(ConfigError):
        fully_shard_model(refused, cpu, 2)
    assert not any(hasattr(m, "set_requires_gradient_sync") for m in refused.modules())  # nothing sharded
    # the fix the line names: the other dtype's module a unit of its own
    from ray_app.worker.strategy import check_shardable, shard_units

    fine = Net(half=True)
    check_shardable(fine, shard_units(fine, "Block,Linear"), "Block,Linear")
