"""``train.activation_checkpointing`` (none | full | selective, ``train.ac_every``) on real gloo process groups
(torch.multiprocessing, no Ray), on the char_lm example's GPT with 12 blocks.

What a user would notice: a rank holds far fewer activations for backward (full: at most 0.4x), and training is
the same, bit for bit, under DDP and FSDP; the state-dict keys do not change, so a run checkpointed without it
resumes with it and ends bit-identical to the run that never had it; a model without blocks to apply it to
stops with one line naming what was searched (bad input: exit 2, not retried).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from ray_app.shared import failures
from ray_app.shared.config import load_config
from ray_app.shared.errors import ConfigError
from ray_app.shared.storage import LocalStorage
from ray_app.worker.checkpoint import Checkpointer
from ray_app.worker.loop import Trainer
from ray_app.worker.parts import build_parts
from tests.unit.test_loop_ddp import FakeRuntime, RecordingMetrics, SimulatedCrash, _finish, _init, _spawn
from tests.unit.test_precision import _full

pytestmark = pytest.mark.timeout(300)

COMMON = ["data.batch_size=8", "train.epochs=1", "train.max_steps=10", "train.optimizer=adamw", "train.lr=0.003",
          "train.log_every_steps=2", "metrics.enabled=false", "checkpoint.every_epochs=0", "checkpoint.every_steps=0"]
BASE = COMMON + ["data.name=tests.support.lm:char_pairs", "data.args.max_chars=20000", "model.name=tests.support.lm:gpt",
                 "model.args.n_layer=12", "model.args.n_embd=16", "model.args.dropout=0.1", "task.name=language_model"]
FULL, SELECTIVE = ["train.activation_checkpointing=full"], ["train.activation_checkpointing=selective", "train.ac_every=3"]
FSDP = ["train.strategy=fsdp"]
BN = ["data.name=digits", "model.name=tests.support.unsharded_model:BlocksWithBatchNorm"]  # replaces BASE
RUNS = {"none": [], "full": FULL, "selective": SELECTIVE, "fsdp-none": FSDP, "fsdp-full": FSDP + FULL,
        "bn-none": BN, "bn-full": BN + FULL}


class SavedActivations:
    """The task's loss, measuring what autograd saves for backward during each forward and loss
    (``torch.autograd.graph.saved_tensors_hooks``): the bytes of the distinct storages saved, parameters left
    out (held anyway; measured under DDP, whose parameters are plain tensors). They are held from the end of
    forward until backward frees them: a rank's peak activation memory. Non-reentrant activation checkpointing
    saves a checkpointed block's inputs through these hooks and packs what the block saves inside with hooks of
    its own (recomputed in backward), so under it only the inputs count, as only they are held."""

    def __init__(self, task, model):
        self.task, self.model, self.bytes = task, model, []

    def __getattr__(self, name):
        return getattr(self.task, name)

    def loss(self, model, batch):
        params = {p.untyped_storage().data_ptr() for p in self.model.parameters() if not hasattr(p, "to_local")}
        saved: dict[int, int] = {}

        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                saved[s.data_ptr()] = s.nbytes()
            return t

        with saved_tensors_hooks(pack, lambda t: t):
            out = self.task.loss(model, batch)
        self.bytes.append(sum(saved.values()))
        return out


def _cfg(storage: str, name: str, overrides: list[str]):
    base = COMMON if overrides[:len(BN)] == BN else BASE
    return load_config(None, base + overrides + [f"run.name={name}", f"run.storage={storage}"])


def _fit(rank: int, world: int, cfg, crash_after=None) -> dict:
    rt, metrics = FakeRuntime(rank, world, crash_after), RecordingMetrics()
    ckpt = Checkpointer(LocalStorage(cfg.run.storage), cfg.run.name, rt.report, every_epochs=cfg.checkpoint.every_epochs,
                        every_steps=cfg.checkpoint.every_steps, warn=print)
    parts = build_parts(cfg, rt)
    keys = list(parts.module.state_dict())
    saved = parts.task = SavedActivations(parts.task, parts.module)
    trainer = Trainer(cfg, rt, parts, ckpt, metrics)
    try:
        summary = trainer.fit()
    except SimulatedCrash:
        summary = None
    return {"summary": summary, "losses": [p["train_loss"] for p in metrics.progress], "keys": keys,
            "buffers": {k: b.clone() for k, b in trainer.module.named_buffers()},
            "saved_bytes": saved.bytes[0], "params": _full(trainer.model), "resumed_from_step": trainer.resumed_from_step}


def _worker(rank: int, world: int, port: int, out: str, storage: str) -> None:
    _init(rank, world, port)
    results = {name: _fit(rank, world, _cfg(storage, name, overrides)) for name, overrides in RUNS.items()}
    # checkpointed at step 5 without it, resumed with it (the same run), and the other way round
    every5 = ["checkpoint.every_steps=5"]
    for name, (first, then) in {"none-then-full": ([], FULL), "full-then-none": (FULL, [])}.items():
        _fit(rank, world, _cfg(storage, name, every5 + first), crash_after=1)
        results[name] = _fit(rank, world, _cfg(storage, name, every5 + then))
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    _finish()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, port_picker):
    out = tmp_path_factory.mktemp("ac")
    _spawn(_worker, 2, port_picker(), str(out), str(out / "runs"))
    return torch.load(out / "rank0.pt", weights_only=True)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_full_activation_checkpointing_holds_at_most_0_4x_the_activations(runs):
    """12 blocks: the bytes saved for backward in a training step's forward and loss (SavedActivations)."""
    none, full, selective = (runs[n]["saved_bytes"] for n in ("none", "full", "selective"))
    assert full <= 0.4 * none, (full, none)
    assert full < selective < none  # every 3rd block: 4 of 12


