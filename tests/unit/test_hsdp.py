"""HSDP (``train.strategy=fsdp`` with ``train.replicate``) on real gloo process groups (torch.multiprocessing, no
Ray); ranks pretend to sit on nodes through ``$RAY_APP_NODE_ID``.

What a user would notice: a 2 x 2 run trains as plain FSDP does (the same losses, clipping on), with a node's
ranks as one shard group whatever the rank order, and says its mesh in its start line; its checkpoint resumes
at another mesh (1 x 2) and under DDP; a replicate that cannot work is one line, exit 2, before Ray where it
can be known there and from the worker (not retried) where it cannot.
"""

from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch
import torch.distributed as dist

from ray_app.shared import failures
from ray_app.shared.config import load_config
from ray_app.shared.errors import ConfigError
from ray_app.shared.storage import LocalStorage
from ray_app.worker.checkpoint import Checkpointer
from ray_app.worker.loop import Trainer
from ray_app.worker.mesh import NODE_ENV, plan_mesh
from ray_app.worker.parts import build_parts
from tests.unit.test_fsdp import _equal, _full
from tests.unit.test_loop_ddp import BASE, FakeRuntime, RecordingMetrics, _finish, _init, _spawn

pytestmark = pytest.mark.timeout(300)

# digits at 4 workers: 12 steps per epoch; 30 steps, a progress line (the global loss) at each, clipping on
STEPS = ["train.epochs=3", "train.max_steps=30", "train.log_every_steps=1", "train.clip_grad_norm=1.0",
         "train.warmup_epochs=0", "checkpoint.every_steps=0", "checkpoint.every_epochs=0"]
HSDP = ["train.strategy=fsdp", "train.replicate=auto"]
INTERLEAVED = {0: "node-a", 1: "node-b", 2: "node-a", 3: "node-b"}  # Ray's rank order is not the nodes'


def _cfg(storage: str, name: str, overrides: list[str]):
    return load_config(None, BASE + STEPS + overrides + [f"run.name={name}", f"run.storage={storage}"])


def _fit(rank: int, world: int, cfg) -> dict:
    rt = FakeRuntime(rank, world)
    metrics = RecordingMetrics()
    ckpt = Checkpointer(LocalStorage(cfg.run.storage), cfg.run.name, rt.report, every_epochs=cfg.checkpoint.every_epochs,
                        every_steps=cfg.checkpoint.every_steps, resume_from=cfg.run.resume_from, wait_s=60)
    parts = build_parts(cfg, rt)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer = Trainer(cfg, rt, parts, ckpt, metrics)
        summary = trainer.fit()
    said = out.getvalue()
    print(said, end="", flush=True)
    shard_group = None
    if parts.mesh is not None and parts.mesh.replicate > 1:  # the groups FSDP's collectives really run in
        mesh = next(p for p in trainer.model.parameters() if hasattr(p, "device_mesh")).device_mesh
        shard_group = dist.get_process_group_ranks(mesh.get_group("shard"))
    return {"summary": summary, "params": _full(trainer.model), "resumed_from_step": trainer.resumed_from_step,
            "losses": [p["train_loss"] for p in metrics.progress], "said": said, "shard_group": shard_group,
            "replicas": [[row.replica for row in rows] for rows in metrics.paces]}


