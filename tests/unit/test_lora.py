"""``model.lora``: peft's LoRA on a Hugging Face model made on the meta device, applied before sharding; only
the adapters train, sit in the optimizer and in checkpoints; a run stopped mid-epoch under FSDP at 2 gloo
ranks resumes bit-identical; ``checkpoints export --format hf`` writes the merged model and ``--format peft``
the adapter folder, both giving the adapted model's logits."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ray_app.shared.config import load_config
from ray_app.shared.errors import ConfigError
from tests.support.hf import python_help_text, tiny_llama, train_tokenizer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(300)
LORA = ["model.lora.r=4", "model.lora.target_modules=[q_proj,v_proj]"]
IDS = torch.arange(24).view(2, 12) % 300


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora")
    (root / "text").mkdir()
    (root / "text" / "corpus.txt").write_text(python_help_text(8_000))
    return {"model": tiny_llama(root / "llama", vocab_size=300, hidden=128), "text": root / "text",
            "tokenizer": train_tokenizer(root / "tok", vocab_size=300), "root": root}


def _overrides(folders: dict) -> list[str]:
    return ["model.name=hf", f"model.args.path={folders['model']}", "data.name=text",
            f"data.args.files={folders['text']}", f"data.args.tokenizer={folders['tokenizer']}",
            "data.args.seq_len=16", "data.args.eval_fraction=0.1", "task.name=causal_lm", "data.batch_size=8",
            "train.optimizer=adamw", "train.lr=0.01", "train.epochs=2", "train.log_every_steps=3",
            "metrics.enabled=false", "checkpoint.keep=10"]


def _adapted(folder, lora: dict):
    """The kit's model in this process: made on meta, LoRA applied (seeded), the base read from the files."""
    from ray_app.shared.hf import pretrained
    from ray_app.worker.lora import apply_lora
    from ray_app.worker.pretrained import load_pretrained

    torch.manual_seed(0)
    model = apply_lora(pretrained(str(folder)), lora)
    load_pretrained(model, torch.device("cpu"))
    return model


def test_only_the_adapters_train_as_many_as_peft_counts_and_sit_in_the_optimizer(folders):
    from ray_app.worker.parts import build_optimizer

    model = _adapted(folders["model"], {"r": 4, "target_modules": ["q_proj", "v_proj"]})
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    reference = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(folders["model"]),
                                    peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    assert trainable == reference.get_nb_trainable_parameters()[0] > 0
    assert all(p.device.type == "cpu" for p in model.parameters())
    cfg = load_config(None, _overrides(folders) + LORA)
    optimizer, _ = build_optimizer(cfg, model, 1, 1)
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == trainable
    with torch.no_grad():  # lora_B starts at zero: the adapted model is the base
        torch.testing.assert_close(model(IDS).logits, reference(IDS).logits)


def test_bad_lora_settings_are_one_line_naming_the_key(folders):
    with pytest.raises(ConfigError, match="model.lora: unknown key rank"):
        load_config(None, ["model.lora.rank=4"])
    with pytest.raises(ConfigError, match="model.lora.r"):
        load_config(None, ["model.lora.r=0"])
    with pytest.raises(ConfigError, match=r"target_modules: qq_proj match no module.*q_proj, up_proj, v_proj$") as e:
        _adapted(folders["model"], {"target_modules": ["q_proj", "qq_proj"]})
    assert "\n" not in str(e.value)
    from ray_app.worker.lora import apply_lora

    with pytest.raises(ConfigError, match="target_modules: required for this model.*its Linear modules: fc$"):
        apply_lora(_Plain(), {"r": 2})


class _Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x)


def test_a_plain_module_takes_lora_on_its_named_linear_modules():
    from ray_app.worker.lora import apply_lora, is_lora

    torch.manual_seed(0)
    model = apply_lora(_Plain(), {"r": 2, "target_modules": ["fc"]})
    assert is_lora(model)
    assert sorted(n for n, p in model.named_parameters() if p.requires_grad) == [
        "base_model.model.fc.lora_A.default.weight", "base_model.model.fc.lora_B.default.weight"]


# ---------------------------------------------------------------- runs of the kit's loop, FSDP at 2 gloo ranks

def _worker(rank: int, world: int, port: int, out: str, storage: str, overrides: list[str]) -> None:
    from tests.unit.test_fsdp import EVERY5, _fit
    from tests.unit.test_loop_ddp import NO_CKPT, _finish, _init

    _init(rank, world, port)
    cfg = lambda name, more: load_config(None, overrides + ["train.strategy=fsdp", f"run.name={name}",  # noqa: E731
                                                            f"run.storage={storage}"] + more)
    keep = lambda r: {k: r[k] for k in ("summary", "params", "resumed_from_step")}  # noqa: E731
    results = {"ref": keep(_fit(rank, world, cfg("ref", LORA + NO_CKPT)))}
    crashed = keep(_fit(rank, world, cfg("mid", LORA + EVERY5), crash_after=1))
    results["mid"] = {"crashed": crashed, "resumed": keep(_fit(rank, world, cfg("mid", LORA + EVERY5)))}
    _fit(rank, world, cfg("full", EVERY5), crash_after=1)  # one checkpoint of the whole model, then stopped
    torch.save(results, os.path.join(out, f"lora-{rank}.pt"))
    _finish()


