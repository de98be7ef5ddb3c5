"""What the fault tests share: the small workload, a ``ray-app train`` run watched line by line, and the
checks on its outcome (``tests.integration.test_faults``, ``test_chaos`` and the chaos driver ``chaos``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

from tests.support.processes import train_workers

REPO = Path(__file__).resolve().parents[2]
STEPS_PER_EPOCH = 32  # 1024 samples / 2 workers / batch 16


def workload(epochs: int, log_every_steps: int = 8, paced_s: float = 0.0) -> list[str]:
    """``--set`` arguments of the small synthetic run every fault test trains (2 CPU workers, gloo).

    ``paced_s``: rank 0's loader sleeps that long per batch (tests/support/faulty_data.py), and rank 1 waits
    for it in the gradient all-reduce: for a run that trains while a test waits on something else (a server's
    outage, a restart), steps at a bounded pace that leaves the machine's cores to the rest."""
    data = ["--set", "data.name=synthetic"] if not paced_s else [
        "--set", "data.name=tests.support.faulty_data:slow_rank",
        "--set", f"data.args={{name: synthetic, rank: 0, delay_s: {paced_s}, batch_size: 16}}"]
    return [
        *data, "--set", "data.args.num_samples=1024", "--set", "data.args.image_size=16",
        "--set", "data.batch_size=16", "--set", "model.name=digits_cnn", "--set", f"train.epochs={epochs}",
        "--set", f"train.log_every_steps={log_every_steps}", "--set", "metrics.enabled=false",
        "--set", "checkpoint.keep=50",
    ]


def env() -> dict:
    """This process's environment without RAY_ADDRESS: each run starts its own local Ray."""
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


class Run:
    """``ray-app train`` in its own session; every output line kept with its arrival time."""

    def __init__(self, args: list[str]):
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "ray_app", "train", *args], cwd=REPO, env=env(),
                                     text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait(self, timeout: float = 600) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.stop()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Kill the whole session (driver, local Ray, workers) if the driver still runs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._reader.join(timeout=10)

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def first(self, pattern: str) -> float | None:
        return next((t for t, line in self.lines if re.search(pattern, line)), None)

    def logged_steps(self) -> list[int]:
        """The global steps of the progress lines printed so far."""
        return [int(m) for m in re.findall(r"epoch \d+ step (\d+)/", self.text)]

    def wait_for_step(self, step: int, timeout: float = 300) -> list[int]:
        """Until a progress line at ``step`` or later; the steps logged by then. Fails here, with what was
        seen, if the driver ends or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while True:
            logged = self.logged_steps()
            if logged and logged[-1] >= step:
                return logged
            rc = self.proc.poll()
            if rc is not None or time.monotonic() >= deadline:
                ended = f"the driver exited {rc}" if rc is not None else f"{timeout:.0f}s passed"
                raise AssertionError(f"waiting for step {step}: {ended}; steps logged: {logged[-10:]}\n"
                                     + self.text[-3000:])
            time.sleep(0.05)

    def workers(self) -> list[psutil.Process]:
        return train_workers(self.proc.pid)


def final_model(summary: dict) -> dict:
    """The parameters in the checkpoint the run ended on."""
    from tests.support.checkpoints import checkpoint_model

    return checkpoint_model(summary["checkpoint"])


def s3_committed(s3, run: str, prefix: str = "runs") -> dict[int, str]:
    """step -> URI of each committed checkpoint of ``run`` under ``prefix`` of the S3 server's bucket."""
    names = {k.split("/")[-2] for k in s3.snapshot(f"{prefix}/{run}/ckpt-s") if k.endswith("/manifest.json")}
    return {int(n[len("ckpt-s"):][:9]): f"s3://{s3.bucket}/{prefix}/{run}/{n}" for n in names}


def kill_a_worker_mid_epoch(run: Run, committed, steps_per_epoch: int, timeout: float = 240) -> int:
    """SIGKILL one of ``run``'s two workers once ``committed()`` (its committed checkpoints' steps) holds one
    mid-epoch past the first epoch; the newest committed step then, which the run resumes from or after."""
    killed_after, deadline = None, time.monotonic() + timeout
    while time.monotonic() < deadline and run.proc.poll() is None:
        steps = committed()
        if any(s > steps_per_epoch and s % steps_per_epoch for s in steps):
            killed_after = max(steps)
            break
        time.sleep(0.05)
    workers = run.workers()
    assert killed_after is not None and len(workers) == 2, (killed_after, run.text[-3000:])
    workers[-1].send_signal(signal.SIGKILL)
    return killed_after


def committed_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name[len("ckpt-s"):][:9]) for p in run_dir.glob("ckpt-s*/manifest.json"))


def summary_of(text: str) -> dict:
    """The JSON summary ``ray-app train`` prints last."""
    return json.loads(text.strip().splitlines()[-1])


def differing_parameters(a: dict, b: dict) -> list[str]:
    """The keys whose tensors are not bit-identical (or present in one state dict only)."""
    return sorted(set(a) ^ set(b)) + [k for k in a if k in b and not torch.equal(a[k], b[k])]


def assert_bit_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    differ = differing_parameters(a, b)
    assert not differ, f"parameters differ: {differ}"
