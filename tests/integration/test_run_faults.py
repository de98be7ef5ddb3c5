"""One writer per run, Ctrl-C and the user's data bugs, through ``ray-app train`` on a local Ray (CPU, gloo).

- a second driver on a run that a first one holds exits 2 within seconds, naming the first; SIGINT to
  the first mid-epoch checkpoints at the next step and exits 130 with one line (step, checkpoint, the
  command that resumes); that command resumes with no completed step lost and its checkpoints verify;
- ragged samples and a raising ``__getitem__``, in the training process and in DataLoader workers: one
  traceback, at most two attempts, exit 1.
"""

from __future__ import annotations

import re
import shlex
import signal
import time

import pytest

from tests.integration.faultlib import STEPS_PER_EPOCH, Run, committed_steps, summary_of, workload
from tests.support.processes import run_cli

pytestmark = pytest.mark.integration


@pytest.mark.timeout(420)
def test_one_writer_per_run_and_ctrl_c_exits_130_with_the_command_that_resumes(tmp_path):
    epochs = 10  # the SIGINT lands in epoch 2; the stop reaches the workers within a few of the ~0.6 s epochs
    args = ["--set", f"run.storage={tmp_path}", "--set", "run.name=held", *workload(epochs, log_every_steps=4)]
    first = Run(args)
    try:
        first.wait_for_step(4)
        t0 = time.monotonic()
        second = Run(args)
        assert second.wait(timeout=60) == 2, second.text[-3000:]
        refused_in = time.monotonic() - t0
        assert refused_in < 20, refused_in
        line = [ln for ln in second.text.splitlines() if "held by another driver" in ln]
        assert len(line) == 1 and f"pid {first.proc.pid}" in line[0] and " since " in line[0], second.text[-3000:]
        assert "Traceback" not in second.text

        logged = first.wait_for_step(STEPS_PER_EPOCH + 4)  # mid-epoch 2
        first.proc.send_signal(signal.SIGINT)  # the driver only, as a terminal's Ctrl-C reaches it
        assert first.wait() == 130, first.text[-5000:]
    finally:
        first.stop()
    m = re.search(r"ray-app: interrupted: stopped at step (\d+); checkpoint (\S+); resume with: (.+)$", first.text, re.M)
    assert m, first.text[-5000:]
    step = int(m.group(1))
    assert logged[-1] <= step < epochs * STEPS_PER_EPOCH and step in committed_steps(tmp_path / "held")
    assert "Traceback" not in first.text, first.text[-5000:]
    command = shlex.split(m.group(3))
    assert command[:2] == ["ray-app", "train"]

    again = Run(command[2:])  # the command the line gave
    assert again.wait() == 0, again.text[-5000:]
    summary = summary_of(again.text)
    assert summary["resumed_from_step"] == step and summary["global_step"] == epochs * STEPS_PER_EPOCH
    rc, out, err = run_cli(["checkpoints", "verify", str(tmp_path / "held")])
    assert rc == 0, out + err
    assert not (tmp_path / "held" / ".lease.json").exists()  # released at the end


@pytest.mark.timeout(300)
# a raising __getitem__ in loader worker processes; ragged samples' message (their indices and shapes) and loader
# workers 0: tests/unit/test_training_faults.py
@pytest.mark.parametrize("broken,loader_workers", [("getitem", 2)])
def test_a_bug_in_the_users_data_is_shown_once_and_ends_the_run_after_at_most_two_attempts(tmp_path, broken,
                                                                                          loader_workers):
    attempts = tmp_path / "attempts"
    run = Run(["--set", f"run.storage={tmp_path}", "--set", "run.name=data-bug",
               "--set", "data.name=tests.support.faulty_data:build", "--set", f"data.args.broken={broken}",
               "--set", f"data.args.attempts={attempts}", "--set", f"data.loader_workers={loader_workers}",
               "--set", "data.batch_size=8", "--set", "model.name=tests.support.faulty_data:Linear", "--set", "train.epochs=1",
               "--set", "metrics.enabled=false", "--set", "failure.max_failures=5"])
    assert run.wait(timeout=280) == 1, run.text[-5000:]
    assert run.text.count("Traceback") <= 1, run.text[-8000:]
    assert len(attempts.read_text().splitlines()) <= 2 * 2  # two workers, at most two attempts
    expected = "sample 37: ((17,), int)" if broken == "ragged" else "ValueError: cannot decode record 37"
    assert expected in run.text, run.text[-5000:]
    assert "ray-app: training failed: in the data pipeline:" in run.text


