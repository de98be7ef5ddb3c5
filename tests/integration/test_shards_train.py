"""An FSDP run (``train.strategy=fsdp``) on a real S3 API server (moto_server over HTTP) and a local Ray (2 CPU
workers), its data streamed from shards and its checkpoints (every rank writes its share) on S3: digits
packed by `ray-app data write` into s3://, trained with `data.name=shards`. A run at 3 workers starts from that
run's mid-epoch checkpoint (saved at 2): the shards are resharded over 3, the rest of the epoch too, and the
evaluation stays exact. Last, a shard whose bytes changed ends a run as bad input found by a worker: exit 2,
one line naming it, no restart. (A worker SIGKILLed mid-epoch of an FSDP run on S3 shards, resumed
bit-identical: tests/integration/test_hf_models.py.)"""

from __future__ import annotations

import math
import re
import signal
import time

import pytest

from ray_app.driver import cli
from tests.integration.faultlib import Run, s3_committed, summary_of
from tests.integration.s3server import start_s3_server

pytestmark = pytest.mark.integration

BATCH, EPOCHS = 16, 2
STEPS_PER_EPOCH = 45  # 1,438 digits / 2 workers / 16
DEST = "datasets/digits"


def workload(s3) -> list[str]:
    return ["--set", "data.name=shards", "--set", f"data.path=s3://{s3.bucket}/{DEST}", "--set", "train.strategy=fsdp",
            "--set", f"data.batch_size={BATCH}", "--set", f"train.epochs={EPOCHS}", "--set", "model.name=digits_cnn",
            "--set", "train.log_every_steps=15", "--set", "metrics.enabled=false", "--set", "checkpoint.keep=50",
            "--set", f"run.storage=s3://{s3.bucket}/runs"]


def test_an_fsdp_run_on_s3_resumes_at_3_workers_from_a_mid_epoch_checkpoint_saved_at_2(tmp_path, monkeypatch):
    t0 = time.monotonic()
    s3 = start_s3_server(tmp_path / "moto.log")
    try:
        for key, value in s3.env().items():
            if key.startswith("AWS_"):
                monkeypatch.setenv(key, value)  # ray-app (and its local Ray, its workers) reach S3 so
        monkeypatch.setattr(signal, "signal", lambda *a: None)  # cli.main in this process
        rc = cli.main(["data", "write", f"s3://{s3.bucket}/{DEST}", "--set", "data.name=digits", "--shard-mb", "0.05"])
        assert rc == 0
        keys = s3.snapshot(DEST)
        assert sum(k.endswith(".parquet") for k in keys) == 10  # 8 train shards, 2 eval

        first = Run(["--set", "run.name=first", *workload(s3), "--set", "checkpoint.every_steps=10"])
        assert first.wait() == 0, first.text[-4000:]
        done = summary_of(first.text)
        assert done["global_step"] == EPOCHS * STEPS_PER_EPOCH and done["num_eval_samples"] == 359, done

        # a mid-epoch checkpoint past the first epoch, saved at 2 workers, resumed at 3 (half a CPU each)
        committed = s3_committed(s3, "first")
        mid = min(s for s in committed if s > STEPS_PER_EPOCH and s % STEPS_PER_EPOCH)
        grow = Run(["--set", "run.name=grow", *workload(s3), "--set", "scaling.num_workers=3",
                    "--set", "scaling.cpus_per_worker=0.5", "--set", f"run.resume_from={committed[mid]}"])
        assert grow.wait() == 0, grow.text[-5000:]

        # one train shard's bytes changed after the manifest (its size kept, so only its sha256 tells):
        # the worker that fetches it ends the run as bad input, once, with one line naming it
        shard = sorted(k for k in keys if "/train" in k and k.endswith(".parquet"))[3]
        client = s3.client()
        body = bytearray(client.get_object(Bucket=s3.bucket, Key=shard)["Body"].read())
        body[len(body) // 2] ^= 0x01
        client.put_object(Bucket=s3.bucket, Key=shard, Body=bytes(body))
        bad = Run(["--set", "run.name=bad", *workload(s3), "--set", "failure.max_failures=3"])
        assert bad.wait() == 2, bad.text[-4000:]
    finally:
        s3.stop()
    lines = [ln for ln in bad.text.splitlines() if ln.startswith("ray-app:")]
    assert len(lines) == 1 and shard.rsplit("/", 1)[-1] in lines[0] and "sha256" in lines[0], bad.text[-4000:]
    assert "Traceback" not in bad.text and bad.text.count("rank 0/2 on host") == 1, bad.text[-4000:]  # no restart
    grown = summary_of(grow.text)
    start = grown["resumed_from_step"]
    assert start == mid, (start, mid)
    done = (start % STEPS_PER_EPOCH) * BATCH * 2
    left = math.ceil(math.ceil((1438 - done) / 3) / BATCH)
    assert re.search(rf"world size 2 -> 3: the rest of epoch {start // STEPS_PER_EPOCH} \({done} of its samples "
                     rf"read\) re-sharded, {left} batches per rank left", grow.text), grow.text[-4000:]
    at3 = math.ceil(math.ceil(1438 / 3) / BATCH)
    assert grown["global_step"] == start + left + (EPOCHS - 1 - start // STEPS_PER_EPOCH) * at3, grown
    assert grown["world_size"] == 3 and grown["num_eval_samples"] == 359 and grown["eval_accuracy"] > 0.5
    print(f"\n[shards] fsdp, s3 shards and checkpoints: 2 -> 3 workers from step {start}; "
          f"the test took {time.monotonic() - t0:.0f}s")
