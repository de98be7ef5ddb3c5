"""`make bench-smoke`: every bench case runs once at tiny size and its outputs are well-formed.

The numbers are not judged here (CI machines are shared and small); the full
`make bench` writes them to bench/RESULTS.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
CASES = "abcdefgps"


def test_bench_smoke_writes_well_formed_results(tmp_path):
    proc = subprocess.run([sys.executable, "bench/run.py", "--smoke", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])

    results = json.loads((tmp_path / "results.json").read_text())
    assert {r["case"] for r in results["rows"]} == set(CASES)
    for row in results["rows"]:
        assert row["kit"] is not None and row["ref"] is not None, row
    kinds = {(r["kind"], r["launch"]) for r in results["runs"]}
    assert {("kit", "cold"), ("kit", "warm"), ("twin", "torchrun"), ("script", "ray-app run")} <= kinds
    script = next(r for r in results["runs"] if r["kind"] == "script")  # the twin's own figures, under ray-app run
    assert script["steady_sps"] > 0 and script["first_step_s"] > 0 and script["losses"], script
    assert all(r["rc"] == 0 for r in results["runs"])
    # the CPU sampler saw the kit's Ray Train workers and the twin's ranks use CPU before the first step
    sampled = {r["kind"]: r["cpu_before_first_step"] for r in results["runs"] if r.get("cpu_before_first_step")}
    assert sampled["kit"]["roles"]["ray::RayTrainWorker"][0] == 2, sampled["kit"]
    assert sampled["twin"]["roles"]["twin.py"][0] == 2 and sampled["twin"]["total"] > 0, sampled["twin"]

    md = (tmp_path / "RESULTS.md").read_text()
    assert "CPU used before the first step, by process" in md
    for heading in ("## Figures", "## (c) Where start-up time goes", "## (d) Checkpoints", "## (e) Recovery",
                    "## Method", "## Every run"):
        assert heading in md
    assert "DataParallel baseline" in md and "load average" in md
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
