"""A Hugging Face model, its tokenizer and a text on a real S3 API server (moto_server over HTTP): the text
packed into token shards on S3 by ``ray-app data write`` (``data.name: text``), then ``model.name: hf`` and
``task.name: causal_lm`` trained on the shards (``data.name: shards``) with FSDP at 2 workers on local Ray.
``checkpoints export --format hf``: transformers' ``from_pretrained`` of the export, evaluated in this process,
gives the run's ``eval_loss`` and the same logits as the kit's own model. The same run with one worker
SIGKILLed mid-epoch resumes from its newest checkpoint and ends on the uninterrupted run's parameters, bit for
bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.faultlib import Run, assert_bit_identical, final_model, kill_a_worker_mid_epoch, s3_committed, summary_of
from tests.integration.s3server import start_s3_server
from tests.support.hf import python_help_text, tiny_llama, train_tokenizer

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]
SEQ_LEN, EVAL_FRACTION, BATCH, EPOCHS = 64, 0.1, 4, 2
STEPS_PER_EPOCH = 38  # 299 training sequences of the text's 30,000 characters / 2 workers / 4


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


@pytest.mark.timeout(540)
def test_an_hf_model_from_s3_trains_under_fsdp_and_its_hf_export_is_the_same_model(s3, tmp_path, monkeypatch):
    model_dir = tiny_llama(tmp_path / "model", vocab_size=300, shard="100KB", positions=128)
    tok_dir = train_tokenizer(tmp_path / "tok")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "corpus.txt").write_text(python_help_text(30_000))
    model_uri, tok_uri = upload(s3, model_dir, "models/llama"), upload(s3, tok_dir, "tokenizers/bpe")
    text_uri = upload(s3, tmp_path / "text", "text")
    assert len([f for f in os.listdir(model_dir) if f.endswith(".safetensors")]) == 2  # read shard by shard
    env = {k: v for k, v in s3.env().items() if k != "RAY_ADDRESS"}
    for key, value in env.items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)  # the Run's ray-app, and this process's checkpoint reads, reach S3
    storage, shards_uri = f"s3://{s3.bucket}/runs", f"s3://{s3.bucket}/tokens"
    rc, out, err = ray_app(["data", "write", shards_uri, "--set", "data.name=text", "--set", f"data.args.files={text_uri}",
                            "--set", f"data.args.tokenizer={tok_uri}", "--set", f"data.args.seq_len={SEQ_LEN}",
                            "--set", f"data.args.eval_fraction={EVAL_FRACTION}", "--shard-mb", "0.02"], env)
    assert rc == 0, err[-3000:]
    assert sum(k.endswith(".parquet") for k in s3.snapshot("tokens")) > 2  # several shards to stream
    workload = ["--set", f"run.storage={storage}", "--set", "model.name=hf", "--set", f"model.args.path={model_uri}",
                "--set", "data.name=shards", "--set", f"data.path={shards_uri}", "--set", "task.name=causal_lm",
                "--set", "train.strategy=fsdp", "--set", f"train.epochs={EPOCHS}", "--set", f"data.batch_size={BATCH}",
                "--set", "train.optimizer=adamw", "--set", "train.lr=0.003", "--set", "metrics.enabled=false",
                "--set", "checkpoint.keep=50"]
    reference = Run(["--set", "run.name=llama", *workload])
    assert reference.wait() == 0, reference.text[-4000:]
    summary = summary_of(reference.text)
    assert summary["world_size"] == 2 and summary["global_step"] == EPOCHS * STEPS_PER_EPOCH, summary

    # a worker SIGKILLed mid-epoch, past the first epoch: resumed from the newest checkpoint, bit-identical
    run = Run(["--set", "run.name=llama-kill", *workload, "--set", "checkpoint.every_steps=10"])
    killed_after = kill_a_worker_mid_epoch(run, lambda: s3_committed(s3, "llama-kill"), STEPS_PER_EPOCH)
    assert run.wait() == 0, run.text[-5000:]
    resumed = summary_of(run.text)
    assert killed_after <= resumed["resumed_from_step"] < EPOCHS * STEPS_PER_EPOCH, (killed_after, resumed)
    assert resumed["global_step"] == summary["global_step"] and len(resumed["restarts"]) == 1, resumed
    assert_bit_identical(final_model(resumed), final_model(summary))

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
