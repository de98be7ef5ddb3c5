"""Checkpoints on a real S3 API server (moto_server over HTTP on 127.0.0.1).

Shows: preflight fails fast with exit 2 (an unreachable endpoint after the retry budget); a run whose
whole job was lost, resubmitted, ends bit-identical to an uninterrupted run; a broken checkpoint is
never loaded and nothing in the bucket is changed by trying. (A SIGKILLed worker on S3: tests/e2e/test_cluster.py; stopped mid-epoch and
resubmitted: tests/integration/test_faults.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.integration.s3server import start_s3_server
from tests.support.checkpoints import checkpoint_model

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]

# a workload that trains for ~10 s: long enough to kill something mid-epoch
WORKLOAD = [
    "--set", "data.name=synthetic", "--set", "data.args.num_samples=1024", "--set", "data.args.image_size=16",
    "--set", "data.batch_size=16", "--set", "model.name=digits_cnn", "--set", "train.epochs=4",
    "--set", "train.log_every_steps=16", "--set", "metrics.enabled=false", "--set", "checkpoint.keep=50",
]
STEPS_PER_EPOCH = 32  # 1024 samples / 2 workers / batch 16


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = start_s3_server(tmp_path_factory.mktemp("moto") / "moto.log")
    yield server
    server.stop()


def ray_app(args, env, timeout=600):
    proc = subprocess.run([sys.executable, "-m", "ray_app", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def summary_of(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def model_state(s3, uri: str) -> dict:
    return checkpoint_model(uri, s3.env())


def assert_bit_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"parameter {k} differs"


def committed_steps(s3, prefix: str) -> list[int]:
    keys = s3.snapshot(prefix)
    return sorted(int(k.split("/ckpt-s")[1][:9]) for k in keys if k.endswith("/manifest.json") and "/ckpt-s" in k)


# ---------------------------------------------------------------- preflight

@pytest.mark.parametrize("case", ["missing_bucket", "wrong_credentials", "unreachable_endpoint", "read_only_prefix"])
def test_preflight_fails_fast_with_exit_2(s3, case, tmp_path):
    storage = f"s3://{s3.bucket}/pre"
    env = s3.env()
    budget = []
    if case == "missing_bucket":
        storage = "s3://no-such-bucket-here/pre"
    elif case == "wrong_credentials":
        env = s3.env(creds=("AKIAWRONGWRONGWRONG0", "wrong-secret"))
    elif case == "unreachable_endpoint":
        from tests.support.ports import free_port

        env = s3.env(endpoint=f"http://127.0.0.1:{free_port()}")
        budget = ["--set", "failure.storage_retry_s=2"]  # an outage is waited out for the budget (a resume's store)
    elif case == "read_only_prefix":
        env = s3.env(creds=s3.reader)
    before = s3.snapshot()
    t0 = time.monotonic()
    rc, out, err = ray_app(["train", "--set", f"run.storage={storage}", "--set", "run.name=pre", *budget], env,
                           timeout=60)
    elapsed = time.monotonic() - t0
    assert rc == 2, (out, err)
    # fails at once rather than retrying for failure.storage_retry_s (120 s) or starting Ray; the bound
    # leaves a loaded machine room for the interpreter's start-up
    assert elapsed < 60, f"preflight took {elapsed:.1f}s"
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 + bool(budget) and "Traceback" not in err, err  # the wait's line, then the one line
    message = lines[-1]
    expected = {"missing_bucket": "no-such-bucket-here", "wrong_credentials": "credentials",
                "unreachable_endpoint": "AWS_ENDPOINT_URL_S3", "read_only_prefix": "PutObject"}[case]
    assert expected in message, message
    assert "RayTrainWorker" not in out + err and "Ray instance" not in out + err  # no worker started
    for secret in (s3.admin[1], s3.reader[1]):
        assert secret not in out + err
    assert s3.snapshot() == before


def test_preflight_command_ok(s3):
    rc, out, err = ray_app(["preflight", "--set", f"run.storage=s3://{s3.bucket}/ok"], s3.env(), timeout=60)
    assert rc == 0, err
    assert "storage ok" in out


# ---------------------------------------------------------------- exact resume

@pytest.fixture(scope="module")
def reference(s3):
    """The uninterrupted run every interrupted one must match bit for bit (its model)."""
    storage = f"s3://{s3.bucket}/ref"
    rc, out, err = ray_app(["train", "--set", f"run.storage={storage}", "--set", "run.name=ref", *WORKLOAD,
                            "--set", "checkpoint.keep=2"], s3.env())
    assert rc == 0, err[-3000:]
    summary = summary_of(out)
    assert summary["checkpoint"].startswith(f"{storage}/ref/ckpt-s")
    assert summary["global_step"] == 4 * STEPS_PER_EPOCH
    # 3 epoch checkpoints + the final one were written; checkpoint.keep=2 keeps the newest two
    assert committed_steps(s3, "ref/ref/") == [3 * STEPS_PER_EPOCH, 4 * STEPS_PER_EPOCH]
    return model_state(s3, summary["checkpoint"])


def test_stopped_run_resubmitted_resumes_bit_identical_from_epoch_checkpoint(s3, reference):
    """The whole job is killed (driver and its Ray) after an epoch checkpoint, then resubmitted."""
    storage, run = f"s3://{s3.bucket}/stop", "stop"
    args = ["train", "--set", f"run.storage={storage}", "--set", f"run.name={run}",
            "--set", "checkpoint.every_steps=0", "--set", "checkpoint.every_epochs=1", *WORKLOAD]
    proc = subprocess.Popen([sys.executable, "-m", "ray_app", *args], cwd=REPO, env=s3.env(), text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None and not committed_steps(s3, f"stop/{run}/"):
            time.sleep(0.1)
        assert committed_steps(s3, f"stop/{run}/"), "no epoch checkpoint appeared"
    finally:
        # the whole job dies at once, as on a lost machine: the driver and the local Ray it started
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for p in family:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(family, timeout=30)
    steps_before = committed_steps(s3, f"stop/{run}/")
    assert all(s % STEPS_PER_EPOCH == 0 for s in steps_before)
    rc, out, err = ray_app(args, s3.env())
    assert rc == 0, err[-3000:]
    summary = summary_of(out)
    assert summary["resumed_from_step"] == max(steps_before)
    assert_bit_identical(model_state(s3, summary["checkpoint"]), reference)

    # the run journal on S3 tells the two launches apart: the killed one has no end, the second took its lease over
    rc, out, err = ray_app(["runs", "show", f"{storage}/{run}", "--json"], s3.env())
    assert rc == 0, err
    shown = json.loads(out)
    kinds = [e["kind"] for e in shown["events"]]
    assert kinds.count("launch") == 2 and kinds.count("end") == 1 and kinds[-1] == "end", kinds
    taken = [e for e in shown["events"] if e["kind"] == "lease_taken_over"]
    assert len(taken) == 1 and "gone from this host" in taken[0]["why"] and f"pid {proc.pid}" in taken[0]["from"], taken
    assert shown["state"] == "finished" and sum(shown["parts"].values()) == pytest.approx(shown["wall_seconds"], abs=0.01)
    rc, out, err = ray_app(["runs", "list", storage, "--json"], s3.env())
    assert rc == 0, err
    assert [(r["run"], r["state"], r["last_step"], r["holder"]) for r in json.loads(out)] == \
        [(run, "finished", summary["global_step"], "")]


# ---------------------------------------------------------------- broken checkpoints

def _copy_checkpoint(s3, src_prefix: str, dst_prefix: str) -> None:
    c = s3.client()
    for key in s3.snapshot(src_prefix):
        c.copy_object(Bucket=s3.bucket, Key=dst_prefix + key[len(src_prefix):],
                      CopySource={"Bucket": s3.bucket, "Key": key})


def test_broken_checkpoints_are_never_loaded(s3, reference, tmp_path):
    storage, run = f"s3://{s3.bucket}/broken", "broken"
    base = ["--set", f"run.storage={storage}", "--set", f"run.name={run}", *WORKLOAD[:-4],
            "--set", "metrics.enabled=false", "--set", "checkpoint.keep=50"]
    # the good one: the reference run's at the end of epoch 3 (it keeps that and the final one), copied here
    name = next(k.split("/")[2] for k in s3.snapshot("ref/ref/") if k.startswith(f"ref/ref/ckpt-s{3 * STEPS_PER_EPOCH:09d}-"))
    good, good_prefix = f"{storage}/{run}/{name}", f"broken/{run}/{name}/"
    _copy_checkpoint(s3, f"ref/ref/{name}/", good_prefix)
    c = s3.client()
    broken = {}
    for i, kind in enumerate(["flipped_byte", "missing_file", "no_manifest"]):
        name = f"ckpt-s{900 + i:09d}-20990101T000000-{kind[:4]}"
        prefix = f"broken/{run}/{name}/"
        _copy_checkpoint(s3, good_prefix, prefix)
        if kind == "flipped_byte":
            data = bytearray(c.get_object(Bucket=s3.bucket, Key=prefix + "model/__0_0.distcp")["Body"].read())
            data[len(data) // 2] ^= 0x01
            c.put_object(Bucket=s3.bucket, Key=prefix + "model/__0_0.distcp", Body=bytes(data))
        elif kind == "missing_file":
            c.delete_object(Bucket=s3.bucket, Key=prefix + "optim/__1_0.distcp")
        else:
            c.delete_object(Bucket=s3.bucket, Key=prefix + "manifest.json")
        broken[kind] = f"{storage}/{run}/{name}"

    rc, out, err = ray_app(["checkpoints", "verify", f"{storage}/{run}"], s3.env(), timeout=60)
    assert rc == 2
    assert "model/__0_0.distcp does not match its manifest (sha256)" in out and "missing file optim/__1_0.distcp" in out
    assert "no manifest" in out
    rc, out, _ = ray_app(["checkpoints", "list", f"{storage}/{run}", "--json"], s3.env(), timeout=60)
    rows = {r["uri"]: r for r in json.loads(out)}
    assert rows[good]["verified"] and not any(rows[u]["verified"] for u in broken.values())

    before = s3.snapshot(f"broken/{run}/")
    for kind, uri in broken.items():
        # the driver verifies every file of the checkpoint it would use: one line and exit 2, no Ray started
        rc, out, err = ray_app(["train", *base, "--set", "run.name=other", "--set", f"run.resume_from={uri}"],
                               s3.env(), timeout=60)
        assert rc == 2, (kind, err)
        assert "run.resume_from" in err and "Traceback" not in err
        rc, _, err = ray_app(["checkpoints", "export", uri, "--out", str(tmp_path / f"{kind}.pt")], s3.env(), 60)
        assert rc == 2 and not (tmp_path / f"{kind}.pt").exists()
    assert s3.snapshot(f"broken/{run}/") == before  # nothing deleted or overwritten by the failed attempts

    # automatic resume skips all three, each said once (by the driver), and continues from the good one
    rc, out, err = ray_app(["train", *base, "--set", "train.epochs=4"], s3.env())
    assert rc == 0, err[-3000:]
    skipped = [ln[len("ray-app: skipped "):].split(": ", 1)[0] for ln in (out + err).splitlines()
               if ln.startswith("ray-app: skipped ")]
    assert sorted(skipped) == sorted(broken.values()), out + err
    assert summary_of(out)["resumed_from_step"] == 3 * STEPS_PER_EPOCH
    after = s3.snapshot("broken/")
    assert all(after.get(k) == v for k, v in before.items() if "/ckpt-s0000009" in k)
