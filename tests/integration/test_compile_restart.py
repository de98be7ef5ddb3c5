"""``train.compile`` across a restart, on a local Ray (CPU, gloo): a run whose blocks are compiled, one worker
SIGKILLed after the first checkpoint; Ray Train restarts the group on the same node, whose compile cache
(``train.compile_cache_dir``) the first group filled, and the run finishes. The journal (``ray-app runs show
--json``) holds each attempt's seconds from its worker group's start to its first step: the restarted group's
is at least 3x shorter than the cold compile's. Losses under compile against eager: tests/unit/test_compile.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.faultlib import REPO, Run, committed_steps, env, summary_of, workload

pytestmark = pytest.mark.integration

EPOCHS = 6


@pytest.mark.timeout(540)
def test_a_restarted_group_reads_the_compile_cache_and_reaches_its_first_step_3x_sooner(tmp_path):
    storage, cache = tmp_path / "runs", tmp_path / "inductor"
    run = Run(["--set", f"run.storage={storage}", "--set", "run.name=compiled", *workload(EPOCHS),
               "--set", "train.compile=true", "--set", f"train.compile_cache_dir={cache}",
               "--set", "checkpoint.every_steps=8"])
    deadline = time.monotonic() + 360
    while time.monotonic() < deadline and run.proc.poll() is None and not committed_steps(storage / "compiled"):
        time.sleep(0.1)
    workers = run.workers()
    assert committed_steps(storage / "compiled") and len(workers) == 2, run.text[-4000:]
    workers[-1].send_signal(signal.SIGKILL)
    assert run.wait() == 0, run.text[-5000:]
    summary = summary_of(run.text)
    assert len(summary["restarts"]) == 1 and summary["resumed_from_step"] > 0, summary
    assert any(cache.rglob("*")), f"nothing in the compile cache {cache}"

    shown = subprocess.run([sys.executable, "-m", "ray_app", "runs", "show", str(storage / "compiled"), "--json"],
                           cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-3000:]
    attempts = json.loads(shown.stdout)["attempts"]
    assert [a["after"] for a in attempts] == ["first", "restart"], attempts
    cold, warm = (a["seconds_to_first_step"] for a in attempts)
    print(f"\n[compile] seconds to first step: cold compile {cold:.1f}, restarted group {warm:.1f} "
          f"({cold / warm:.1f}x shorter)")
    assert cold >= 3 * warm, attempts
