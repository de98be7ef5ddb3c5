"""`make bench-smoke`: bench/run.py measured against the kit's real output, at tiny size.

What only a real run proves (bench/'s parsing itself is tests/bench/test_bench_parse.py): that the bench
still reads the kit's live output. CI runs cases (c) start-up and (e) recovery after a SIGKILL: three
runs at once (the kit cold with async checkpoints to S3, the kit warm with sync ones and a killed worker,
the twin with a killed rank), whose figures come from the kit's logs, its exporter and its summary, and
checks the figures are there and say what happened (a kill resumed, each checkpoint's blocked time,
bytes in S3: what case (d) reads). The numbers are not judged (CI machines are shared and small);
`make bench` writes them to bench/RESULTS.md. `make test-long` runs every case's smoke, (d) checkpoint
cost, (h) streamed shards and (m) the speed switches (the kit and the twin with AC on and off; compile, tens of
seconds on 2 cores, is left out) included.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
EVERY_CASE = "abcdefghjmprsz"  # the smoke plan's cases: the default ones, (h) streamed shards, (m) AC (no compile)


def smoke(out: Path, cases: str | None = None) -> dict:
    args = [sys.executable, "bench/run.py", "--smoke", "--out", str(out)] + (["--cases", ",".join(cases)] if cases else [])
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return json.loads((out / "results.json").read_text())


def runs_of(results: dict, kind: str) -> list[dict]:
    return [r for r in results["runs"] if r["kind"] == kind]


def test_the_bench_reads_start_up_checkpoints_and_recovery_from_real_runs(tmp_path):
    results = smoke(tmp_path, "ce")
    assert {r["case"] for r in results["rows"]} == set("ce")
    for row in results["rows"]:
        assert row["kit"] is not None and row["ref"] is not None, row
    kits, twins = runs_of(results, "kit"), runs_of(results, "twin")
    assert {r["launch"] for r in kits} >= {"cold", "warm"} and all(r["rc"] == 0 for r in results["runs"])
    for r in kits + twins:
        assert r["first_step_s"] and r["first_step_s"] > 0 and r["losses"], r["label"]
    for r in kits:
        assert r["breakdown"], f"{r['label']}: no start-up phases parsed from its output"
    killed = [r for r in kits + twins if r.get("recovery_s") is not None]
    assert {r["kind"] for r in killed} == {"kit", "twin"}, [r["label"] for r in results["runs"]]
    for r in killed:  # the kill happened after the first committed checkpoint; the kit resumed from one
        assert r["recovery_s"] > 0 and (r["kind"] == "twin" or r["resumed_from_step"] > 0), r
    s3 = [r for r in kits if r.get("ckpt_bytes")]
    assert s3 and all(r["ckpt_blocked_s"] > 0 for r in s3), [(r["label"], r.get("ckpt_blocked_s")) for r in kits]
    # the CPU sampler saw the kit's two Ray Train workers before the first step
    sampled = [r["cpu_before_first_step"] for r in kits if r.get("cpu_before_first_step")]
    assert sampled and sampled[0]["roles"]["ray::RayTrainWorker"][0] == 2, sampled
    md = (tmp_path / "RESULTS.md").read_text()
    for heading in ("## (c) Where start-up time goes", "## (e) Recovery"):
        assert heading in md
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.long
@pytest.mark.timeout(1200)
def test_every_bench_case_runs_and_writes_well_formed_results(tmp_path):
    results = smoke(tmp_path, EVERY_CASE)
    assert {r["case"] for r in results["rows"]} == set(EVERY_CASE)
    for row in results["rows"]:
        assert row["kit"] is not None and row["ref"] is not None, row
    kinds = {(r["kind"], r["launch"]) for r in results["runs"]}
    assert {("kit", "cold"), ("kit", "warm"), ("twin", "torchrun"), ("script", "ray-app run")} <= kinds
    script = next(r for r in results["runs"] if r["kind"] == "script")  # the twin's own figures, under ray-app run
    assert script["steady_sps"] > 0 and script["first_step_s"] > 0 and script["losses"], script
    assert all(r["rc"] == 0 for r in results["runs"])
    sampled = {r["kind"]: r["cpu_before_first_step"] for r in results["runs"] if r.get("cpu_before_first_step")}
    assert sampled["twin"]["roles"]["twin.py"][0] == 2 and sampled["twin"]["total"] > 0, sampled["twin"]
    md = (tmp_path / "RESULTS.md").read_text()
    assert "CPU used before the first step, by process" in md
    for heading in ("## Figures", "## Method", "## Every run"):
        assert heading in md
    assert "DataParallel baseline" in md and "load average" in md
