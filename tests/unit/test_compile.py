"""``train.compile``: torch.compile (inductor, built with the machine's C++ compiler) of each block, after
activation checkpointing and before FSDP or DDP, on real gloo process groups (torch.multiprocessing, no Ray).

What a user would notice: a compiled run's losses are an eager run's within 1e-4 over 50 steps (under FSDP and
DDP, activation checkpointing on); the compiled code lands in the cache folder (``train.compile_cache_dir``, by
default a per-user folder of the node's temp dir, named by nothing of the run, so a restarted worker group on
the node finds it); a model torch cannot compile stops at the first step with one line holding torch's first
error line, the block and the fix (bad input: exit 2, not retried). One cold compile in this module: the DDP
run finds the FSDP run's graphs in the cache.
"""

from __future__ import annotations

import os
import stat

import pytest
import torch

from ray_app.shared import failures
from ray_app.shared.config import load_config
from ray_app.shared.errors import ConfigError
from ray_app.worker.speed import Precision, apply_speed_switches, default_compile_cache, use_compile_cache
from tests.unit.test_loop_ddp import _finish, _init, _spawn
from tests.unit.test_precision import _fit as _fit_recorded

pytestmark = pytest.mark.timeout(400)

# 30,000 characters in blocks of 32: 937 blocks, 59 full steps of 8 a rank at 2 ranks (50 taken)
BASE = ["data.name=tests.support.lm:char_pairs", "data.args.max_chars=30000", "model.name=tests.support.lm:gpt",
        "model.args.n_layer=2", "model.args.n_embd=16", "task.name=language_model", "data.batch_size=8",
        "train.epochs=1", "train.max_steps=50", "train.optimizer=adamw", "train.lr=0.003", "train.log_every_steps=5",
        "train.activation_checkpointing=full", "metrics.enabled=false", "checkpoint.every_epochs=0",
        "checkpoint.every_steps=0"]
# FSDP (the blocks compiled before they are sharded); DDP compiles the same blocks the same way, before it wraps
# the model: tests/integration/test_compile_restart.py runs it, bench case (m) compares its losses with a twin's
RUNS = {"fsdp-eager": ["train.strategy=fsdp"], "fsdp-compiled": ["train.strategy=fsdp", "train.compile=true"]}
# blocks holding BatchNorm, AC on: the compiled recomputation moves no running statistic again
BN = ["data.name=digits", "model.name=tests.support.unsharded_model:BlocksWithBatchNorm", "train.max_steps=10",
      "train.activation_checkpointing=full", "metrics.enabled=false", "checkpoint.every_epochs=0"]
BN_RUNS = {"bn-eager": BN, "bn-compiled": BN + ["train.compile=true"]}
BRANCHY = ["data.name=digits", "model.name=tests.support.lm:BranchyNet", "train.compile=true", "train.max_steps=1",
           "metrics.enabled=false", "checkpoint.every_epochs=0"]


def _worker(rank: int, world: int, port: int, out: str, storage: str, cache: str) -> None:
    _init(rank, world, port)
    results = {}
    for name, overrides in RUNS.items():
        cfg = load_config(None, BASE + overrides + [f"run.name={name}", f"run.storage={storage}",
                                                     f"train.compile_cache_dir={cache}"])
        results[name] = _fit_recorded(rank, world, cfg)
    for name, overrides in BN_RUNS.items():
        cfg = load_config(None, overrides + [f"run.name={name}", f"run.storage={storage}",
                                             f"train.compile_cache_dir={cache}"])
        results[name] = _fit_recorded(rank, world, cfg)
    cfg = load_config(None, BRANCHY + ["run.name=branchy", f"run.storage={storage}", f"train.compile_cache_dir={cache}"])
    try:
        _fit_recorded(rank, world, cfg)
    except ConfigError as exc:  # every rank, at its first forward
        results["branchy"] = {"class": type(exc).__name__, "line": str(exc)}  # plain data: weights_only loads it
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    _finish()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, port_picker):
    out = tmp_path_factory.mktemp("compile")
    cache = out / "inductor"
    _spawn(_worker, 2, port_picker(), str(out), str(out / "runs"), str(cache))
    results = torch.load(out / "rank0.pt", weights_only=True)
    results["cache"] = cache
    return results


def test_compiled_losses_are_within_1e_4_of_eager_over_50_steps(runs):
    eager, compiled = runs["fsdp-eager"], runs["fsdp-compiled"]
    assert eager["summary"]["global_step"] == compiled["summary"]["global_step"] == 50
    assert len(eager["losses"]) == len(compiled["losses"]) == 10
    assert max(abs(a - b) for a, b in zip(eager["losses"], compiled["losses"])) <= 1e-4
    assert abs(eager["summary"]["eval_loss"] - compiled["summary"]["eval_loss"]) <= 1e-4
    assert eager["losses"][-1] < 0.9 * eager["losses"][0]  # it learned