def _grad_norm_on_the_mesh(rank: int, world: int) -> dict:
    """The clipped global norm and gradients of a model sharded 2 x 2 (every rank the same batch)."""
    from ray_app.worker.mesh import device_mesh
    from ray_app.worker.strategy import fully_shard_model, grad_norm

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    mesh = device_mesh(plan_mesh("auto", [INTERLEAVED[r] for r in range(world)]), "cpu")
    model = fully_shard_model(model, torch.device("cpu"), world, mesh=mesh)
    model(torch.randn(8, 7, generator=torch.Generator().manual_seed(5)) * 40).square().sum().backward()
    norm = grad_norm(model, 1.0)
    return {"norm": norm, "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()}}


def _four_worker(rank: int, world: int, port: int, out: str, storage: str) -> None:
    _init(rank, world, port)
    results = {"fsdp": _fit(rank, world, _cfg(storage, "fsdp", ["train.strategy=fsdp"]))}
    os.environ[NODE_ENV] = INTERLEAVED[rank]
    results["hsdp"] = _fit(rank, world, _cfg(storage, "hsdp", HSDP + ["checkpoint.every_epochs=1"]))
    results["norm"] = _grad_norm_on_the_mesh(rank, world)
    os.environ[NODE_ENV] = "node-b" if rank == 3 else "node-a"  # 3 workers on one node, 1 on the other
    try:
        build_parts(_cfg(storage, "uneven", HSDP), FakeRuntime(rank, world))
        results["uneven"] = None
    except ConfigError as exc:
        results["uneven"] = str(exc)
    torch.save(results, os.path.join(out, f"four{rank}.pt"))
    _finish()


def _two_worker(rank: int, world: int, port: int, out: str, storage: str) -> None:
    _init(rank, world, port)
    resume = [f"run.resume_from={storage}/hsdp"]  # its final checkpoint (step 30): nothing left to train
    results = {"1x2": _fit(rank, world, _cfg(storage, "to-1x2", ["train.strategy=fsdp"] + resume)),
               "ddp": _fit(rank, world, _cfg(storage, "to-ddp", resume))}
    torch.save(results, os.path.join(out, f"two{rank}.pt"))
    _finish()


@pytest.fixture(scope="module")
def hsdp_runs(tmp_path_factory, port_picker):
    out = tmp_path_factory.mktemp("hsdp")
    storage = str(out / "runs")
    _spawn(_four_worker, 4, port_picker(), str(out), storage)
    four = [torch.load(out / f"four{r}.pt", weights_only=True) for r in range(4)]
    return {"four": four, "storage": storage, "out": out}


def test_hsdp_2x2_trains_as_plain_fsdp_with_a_nodes_ranks_as_one_shard_group(hsdp_runs):
    """Ranks 0 and 2 report node A, 1 and 3 node B: the shard groups are {0, 2} and {1, 3} (a node's ranks,
    not consecutive ones), and over 30 steps with clipping every logged global loss equals plain FSDP's on the
    same 4 ranks; the start line says the mesh, every rank's pace row its replica group; the clipped norm on
    the 2-D mesh is the unsharded model's."""
    four = hsdp_runs["four"]
    fsdp, hsdp = four[0]["fsdp"], four[0]["hsdp"]
    assert [r["hsdp"]["shard_group"] for r in four] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert len(hsdp["losses"]) == len(fsdp["losses"]) == 30 and hsdp["summary"]["global_step"] == 30
    torch.testing.assert_close(torch.tensor(hsdp["losses"]), torch.tensor(fsdp["losses"]), rtol=1e-5, atol=0)
    assert fsdp["losses"][-1] < 0.9 * fsdp["losses"][0]  # it learned
    assert "world size 4, mesh replicate 2 x shard 2 (shard groups by node)" in hsdp["said"], hsdp["said"]
    assert "world size 4, mesh shard 4" in fsdp["said"], fsdp["said"]
    assert hsdp["replicas"] and all(r == [0, 1, 0, 1] for r in hsdp["replicas"])
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    model(torch.randn(8, 7, generator=torch.Generator().manual_seed(5)) * 40).square().sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert expected > 10  # the clip did scale
    torch.testing.assert_close(four[0]["norm"]["norm"], expected, rtol=1e-5, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(four[0]["norm"]["grads"][name], p.grad, rtol=1e-5, atol=1e-6)


def test_a_2x2_checkpoint_resumes_at_1x2_and_under_ddp(hsdp_runs, port_picker):
    """The 2 x 2 run's final checkpoint loads into plain FSDP on 2 workers and into DDP on 2: the parameters are
    the saved ones and the exact evaluation is the 2 x 2 run's."""
    out, storage = hsdp_runs["out"], hsdp_runs["storage"]
    _spawn(_two_worker, 2, port_picker(), str(out), storage)
    two = torch.load(out / "two0.pt", weights_only=True)
    saved = hsdp_runs["four"][0]["hsdp"]
    for name in ("1x2", "ddp"):
        assert two[name]["resumed_from_step"] == 30, name
        assert _equal(two[name]["params"], saved["params"]), name
        assert two[name]["summary"]["eval_loss"] == pytest.approx(saved["summary"]["eval_loss"], rel=1e-5), name
    assert "world size 2, mesh shard 2" in two["1x2"]["said"]


def test_replicate_n_groups_a_nodes_ranks_together_where_the_nodes_match():
    """train.replicate=N takes the ranks node by node: the nodes' grouping where it matches N, consecutive
    ranks of one node otherwise; the start line says which."""
    assert plan_mesh("2", ["a", "b", "a", "b"]).groups == ((0, 2), (1, 3))
    one_node = plan_mesh("2", ["a"] * 4)
    assert one_node.groups == ((0, 1), (2, 3)) and one_node.describe().endswith("(shard groups within nodes)")
    assert plan_mesh("4", ["a", "b"] * 4).groups == ((0, 2), (4, 6), (1, 3), (5, 7))
    assert plan_mesh("1", ["a", "b"] * 2).describe() == "mesh shard 4"
    assert plan_mesh("auto", ["a"] * 3).describe() == "mesh shard 3"


def test_auto_on_nodes_with_unequal_ranks_is_one_line_from_the_worker_exit_2_not_retried(hsdp_runs):
    line = hsdp_runs["four"][0]["uneven"]
    assert line is not None and "\n" not in line
    assert "train.replicate=auto" in line and "(node and ranks: node-a 3, node-b 1)" in line
    assert "scaling.num_workers = nodes x GPUs per node" in line
    kind = failures.kind_of(ConfigError(line))
    assert kind.decision == failures.STOP and kind.exit_code == 2
    with pytest.raises(ConfigError, match=r"\(node and ranks: pod-x 2, pod-y 1\)"):  # Ray's node ids, called by host
        plan_mesh("auto", ["9f3a", "9f3a", "c41b"], {"9f3a": "pod-x", "c41b": "pod-y"})


@pytest.mark.parametrize("overrides, says", [
    (["train.strategy=fsdp", "train.replicate=3", "scaling.num_workers=4"],
     "train.replicate=3 does not divide scaling.num_workers=4"),
    (["train.replicate=2"], "train.replicate=2 shapes FSDP's mesh (HSDP) and DDP already replicates"),
    (["train.strategy=fsdp", "train.replicate=two"], "train.replicate: 'two' is not allowed"),
    (["train.strategy=fsdp", "train.replicate=2", "scaling.num_workers=4", "scaling.min_workers=2"],
     "train.replicate=2 needs a fixed world size"),
], ids=["not-dividing", "under-ddp", "not-a-number", "elastic"])
def test_a_replicate_that_cannot_work_exits_2_in_one_line_before_ray(overrides, says, tmp_path, monkeypatch, capsys):
    from ray_app.driver.cli import main

    monkeypatch.chdir(tmp_path)
    args = ["train"] + [a for o in overrides for a in ("--set", o)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("ray-app: error: config key train.replicate") and says in err, err
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing written
