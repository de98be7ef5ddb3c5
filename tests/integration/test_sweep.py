"""`ray-app sweep` on a real local Ray: Tune trials, each a run of the kit on digits (1 worker, 3 epochs).

Two sweeps of the same space and seed (so the same four trials): one uninterrupted (ASHA, 2 at once) whose
runs and record live on S3 (moto_server over HTTP), one in a local folder whose driver is sent SIGTERM after
two trials are done and is then run again. About 3 minutes on a quiet 2-core machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.s3server import start_s3_server
from tests.support.processes import REPO, stop_process

pytestmark = pytest.mark.integration

RAY_TMP = Path("/tmp/ray")  # where a local Ray keeps its sessions' logs
LOCAL_ENV = {"RAY_ADDRESS": None}  # always a fresh local Ray, never someone's cluster
SPACE = """
metric: eval_accuracy
mode: max
trials: 4
concurrent: {concurrent}
scheduler: {{name: asha, grace_period: 1, reduction_factor: 2}}
space:
  train.lr: {{grid: [0.0005, 0.05]}}
  model.args.width: {{choice: [8, 16]}}
"""
BASE = ["--config", str(REPO / "configs" / "local.yaml"), "--set", "scaling.num_workers=1", "--set", "train.epochs=3",
        "--set", "metrics.enabled=false"]


def last_json(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    assert lines, "no output"
    return json.loads(lines[-1])


def sweep_args(tmp: Path, name: str, concurrent: int, storage: str | None = None) -> list[str]:
    space = tmp / f"space-{concurrent}.yaml"
    space.write_text(SPACE.format(concurrent=concurrent))
    return ["sweep", *BASE, "--space", str(space), "--set", f"run.storage={storage or tmp / 'runs'}",
            "--set", f"run.name={name}"]


def record_of(tmp: Path, name: str) -> dict:
    return json.loads((tmp / "runs" / name / "sweep.json").read_text())


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = start_s3_server(tmp_path_factory.mktemp("moto") / "moto.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, run_cli, s3):
    tmp = tmp_path_factory.mktemp("sweep")
    t0 = time.monotonic()
    env = {**s3.env(), **LOCAL_ENV}
    uri = f"s3://{s3.bucket}/sweeps"
    sessions_before = set(RAY_TMP.glob("session_2*"))
    rc, out, err = run_cli(sweep_args(tmp, "asha", concurrent=2, storage=uri), env=env, timeout=400, cwd=tmp)
    assert rc == 0, f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    print(f"uninterrupted sweep: {time.monotonic() - t0:.1f} s")
    body = s3.client().get_object(Bucket=s3.bucket, Key="sweeps/asha/sweep.json")["Body"].read()
    return {"tmp": tmp, "summary": last_json(out), "record": json.loads(body), "env": env, "uri": f"{uri}/asha",
            "ray_sessions": sorted(set(RAY_TMP.glob("session_2*")) - sessions_before)}


@pytest.mark.timeout(500)
def test_an_asha_sweep_on_s3_stops_bad_trials_early_and_its_best_checkpoint_evals_to_its_metric(uninterrupted,
                                                                                                 run_cli):
    tmp, summary, env = uninterrupted["tmp"], uninterrupted["summary"], uninterrupted["env"]
    states = [t["state"] for t in summary["trials"]]
    assert len(states) == 4 and set(states) <= {"finished", "stopped"}, summary["trials"]
    stopped = [t for t in summary["trials"] if t["state"] == "stopped"]
    assert stopped and all(t["epoch"] < 3 for t in stopped), summary["trials"]  # early: before the last epoch
    assert all(t["epoch"] == 3 for t in summary["trials"] if t["state"] == "finished")
    for t in stopped:  # a stopped trial keeps its checkpoints, committed and verified
        assert t["checkpoint"].startswith(uninterrupted["uri"] + f"/{t['trial']}/ckpt-"), t
        rc, out, err = run_cli(["checkpoints", "verify", t["checkpoint"]], env=env, timeout=120, cwd=tmp)
        assert rc == 0 and "verified" in out, (out, err)
    best = summary["best"]
    assert best["trial"] in {t["trial"] for t in summary["trials"] if t["state"] == "finished"}
    assert best["eval_accuracy"] == max(t["checkpoint_metric"] for t in summary["trials"])
    assert best["params"]["train.lr"] == 0.05 and "lr: 0.05" in best["config_yaml"]
    print("trials:", [(t["trial"], t["state"], t["epoch"], t["checkpoint_metric"]) for t in summary["trials"]])
    # the best config's metric is what `ray-app eval` of its checkpoint gives, exactly
    rc, eval_out, err = run_cli(["eval", "--checkpoint", best["checkpoint"]], env=env, timeout=300, cwd=tmp)
    assert rc == 0, err[-3000:]
    assert last_json(eval_out)["eval_accuracy"] == best["eval_accuracy"]
    print(f"best {best['trial']}: sweep {best['eval_accuracy']!r}, ray-app eval {last_json(eval_out)['eval_accuracy']!r}")
    # `sweep show` prints the same later, reading the record (no lease, no Ray)
    rc, shown, err = run_cli(["sweep", "show", uninterrupted["uri"]], env=env, timeout=60, cwd=tmp)
    assert rc == 0 and last_json(shown) == summary, err
    assert "stopped" in shown and "best: " in shown


def test_the_sweeps_s3_keys_are_in_none_of_rays_logs(uninterrupted):
    """Tune would copy the driver's AWS keys into each trial actor's runtime_env, which Ray logs."""
    secret = uninterrupted["env"]["AWS_SECRET_ACCESS_KEY"]
    logs = [f for session in uninterrupted["ray_sessions"] for f in (session / "logs").rglob("*") if f.is_file()]
    assert logs, f"no Ray session logs found under {RAY_TMP}"
    assert not [str(f) for f in logs if secret.encode() in f.read_bytes()]


def files_with_mtimes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.timeout(600)
def test_a_sweep_sigtermed_after_two_trials_resumes_without_rerunning_them(uninterrupted, run_cli):
    tmp, first_summary = uninterrupted["tmp"], uninterrupted["summary"]
    args = sweep_args(tmp, "resumed", concurrent=2)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with open(tmp / "resumed-1.out", "w") as out, open(tmp / "resumed-1.err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "ray_app", *args], cwd=tmp, env=env, stdout=out, stderr=err)
        try:
            deadline = time.monotonic() + 400
            done, with_checkpoint = [], []
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    trials = record_of(tmp, "resumed")["trials"]
                except (OSError, ValueError):
                    trials = []
                done = [t for t in trials if t["state"] in ("finished", "stopped")]
                with_checkpoint = [t for t in trials if t["state"] == "running" and t["checkpoint"]]
                if len(done) >= 2 and with_checkpoint:  # two trials done, one running past its first checkpoint
                    break
                time.sleep(0.5)
            assert proc.poll() is None and len(done) >= 2 and with_checkpoint, \
                (tmp / "resumed-1.err").read_text()[-3000:]
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(120)
        finally:
            if proc.poll() is None:
                stop_process(proc)
    err_text = (tmp / "resumed-1.err").read_text()
    assert rc == 143 and "resume with: ray-app sweep" in err_text, err_text[-3000:]
    before = record_of(tmp, "resumed")
    done_before = {t["trial"]: t for t in before["trials"] if t["state"] in ("finished", "stopped")}
    assert len(done_before) in (2, 3) and len(done_before) < 4, before["trials"]
    print("done before the SIGTERM:", {k: (t["state"], t["epoch"]) for k, t in done_before.items()})
    runs = tmp / "runs" / "resumed"
    files_before = {name: files_with_mtimes(runs / name) for name in done_before}

    rc, out, err = run_cli(args, env=LOCAL_ENV, timeout=400, cwd=tmp)  # the same command again
    assert rc == 0, f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    assert "resuming sweep" in out
    summary = last_json(out)
    after = record_of(tmp, "resumed")
    assert after["resumes"] == 1 and all(t["state"] in ("finished", "stopped") for t in after["trials"])
    for t in after["trials"]:
        if t["trial"] in done_before:  # not run again: the same record, the same files, untouched
            assert t["starts"] == 1 and t == done_before[t["trial"]], t["trial"]
            assert files_with_mtimes(runs / t["trial"]) == files_before[t["trial"]], t["trial"]
    print("resumed:", [(t["trial"], t["state"], t["starts"], t["epoch"], t.get("resumed_from_step"))
                       for t in after["trials"]])
    for t in before["trials"]:  # a trial interrupted after a checkpoint resumes from its newest one, not from 0
        if t["trial"] not in done_before and t["checkpoint"]:
            resumed = [ln for ln in out.splitlines() if f"resumed from {runs / t['trial']}/ckpt-" in ln]
            assert resumed and int(resumed[0].rsplit("step ", 1)[1]) >= t["global_step"] > 0, (t, out[-3000:])
            print(f"{t['trial']}: checkpoint at step {t['global_step']} before the SIGTERM; {resumed[0].strip()}")
    # the same trials as the uninterrupted sweep's: each epoch's metric the same (the kit is bit-exact on CPU)
    first = {t["trial"]: t for t in first_summary["trials"]}
    for t in summary["trials"]:
        assert t["params"] == first[t["trial"]]["params"]
        if t["state"] == first[t["trial"]]["state"] == "finished":
            assert (t["checkpoint_metric"], t["epoch"], t["global_step"]) == \
                (first[t["trial"]]["checkpoint_metric"], first[t["trial"]]["epoch"], first[t["trial"]]["global_step"])
    histories = {t["trial"]: {tuple(h[:2]): h[2] for h in t["history"]} for t in uninterrupted["record"]["trials"]}
    for t in after["trials"]:
        for h in t["history"]:
            if tuple(h[:2]) in histories[t["trial"]]:
                assert h[2] == histories[t["trial"]][tuple(h[:2])], (t["trial"], h)
