"""The object store goes dark while a checkpoint uploads (a TCP proxy between the kit and moto_server).

- an outage shorter than ``failure.storage_retry_s`` (10 s against 120 s): the upload waits it out
  with backoff, the run completes, every committed checkpoint verifies;
- an outage longer than the budget: the upload gives up, the worker group restarts, resumes from
  the newest committed checkpoint (never the half-uploaded one), and the run completes once the
  store is back;
- an outage as a command starts (eval, a warm start, a resume of the run on S3): waited out at the
  preflight and the first reads.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.integration.s3server import start_s3_server
from tests.integration.tcp_proxy import OutageProxy

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]

STEPS_PER_EPOCH = 16  # 512 samples / 2 workers / batch 16
EPOCHS = 3
BLIP_S = 10  # the outage shorter than the budget (failure.storage_retry_s, 120 s by default)
WORKLOAD = [
    "--set", "data.name=synthetic", "--set", "data.args.num_samples=512", "--set", "data.args.image_size=16",
    "--set", "data.batch_size=16", "--set", "model.name=digits_cnn", "--set", f"train.epochs={EPOCHS}",
    "--set", "train.log_every_steps=8", "--set", "metrics.enabled=false", "--set", "checkpoint.keep=50",
    "--set", "checkpoint.every_steps=8", "--set", "checkpoint.upload=sync",
]
MODEL_PUT = rb"PUT /[^ ]*/ckpt-s\d+[^ /]*/model/__0_0\.distcp"  # rank 0's share, after its config.json and metrics.json


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = start_s3_server(tmp_path_factory.mktemp("moto") / "moto.log")
    yield server
    server.stop()


@pytest.fixture
def proxy(s3):
    url = urlparse(s3.endpoint)
    p = OutageProxy(url.hostname, url.port)
    yield p
    p.close()


def ray_app(args, env, timeout=600):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ray_app", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    print(f"ray-app {' '.join(args[:1])}: rc {proc.returncode} in {time.monotonic() - t0:.1f}s")
    return proc.returncode, proc.stdout, proc.stderr


def checkpoints(s3, run: str) -> dict[str, set[str]]:
    """checkpoint directory -> its files in the bucket (Ray Train's own files beside them left out)."""
    out: dict[str, set[str]] = {}
    for key in s3.snapshot(f"{run}/{run}/ckpt-s"):
        name, file = key.split("/")[2], "/".join(key.split("/")[3:])
        out.setdefault(name, set()).add(file)
    return out


def verify_all(s3, run: str) -> list[dict]:
    rc, out, err = ray_app(["checkpoints", "verify", f"s3://{s3.bucket}/{run}/{run}", "--json"], s3.env(), timeout=120)
    assert rc == 0, err
    return json.loads(out)


def runs_show(s3, run: str) -> dict:
    """``ray-app runs show --json`` of a run on S3: its journal's timeline and wall time split."""
    rc, out, err = ray_app(["runs", "show", f"s3://{s3.bucket}/{run}/{run}", "--json"], s3.env(), timeout=120)
    assert rc == 0, err
    return json.loads(out)


def test_an_outage_shorter_than_the_budget_is_waited_out(s3, proxy):
    """And the run journal on S3 after the run: ``runs show`` names the outage waited out, the upload it
    held and for how long; the wall time's parts sum to the run's wall time."""
    run = "blip"
    proxy.arm(MODEL_PUT, BLIP_S, nth=2)  # the second checkpoint's upload
    t0 = time.monotonic()
    rc, out, err = ray_app(["train", "--set", f"run.storage=s3://{s3.bucket}/{run}", "--set", f"run.name={run}",
                            *WORKLOAD], s3.env(endpoint=proxy.endpoint))
    wall = time.monotonic() - t0
    text = out + err
    assert rc == 0, text[-4000:]
    assert len(proxy.outages) == 1, "the outage never started: no checkpoint upload matched"
    start, end = proxy.outages[0]
    assert re.search(r"ray-app: storage s3://\S+ at http://127\.0\.0\.1:\d+ unreachable \(\w+\) during upload of "
                     rf"{run}/ckpt-s\d+-\S+/model/__0_0\.distcp; retrying for up to 120 s", text), text[-4000:]
    waited = [float(x) for x in re.findall(r"answers again after ([\d.]+) s", text)]
    # waited the outage out (BLIP_S from the reset), within the budget: backoff on a loaded machine may overshoot
    assert waited and BLIP_S - 2 <= max(waited) <= 120, waited
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["global_step"] == EPOCHS * STEPS_PER_EPOCH and summary["resumed_from_step"] == 0
    assert "resumed from" not in text  # no restart was needed
    rows = verify_all(s3, run)
    assert rows and all(r["verified"] for r in rows), rows  # the interrupted upload was finished, then committed
    assert [r["global_step"] for r in rows] == list(range(8, EPOCHS * STEPS_PER_EPOCH + 1, 8)), rows
    for secret in s3.admin:
        assert secret not in text

    assert s3.snapshot(f"{run}/{run}/events/"), "the run journal is not on S3"
    shown = runs_show(s3, run)
    assert shown["state"] == "finished" and shown["last_step"] == EPOCHS * STEPS_PER_EPOCH, shown["state"]
    outages = [e for e in shown["events"] if e["kind"] == "outage"]
    assert any(re.search(r"upload of \S+/model/__0_0\.distcp", e["during"]) and BLIP_S - 2 <= e["seconds"] <= 120 and
               e["where"].startswith(f"s3://{s3.bucket}") for e in outages), outages
    kinds = [e["kind"] for e in shown["events"]]
    # (the driver's lease renewal waits the same outage out; its event may be written after the end's)
    assert "restart" not in kinds and kinds.count("attempt") == 1 and [k for k in kinds if k != "outage"][-1] == "end", kinds
    ckpts = [e for e in shown["events"] if e["kind"] == "checkpoint"]
    assert [e["global_step"] for e in ckpts] == list(range(8, EPOCHS * STEPS_PER_EPOCH + 1, 8)), ckpts
    assert max(e["blocked_seconds"] for e in ckpts) >= BLIP_S - 2  # the upload that waited the outage out blocked training
    parts = shown["parts"]
    assert abs(sum(parts.values()) - shown["wall_seconds"]) <= 0.01 and \
        abs(shown["wall_seconds"] - wall) <= 0.02 * wall, (shown["wall_seconds"], wall, parts)
    assert parts["checkpoint_blocked"] >= BLIP_S - 2, parts


def test_an_outage_longer_than_the_budget_restarts_from_the_newest_committed_checkpoint(s3, proxy):
    """And a second outage while the restarted group restores (its first read of the newest committed
    checkpoint): the run still resumes from that checkpoint. Each restart is one line; no traceback.
    (Which rank's call meets the outage first is timing: that a storage error is never taken for a
    damaged checkpoint is tests/unit/test_checkpoint.py's.)"""
    run = "dark"
    proxy.arm(MODEL_PUT, 15, nth=2)  # three times the budget: the upload gives up, the group restarts
    # only a restore reads a committed checkpoint's manifest (a commit reads its own parts/ files back)
    proxy.arm(rb"GET /[^ ]*/ckpt-s000000008-[^ /]*/manifest\.json", 12)
    rc, out, err = ray_app(["train", "--set", f"run.storage=s3://{s3.bucket}/{run}", "--set", f"run.name={run}",
                            "--set", "failure.storage_retry_s=5", "--set", "failure.max_failures=10", *WORKLOAD],
                           s3.env(endpoint=proxy.endpoint))
    text = out + err
    assert rc == 0, text[-4000:]
    assert len(proxy.outages) == 2, "the restore's read of the newest committed checkpoint never came"
    restarts = re.findall(r"ray-app: storage \S+ at \S+ no answer for \d+ s during .*; the worker group restarts "
                          r"from the newest committed checkpoint \(restart (\d+) of 10: failure\.max_failures\)", text)
    # the upload's outage, then the restore's, each restart one line
    assert len(restarts) >= 2 and restarts == [str(i) for i in range(1, len(restarts) + 1)], text[-4000:]
    assert "Traceback" not in text and "Error in training function" not in text, text[-4000:]
    assert "ray-app: skipped s3://" not in text or "ckpt-s000000008" not in text.split("skipped")[-1][:200]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert summary["resumed_from_step"] == 8, summary  # the first checkpoint: the second never committed

    dirs = checkpoints(s3, run)
    partial = [name for name, files in dirs.items() if "manifest.json" not in files]
    assert len(partial) == 1 and partial[0].startswith("ckpt-s000000016-"), dirs  # rank 0's upload was cut
    assert {"config.json", "metrics.json"} <= dirs[partial[0]], dirs[partial[0]]  # sorted: these, then its share
    assert "model/__0_0.distcp" not in dirs[partial[0]] and "parts/rank_0.json" not in dirs[partial[0]], dirs
    assert re.search(r"resumed from s3://\S+/ckpt-s000000008-", text), text[-4000:]
    rows = verify_all(s3, run)
    committed = [r for r in rows if r["name"] != partial[0]]
    assert committed and all(r["verified"] for r in committed), rows
    assert [r["global_step"] for r in committed] == list(range(8, EPOCHS * STEPS_PER_EPOCH + 1, 8))
    shown = runs_show(s3, run)  # the journal names each restart's cause as its line did
    causes = [(e["cause"], e["count"]) for e in shown["events"] if e["kind"] == "restart"]
    assert [c for _, c in causes] == [f"restart {i} of 10: failure.max_failures" for i in range(1, len(restarts) + 1)]
    assert all(re.match(r"storage s3://\S+ at \S+: no answer for \d+ s during ", c) for c, _ in causes), causes
    assert sum(shown["parts"].values()) == pytest.approx(shown["wall_seconds"], abs=0.01)
    assert shown["parts"]["restarts"] > 0 and shown["parts"]["recomputed"] > 0, shown["parts"]


SOURCE_RUN = "source"
SOURCE_STEPS = 4  # 64 samples / batch 16, one worker
SOURCE = ["--set", f"run.name={SOURCE_RUN}", "--set", "data.name=synthetic", "--set", "data.args.num_samples=64",
          "--set", "data.args.image_size=16", "--set", "data.batch_size=16", "--set", "model.name=digits_cnn",
          "--set", "metrics.enabled=false", "--set", "scaling.num_workers=1"]


@pytest.fixture(scope="module")
def trained_on_s3(s3):
    """A short run on S3 (one checkpoint): what eval and a warm start read."""
    rc, out, err = ray_app(["train", "--set", f"run.storage=s3://{s3.bucket}/{SOURCE_RUN}", *SOURCE,
                            "--set", "train.epochs=1"], s3.env())
    assert rc == 0, (out + err)[-4000:]
    return f"s3://{s3.bucket}/{SOURCE_RUN}/{SOURCE_RUN}"


@pytest.mark.timeout(400)
def test_eval_and_a_warm_start_ride_out_an_outage_at_their_start_and_a_longer_one_is_one_line(
        s3, proxy, trained_on_s3, tmp_path):
    """The store dark for 10 s as each starts (within failure.storage_retry_s): ``ray-app eval`` of the run on
    S3 and a warm start from it (``run.resume_from``) wait it out and finish. Dark for longer than the budget:
    one line naming the store, exit 2, no traceback."""
    env = s3.env(endpoint=proxy.endpoint)
    proxy.outage(10)
    rc, out, err = ray_app(["eval", "--checkpoint", trained_on_s3, "--set", "scaling.num_workers=1"], env)
    assert rc == 0, (out + err)[-4000:]
    assert json.loads(out.strip().splitlines()[-1])["num_samples"] > 0
    assert re.search(r"unreachable \(\w+\) during listing .*; retrying for up to 120 s", err), err[-3000:]
    assert "answers again after" in err and "Traceback" not in out + err, (out + err)[-3000:]

    proxy.outage(10)  # run.storage is a local folder: only the checkpoint it starts from is on S3
    rc, out, err = ray_app(["train", "--set", f"run.storage={tmp_path}", "--set", "run.name=warm",
                            "--set", f"run.resume_from={trained_on_s3}", "--set", "data.name=synthetic",
                            "--set", "data.args.num_samples=64", "--set", "data.args.image_size=16",
                            "--set", "data.batch_size=16", "--set", "model.name=digits_cnn", "--set", "train.epochs=1",
                            "--set", "metrics.enabled=false", "--set", "scaling.num_workers=1",
                            "--set", "train.lr=0.01"], env)
    assert rc == 0, (out + err)[-4000:]
    assert re.search(r"(warm start|resumed) from s3://", out + err) and "answers again after" in err, (out + err)[-3000:]
    assert "Traceback" not in out + err

    proxy.outage(60)
    t0 = time.monotonic()
    rc, out, err = ray_app(["eval", "--checkpoint", trained_on_s3, "--set", "failure.storage_retry_s=4"], env)
    lines = [ln for ln in err.splitlines() if ln.strip() and "authentication_token_setup" not in ln]
    assert rc == 2, (out + err)[-3000:]
    assert len(lines) == 2 and "Traceback" not in err, err[-3000:]  # the wait announced, then the one line
    assert lines[-1].startswith(f"ray-app: error: storage s3://{s3.bucket}") and "no answer for" in lines[-1] and \
        "AWS_ENDPOINT_URL_S3" in lines[-1], lines
    assert time.monotonic() - t0 < 40


@pytest.mark.timeout(300)
def test_a_resume_of_a_run_on_s3_rides_out_an_outage_at_its_preflight(s3, proxy, trained_on_s3):
    """``ray-app train`` again into the run on S3 (more steps to train) while the store refuses for 10 s from
    the start: the preflight waits it out (one line each way), the run resumes from its checkpoint and goes on."""
    proxy.outage(10)
    rc, out, err = ray_app(["train", "--set", f"run.storage=s3://{s3.bucket}/{SOURCE_RUN}", *SOURCE,
                            "--set", "train.epochs=2", "--set", f"train.max_steps={SOURCE_STEPS + 1}"],
                           s3.env(endpoint=proxy.endpoint))
    text = out + err
    assert rc == 0, text[-4000:]
    assert re.search(r"unreachable \(\w+\) during checking the bucket; retrying for up to 120 s "
                     r"\(failure\.storage_retry_s\)", err), err[-3000:]
    assert "answers again after" in err and "Traceback" not in text, text[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["resumed_from_step"] == SOURCE_STEPS and summary["global_step"] == SOURCE_STEPS + 1, summary