def test_compiled_blocks_with_batchnorm_under_activation_checkpointing_move_its_statistics_once_a_step(runs):
    """The compiled recomputation recomputes what the gradients need, not the running statistics' update: the
    buffers after 10 steps are the eager run's (whose recomputation puts them back), counted 10 times."""
    eager, compiled = runs["bn-eager"], runs["bn-compiled"]
    assert eager["buffers"]["blocks.0.norm.num_batches_tracked"] == 10
    assert eager["buffers"].keys() == compiled["buffers"].keys()
    for k, v in eager["buffers"].items():
        assert torch.allclose(compiled["buffers"][k].double(), v.double(), atol=1e-4), k
    assert abs(eager["summary"]["eval_loss"] - compiled["summary"]["eval_loss"]) <= 1e-4


def test_the_compiled_code_is_kept_in_the_cache_folder(runs):
    """train.compile_cache_dir was set before the first compile: inductor's cache (the compiled graphs, which a
    restarted worker group loads instead of compiling again) is there."""
    kept = [p for p in runs["cache"].rglob("*") if p.is_file()]
    assert kept and any(p.suffix == ".so" for p in kept), sorted(str(p) for p in kept)[:20]


def test_the_default_cache_folder_is_the_users_own_under_the_temp_dir_and_outlives_the_run(tmp_path, monkeypatch):
    """Named by the user, nothing of the run: every run (and every restarted worker group) of the user on the node
    uses the same folder, made private (it holds code that is loaded); one that belongs to another user is
    refused; TORCHINDUCTOR_CACHE_DIR as set is kept; train.compile_cache_dir (a shared volume) wins."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    folder = use_compile_cache("")
    assert folder == default_compile_cache() == str(tmp_path / f"ray_app-inductor-{os.getuid()}")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == folder
    assert os.environ["TRITON_CACHE_DIR"] == os.path.join(folder, "triton")
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert use_compile_cache("") == folder  # a second run, a restarted group: the same folder
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "set"))
    assert use_compile_cache("") == str(tmp_path / "set")
    assert use_compile_cache(str(tmp_path / "volume")) == str(tmp_path / "volume")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "volume" / "triton")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setattr("os.getuid", lambda: os.stat(folder).st_uid + 1)
    os.makedirs(default_compile_cache())  # "another user's" folder of that name, already there
    with pytest.raises(ConfigError, match="belongs to another user; set train.compile_cache_dir"):
        use_compile_cache("")


def test_a_hugging_face_llama_compiles_under_activation_checkpointing(tmp_path, monkeypatch):
    """transformers 5's Llama decoder layers (the ``kernels`` package wraps their attention in a forward that sets
    a context variable: a side effect dynamo refuses inside a checkpoint unless told not to replay it) compiled
    over full activation checkpointing: dynamo takes each layer whole (the kit's fullgraph compile; the backend
    AOT autograd without inductor's code generation, which the other tests here cover: seconds instead of
    a minute), forward and backward run, the gradients are eager's within 1e-4."""
    import functools

    import torch._dynamo

    from tests.support.lm import llama

    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # use_compile_cache sets them in this process
        monkeypatch.setenv(var, "")
    flag = torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
    monkeypatch.setattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint", flag)
    graphs = []

    def counted(gm, example_inputs):  # dynamo's graph of a layer, then AOT autograd as inductor would take it
        graphs.append(gm)
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counted))
    torch.manual_seed(0)
    compiled, eager = llama(64, hidden=32), llama(64, hidden=32)
    eager.load_state_dict(compiled.state_dict())
    cfg = load_config(None, ["train.compile=true", "train.activation_checkpointing=full",
                             f"train.compile_cache_dir={tmp_path / 'inductor'}"])
    apply_speed_switches(compiled, cfg.train, Precision("fp32", sharded=False))
    ids = torch.randint(0, 64, (2, 16))
    try:
        for model in (compiled, eager):
            model(ids).logits.pow(2).mean().backward()
    finally:
        torch._dynamo.reset()
    assert graphs  # compiled, not run eagerly
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-4), name


def test_a_model_torch_cannot_compile_stops_at_the_first_step_with_one_line(runs):
    """A block with data-dependent control flow (tests/support/lm.py ``_Branchy``): the ConfigError holds torch's
    first error line, the block and the fix; the failure table stops on it with exit 2."""
    raised = runs["branchy"]
    assert raised["class"] == "ConfigError", raised
    err = ConfigError(raised["line"])  # what the worker raised, for the failure table
    line = str(err)
    assert "\n" not in line
    assert line == ("train.compile=true: torch.compile failed in the block blocks.0 (_Branchy): Data-dependent "
                    "branching; set train.compile=false to run the model eagerly")
    kind = failures.kind_of(err)
    assert kind is failures.BAD_INPUT_KIND and kind.decision == failures.STOP and kind.exit_code == 2
