"""A run resumed at another world size (local Ray, CPU): stopped at 2 workers part-way into an epoch, it
goes on at 3, the rest of that epoch re-sharded over them, the evaluation exact, and learns on."""

from __future__ import annotations

import json
import math
import re

import pytest

from tests.support.processes import run_cli

pytestmark = pytest.mark.integration

SAMPLES, BATCH, EPOCHS = 1024, 16, 3
WORKLOAD = [
    "--set", "data.name=synthetic", "--set", f"data.args.num_samples={SAMPLES}", "--set", "data.args.image_size=16",
    "--set", f"data.batch_size={BATCH}", "--set", "model.name=digits_cnn", "--set", f"train.epochs={EPOCHS}",
    "--set", "train.log_every_steps=8", "--set", "metrics.enabled=false",
]
NO_RAY_ADDRESS = {"RAY_ADDRESS": None}


def summary_of(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_a_run_stopped_at_two_workers_resumes_at_three(tmp_path):
    args = ["train", "--set", f"run.storage={tmp_path}", "--set", "run.name=ws", *WORKLOAD]
    steps_at_2 = SAMPLES // (2 * BATCH)  # 32 per epoch
    stop = steps_at_2 + 8  # 8 batches into the second epoch
    rc, out, err = run_cli([*args, "--set", f"train.max_steps={stop}"], env=NO_RAY_ADDRESS, timeout=600)
    assert rc == 0, (out + err)[-4000:]
    assert summary_of(out)["global_step"] == stop

    # 3 workers on a 2-core machine: half a CPU each
    rc, out, err = run_cli([*args, "--set", "scaling.num_workers=3", "--set", "scaling.cpus_per_worker=0.5"],
                           env=NO_RAY_ADDRESS, timeout=600)
    text = out + err
    assert rc == 0, text[-4000:]
    read = 8 * BATCH * 2
    padded = math.ceil(SAMPLES / 3) * 3  # DistributedSampler's epoch at world size 3: 1026
    per_rank = math.ceil((padded - read) / 3)  # the rest, dealt out over 3 ranks
    left = math.ceil(per_rank / BATCH)
    m = re.search(r"world size 2 -> 3: the rest of epoch 1 \((\d+) of its samples read\) re-sharded, "
                  r"(\d+) batches per rank left; global batch (\d+)", text)
    assert m, text[-4000:]
    assert (int(m.group(1)), int(m.group(2)), int(m.group(3))) == (read, left, 3 * BATCH)
    summary = summary_of(out)
    steps_at_3 = math.ceil(math.ceil(SAMPLES / 3) / BATCH)  # batches per rank in a whole epoch at world size 3
    assert summary["world_size"] == 3 and summary["resumed_from_step"] == stop
    assert summary["global_step"] == stop + left + (EPOCHS - 2) * steps_at_3, summary
    assert summary["num_eval_samples"] == SAMPLES // 4  # every eval sample once, at any world size
    assert summary["eval_accuracy"] >= 0.4, summary  # 10 classes: chance is 0.1