@pytest.fixture(scope="module")
def lora_runs(folders, port_picker):
    from tests.unit.test_loop_ddp import _spawn

    out, storage = folders["root"], str(folders["root"] / "runs")
    _spawn(_worker, 2, port_picker(), str(out), storage, _overrides(folders))
    return {"rank0": torch.load(out / "lora-0.pt", weights_only=True), "storage": storage}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_lora_run_stopped_mid_epoch_resumes_bit_identical(lora_runs):
    r = lora_runs["rank0"]
    ref, mid = r["ref"], r["mid"]
    assert mid["crashed"]["summary"] is None and mid["resumed"]["resumed_from_step"] == 5
    assert not _equal(mid["crashed"]["params"], ref["params"])
    assert _equal(mid["resumed"]["params"], ref["params"])
    assert mid["resumed"]["summary"]["eval_loss"] == ref["summary"]["eval_loss"]


def _model_bytes(storage: str, run: str) -> tuple[int, list[str]]:
    """The bytes of the model files of the run's first checkpoint, and its model tensors' names."""
    from ray_app.shared import catalog
    from ray_app.worker import checkpoint as ck
    from ray_app.worker.sharded import ShardedRef

    found = catalog.choose(f"{storage}/{run}", keep=ck.needed(None, model_only=True), retry_s=5,
                           then=catalog.AT_START)
    files = found.manifest["files"]
    names = list(ShardedRef(found.storage, found.rel, files, found.verification.contents).model_tensors())
    return sum(m["bytes"] for name, m in files.items() if name.startswith("model/")), names


def test_a_lora_checkpoint_holds_the_adapters_only_in_at_most_5_percent_of_the_bytes(lora_runs):
    lora, names = _model_bytes(lora_runs["storage"], "mid")
    full, _ = _model_bytes(lora_runs["storage"], "full")
    assert names and [n for n in names if ".lora_A." not in n and ".lora_B." not in n] == []
    assert lora <= 0.05 * full, (lora, full)


def _checkpoint_logits(folders, storage: str) -> torch.Tensor:
    from ray_app.worker.checkpoint import load_uri

    model = _adapted(folders["model"], {"r": 4, "target_modules": ["q_proj", "v_proj"]})
    before = {k: v.clone() for k, v in model.state_dict().items() if "lora_B" in k}
    load_uri(f"{storage}/mid", rank=None, model_only=True).load_into(model)
    assert not all(torch.equal(before[k], model.state_dict()[k]) for k in before)  # trained adapters came in
    with torch.no_grad():
        return model(IDS).logits


def test_hf_export_of_a_lora_run_is_the_merged_model_and_peft_export_the_adapters(lora_runs, folders, tmp_path):
    from ray_app.driver.export import export_hf, export_peft

    want = _checkpoint_logits(folders, lora_runs["storage"])
    merged_dir, adapter_dir = tmp_path / "merged", tmp_path / "adapter"
    export_hf(f"{lora_runs['storage']}/mid", merged_dir, 5)
    summary = export_peft(f"{lora_runs['storage']}/mid", adapter_dir, 5)
    assert summary["format"] == "peft"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(adapter_dir))
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(folders["model"])
    adapted = peft.PeftModel.from_pretrained(base, adapter_dir)
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(adapted(IDS).logits, want, rtol=0, atol=0)


def test_peft_export_through_the_command_line_and_of_a_run_without_lora_one_line_exit_2(lora_runs, run_cli,
                                                                                          tmp_path):
    rc, out, err = run_cli(["checkpoints", "export", f"{lora_runs['storage']}/mid", "--format", "peft",
                            "--out", str(tmp_path / "a")], timeout=120)
    assert rc == 0, err
    assert json.loads(out.splitlines()[-1])["format"] == "peft" and (tmp_path / "a" / "adapter_config.json").exists()
    rc, _, err = run_cli(["checkpoints", "export", f"{lora_runs['storage']}/full", "--format", "peft",
                          "--out", str(tmp_path / "b")], timeout=120)
    lines = [ln for ln in err.splitlines() if "error" in ln]
    assert rc == 2 and len(lines) == 1 and "without model.lora" in lines[0], err
    assert not (tmp_path / "b").exists()


def test_a_target_matching_nothing_in_an_hf_model_is_one_line_before_ray(folders):
    from ray_app.driver.launcher import validate_before_ray

    cfg = load_config(None, _overrides(folders) + ["model.lora.target_modules=[q_proj,qkv]"])
    with pytest.raises(ConfigError, match=r"^config key model.lora.target_modules: qkv match no module .*: down_proj"):
        validate_before_ray(cfg)
    validate_before_ray(load_config(None, _overrides(folders) + LORA))
