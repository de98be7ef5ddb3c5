"""A Hugging Face model and its tokenizer on a real S3 API server (moto_server over HTTP): ``model.name: hf``,
``data.name: text`` and ``task.name: causal_lm`` trained with FSDP at 2 workers on local Ray, then
``checkpoints export --format hf``: transformers' ``from_pretrained`` of the export, evaluated in this process,
gives the run's ``eval_loss`` and the same logits as the kit's own model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.s3server import start_s3_server
from tests.support.hf import python_help_text, tiny_llama, train_tokenizer

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]
SEQ_LEN, EVAL_FRACTION = 64, 0.1


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = start_s3_server(tmp_path_factory.mktemp("moto") / "moto.log")
    yield server
    server.stop()


def upload(s3, folder: Path, prefix: str) -> str:
    client = s3.client()
    for f in sorted(folder.iterdir()):
        client.upload_file(str(f), s3.bucket, f"{prefix}/{f.name}")
    return f"s3://{s3.bucket}/{prefix}"


def ray_app(args, env, timeout=600):
    proc = subprocess.run([sys.executable, "-m", "ray_app", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**env, "OMP_NUM_THREADS": "1"})
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.timeout(420)
def test_an_hf_model_from_s3_trains_under_fsdp_and_its_hf_export_is_the_same_model(s3, tmp_path):
    model_dir = tiny_llama(tmp_path / "model", vocab_size=300, shard="100KB", positions=128)
    tok_dir = train_tokenizer(tmp_path / "tok")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "corpus.txt").write_text(python_help_text(30_000))
    model_uri, tok_uri = upload(s3, model_dir, "models/llama"), upload(s3, tok_dir, "tokenizers/bpe")
    text_uri = upload(s3, tmp_path / "text", "text")
    assert len([f for f in os.listdir(model_dir) if f.endswith(".safetensors")]) == 2  # read shard by shard
    env = {k: v for k, v in s3.env().items() if k != "RAY_ADDRESS"}
    storage = f"s3://{s3.bucket}/runs"
    rc, out, err = ray_app(["train", "--set", f"run.storage={storage}", "--set", "run.name=llama",
                            "--set", "model.name=hf", "--set", f"model.args.path={model_uri}",
                            "--set", "data.name=text", "--set", f"data.args.files={text_uri}",
                            "--set", f"data.args.tokenizer={tok_uri}", "--set", f"data.args.seq_len={SEQ_LEN}",
                            "--set", f"data.args.eval_fraction={EVAL_FRACTION}", "--set", "task.name=causal_lm",
                            "--set", "train.strategy=fsdp", "--set", "train.epochs=1", "--set", "data.batch_size=8",
                            "--set", "train.optimizer=adamw", "--set", "train.lr=0.003", "--set", "metrics.enabled=false"],
                           env)
    assert rc == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["world_size"] == 2 and summary["global_step"] > 0

    export = tmp_path / "export"
    rc, out, err = ray_app(["checkpoints", "export", f"{storage}/llama", "--format", "hf", "--out", str(export)], env)
    assert rc == 0, err[-3000:]
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(export))
    rc, out, err = ray_app(["checkpoints", "export", f"{storage}/llama", "--out", str(tmp_path / "model.pt")], env)
    assert rc == 0, err[-3000:]

    served = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    kit = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(model_dir)).eval()
    kit.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    from ray_app.shared.tasks import CausalLM
    from ray_app.shared.text import text

    _, evaluation, _ = text(str(tmp_path / "text"), str(tok_dir), seq_len=SEQ_LEN, eval_fraction=EVAL_FRACTION)
    task, loss_sum, tokens = CausalLM(), 0.0, 0
    with torch.no_grad():
        for i in range(len(evaluation)):
            batch = {k: v[None] for k, v in evaluation[i].items()}
            assert torch.equal(served(batch["input_ids"]).logits, kit(batch["input_ids"]).logits), i
            values = task.evaluate(served, batch)
            loss_sum, tokens = loss_sum + float(values["token_loss_sum"]), tokens + float(values["target_tokens"])
    assert loss_sum / tokens == pytest.approx(summary["eval_loss"], rel=1e-6, abs=1e-6)
    trained = torch.load(tmp_path / "model.pt", weights_only=True)
    start = transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert not torch.equal(trained["model.layers.0.mlp.up_proj.weight"], start["model.layers.0.mlp.up_proj.weight"])