@pytest.mark.timeout(300)
def test_the_users_error_at_two_steps_is_retried_and_the_run_finishes(tmp_path):
    """The same OSError from one line of the user's task at two different steps is a fault: retried, one
    line each naming it and its step, and the run finishes (the fingerprint carries the step where it was
    raised; the same error at the same step twice ends the run: the data-bug test above)."""
    attempts = tmp_path / "attempts"
    run = Run(["--set", f"run.storage={tmp_path}", "--set", "run.name=flaky",
               "--set", "data.name=tests.support.faulty_data:build", "--set", "data.args.broken=none",
               "--set", f"data.args.attempts={attempts}", "--set", "data.batch_size=8",
               "--set", "model.name=tests.support.faulty_data:Linear", "--set", "train.epochs=3",
               "--set", "task.name=tests.support.faulty_data:FlakyTask", "--set", f"task.args.attempts={attempts}",
               "--set", "task.args.fail_at=3,7", "--set", "metrics.enabled=false", "--set", "failure.max_failures=5"])
    assert run.wait(timeout=280) == 0, run.text[-5000:]
    restarts = [ln for ln in run.text.splitlines() if "ray-app: rank 0 raised in your code" in ln]
    assert len(restarts) == 2, run.text[-5000:]  # the first attempt's, then the second's: one line each
    assert "at step 2: OSError: [Errno 5] Input/output error: a flaky read" in restarts[0], restarts
    assert "at step 6: OSError: [Errno 5] Input/output error: a flaky read" in restarts[1], restarts
    assert "Traceback" not in run.text, run.text[-5000:]
    assert summary_of(run.text)["global_step"] == 3 * 4  # 64 samples / 2 workers / batch 8 = 4 steps an epoch


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    from tests.integration.s3server import start_s3_server

    server = start_s3_server(tmp_path_factory.mktemp("moto") / "moto.log")
    yield server
    server.stop()


STALE_S = 12.0


@pytest.mark.timeout(120)
def test_the_s3_lease_refuses_a_second_driver_and_is_taken_over_once_stale(s3, monkeypatch):
    from ray_app.shared.errors import RunHeld
    from ray_app.shared.lease import RunLease, lease_store
    from ray_app.shared.storage import S3Storage

    for key, value in s3.env().items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)
    storage = S3Storage(f"s3://{s3.bucket}/leases")
    first = RunLease(lease_store(storage, "held"), storage.uri("held"), stale_s=STALE_S)
    first.acquire()
    first.start_renewing()  # a live driver: renewed every quarter of the stale time

    rc, out, err = run_cli(["train", "--set", f"run.storage=s3://{s3.bucket}/leases", "--set", "run.name=held",
                            "--set", f"run.lease_stale_s={STALE_S:g}", "--set", "data.name=synthetic",
                            "--set", "data.args.num_samples=64"], env=s3.env(), timeout=60)
    assert rc == 2 and "held by another driver" in err and "\n" not in err.strip(), (rc, out, err)
    import os

    assert f"pid {os.getpid()}" in err and "Traceback" not in out + err

    with pytest.raises(RunHeld):  # a conditional write (If-None-Match: *) refused with 412
        RunLease(lease_store(storage, "held"), storage.uri("held"), stale_s=STALE_S).acquire()
    first.stop_renewing()  # its driver is gone from here on
    time.sleep(STALE_S + 0.5)
    said = []
    heir = RunLease(lease_store(storage, "held"), storage.uri("held"), stale_s=STALE_S, say=said.append)
    heir.acquire()
    assert len(said) == 1 and "taking over" in said[0]
    assert first.renew() is False  # If-Match on the old ETag: refused
    heir.release()
    assert "leases/held/.lease.json" not in s3.snapshot("leases/")


MARKER_PUT = rb"PUT /[^ ]*/\.validate_storage_marker"  # Ray Train's controller setting up the run's folder


OUTAGE_S = 20  # the store refuses connections this long, from the controller's first write of the run's folder


@pytest.mark.timeout(420)
@pytest.mark.parametrize("retry_s", [60, 3])
def test_storage_refused_for_20_s_just_after_the_preflight(s3, retry_s, tmp_path):
    from urllib.parse import urlparse

    from tests.integration.tcp_proxy import OutageProxy

    url = urlparse(s3.endpoint)
    proxy = OutageProxy(url.hostname, url.port)
    try:
        proxy.arm(MARKER_PUT, OUTAGE_S)
        run = f"dark-{retry_s}"
        rc, out, err = run_cli(["train", "--set", f"run.storage=s3://{s3.bucket}/{run}", "--set", f"run.name={run}",
                                "--set", f"failure.storage_retry_s={retry_s}", "--set", "failure.max_failures=0",
                                *workload(1)], env=s3.env(endpoint=proxy.endpoint), timeout=400)
    finally:
        proxy.close()
    text = out + err
    assert proxy.outages and proxy.outages[0][1] - proxy.outages[0][0] == OUTAGE_S, "no outage: " + text[-3000:]
    assert "Traceback" not in text, text[-6000:]
    if retry_s > OUTAGE_S:  # waited out; max_failures=0: a restart would have ended the run
        assert rc == 0, text[-4000:]
        assert summary_of(out)["global_step"] == STEPS_PER_EPOCH
    else:
        assert rc == 1, text[-4000:]
        failed = [ln for ln in err.splitlines() if ln.startswith("ray-app: training failed:")]
        assert len(failed) == 1 and "no answer for" in failed[0], text[-4000:]