@pytest.mark.parametrize("name, reference", [("full", "none"), ("selective", "none"), ("fsdp-full", "fsdp-none"),
                                             ("bn-full", "bn-none")])
def test_training_with_activation_checkpointing_is_bit_identical(runs, name, reference):
    """Dropout on (its mask drawn again in the recomputation from the restored RNG state), and blocks holding
    BatchNorm (its running statistics put back after the recomputation: they move once a step): every logged
    loss, the final parameters and buffers and the eval loss equal those without it."""
    r, ref = runs[name], runs[reference]
    assert r["summary"]["global_step"] == ref["summary"]["global_step"] == 10 and len(ref["losses"]) == 5
    assert r["losses"] == ref["losses"]
    assert _same(r["params"], ref["params"]) and _same(r["buffers"], ref["buffers"])
    assert r["summary"]["eval_loss"] == ref["summary"]["eval_loss"]
    if name.startswith("bn"):
        assert ref["buffers"] and not torch.equal(ref["buffers"]["blocks.0.norm.running_mean"],
                                                  torch.zeros_like(ref["buffers"]["blocks.0.norm.running_mean"]))


def test_state_dict_keys_do_not_change_and_checkpoints_resume_across_the_switch(runs):
    """The blocks' forward is replaced in place (no wrapper module, no ``_checkpoint_wrapped_module.``): a run
    checkpointed at step 5 without it resumes with it, and back, and ends where the run that never had it does."""
    assert runs["full"]["keys"] == runs["none"]["keys"] == runs["fsdp-full"]["keys"]
    for name in ("none-then-full", "full-then-none"):
        assert runs[name]["resumed_from_step"] == 5
        assert _same(runs[name]["params"], runs["none"]["params"]), name


def test_a_model_without_blocks_is_bad_input_naming_what_was_searched():
    """digits' mlp is an nn.Sequential of layers: no ModuleList or ModuleDict of blocks, no train.fsdp_units. Found
    in the worker, before any collective: a ConfigError, which the failure table stops on with exit 2."""
    cfg = load_config(None, ["data.name=digits", "model.name=mlp", "train.activation_checkpointing=full"])
    with pytest.raises(ConfigError) as err:
        build_parts(cfg, FakeRuntime(0, 1))
    line = str(err.value)
    assert "\n" not in line and line.startswith("train.activation_checkpointing=full: ")
    assert "ModuleList" in line and "ModuleDict" in line and "train.fsdp_units" in line
    kind = failures.kind_of(err.value)
    assert kind is failures.BAD_INPUT_KIND and kind.decision == failures.STOP and kind.exit_code == 2
    assert failures.wrap(err.value, rank=0, step=-1, roots=(), leaving=False) is err.value
