"""Chaos on a local Ray (CPU, gloo): faults in sequence in one training run, each once the group recovered
from the one before. CI: on S3 (moto_server behind a TCP proxy), a short outage of the store, then a SIGKILL
and a SIGTERM (both ranks): the run exits 0 on the uninterrupted run's
parameters, bit for bit; the SIGTERM loses no step and its restart does not count against
``failure.max_failures`` (set to the number of kills exactly), the kill loses at most one checkpoint
interval. A hang (SIGSTOP) is tests/integration/test_faults.py's. ``make test-long`` runs 20 faults of
every kind; ``make chaos`` the same driver (``tests.integration.chaos``) by hand.
"""

from __future__ import annotations

import re
from urllib.parse import urlparse

import pytest

from tests.integration.chaos import EVERY_STEPS, SIGNALS, WORLD_SIZE, plan, print_report, run_chaos
from tests.integration.s3server import start_s3_server
from tests.integration.tcp_proxy import OutageProxy

pytestmark = pytest.mark.integration

SEED = 20261201  # a fixed plan, so a failure replays with --seed
CI_KINDS = ["kill", "term"]
# the plan SEED gives for CI's two faults: (kind, rank, steps after the group's first step)
CI_PLAN = [("kill", 0, 6), ("term", 1, 5)]


def test_a_seed_gives_one_plan_and_the_first_faults_take_every_kind_and_every_rank():
    assert [(f.kind, f.rank, f.gap) for f in plan(2, CI_KINDS, SEED)] == CI_PLAN  # replayable across processes
    assert [(f.kind, f.rank, f.gap) for f in plan(2, CI_KINDS, SEED + 1)] != CI_PLAN  # and the seed chooses it
    kinds = list(SIGNALS)
    for seed in range(50):
        first = plan(len(kinds), kinds, seed)
        assert {f.kind for f in first} == set(kinds) and {f.rank for f in first} == set(range(WORLD_SIZE))


def check(report: dict, kinds: list[str]) -> None:
    print_report(report)  # the per-fault table and the per-kind recovery figures
    assert not report["problems"], "\n".join(report["problems"] + [f"logs in {report['storage']}"])
    assert report["exit_code"] == 0 and report["bit_identical"]
    faults = report["per_fault"]
    assert {f["kind"] for f in faults} == set(kinds) and {f["rank"] for f in faults} == set(range(WORLD_SIZE))
    assert report["max_failures"] == sum(f["kind"] != "term" for f in faults)
    for f in faults:
        assert f["resumed_from_step"] is not None, f
        if f["kind"] == "term":
            assert f["steps_lost"] == 0 and f["resumed_from_step"] == f["preempted_at_step"], f
        else:
            assert 0 <= f["steps_lost"] <= EVERY_STEPS, f
    check_journal(report, faults)


def check_journal(report: dict, faults: list[dict]) -> None:
    """``ray-app runs show``: each fault on the timeline with its cause, in order (a kill or a hang a restart
    naming the rank that failed, a SIGTERM a preemption), and the wall time's parts sum to the run's."""
    shown = report["journal"]
    assert shown is not None, "ray-app runs show failed"
    assert shown["state"] == "finished" and shown["last_step"] == report["total_steps"], shown["state"]
    cuts = [e for e in shown["events"] if e["kind"] in ("restart", "preemption")]
    assert [e["kind"] for e in cuts] == ["preemption" if f["kind"] == "term" else "restart" for f in faults], cuts
    for e in cuts:
        assert e["cause"] and "\n" not in e["cause"], e
    assert all("Preempted" in e["cause"] for e in cuts if e["kind"] == "preemption"), cuts
    assert all(re.search(r"rank \d", e["cause"]) for e in cuts if e["kind"] == "restart"), cuts
    ends = [e for e in shown["events"] if e["kind"] == "end"]
    assert len(ends) == 1 and ends[0]["exit_code"] == 0, ends
    assert len([e for e in shown["events"] if e["kind"] == "attempt"]) == len(faults) + 1
    parts, wall = shown["parts"], shown["wall_seconds"]
    print(f"chaos: journal: wall {wall:.1f} s (the driver ran {report['run_seconds']} s): "
          + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items()) + f"; goodput {shown['goodput_ratio']}")
    assert abs(sum(parts.values()) - wall) <= 0.01 and abs(wall - report["run_seconds"]) <= 0.02 * wall, (wall, report)
    assert parts["restarts"] > 0 and parts["productive"] > 0 and parts["checkpoint_blocked"] > 0, parts


OUTAGE_S = 6  # the store dark while the chaos run's first checkpoint uploads (rank 0's model share)
MODEL_PUT = rb"PUT /[^ ]*/ckpt-s\d+[^ /]*/model/__0_0\.distcp"


@pytest.mark.timeout(600)
def test_a_kill_a_preemption_and_an_s3_outage_in_one_run_end_on_the_uninterrupted_runs_parameters(tmp_path,
                                                                                                  monkeypatch):
    """Both runs on S3 (moto_server behind a TCP proxy); the chaos run's first checkpoint upload meets a
    6 s outage, waited out (``failure.storage_retry_s`` 30, the hang timeout above it), then a worker
    is killed and another preempted. ``runs show`` reads the journal back from S3: the outage, the restart
    and the preemption, each with its cause; the wall time's parts sum to the driver's within 2 %."""
    url = urlparse((s3 := start_s3_server(tmp_path / "moto.log")).endpoint)
    proxy = OutageProxy(url.hostname, url.port)
    try:
        for key, value in s3.env(endpoint=proxy.endpoint).items():
            if key.startswith("AWS_"):
                monkeypatch.setenv(key, value)  # the runs, `runs show` and the checkpoints' loads here
        report = run_chaos(len(CI_PLAN), SEED, CI_KINDS, f"s3://{s3.bucket}/runs", logs=tmp_path,
                           before_chaos=lambda: proxy.arm(MODEL_PUT, OUTAGE_S), storage_retry_s=30, hang_timeout_s=60)
        journal_keys = s3.snapshot("runs/chaos/events/")
    finally:
        proxy.close()
        s3.stop()
    check(report, CI_KINDS)
    assert proxy.outages and proxy.outages[0][1] - proxy.outages[0][0] == OUTAGE_S, "no upload met the outage"
    assert journal_keys, "the run journal is not on S3"
    outages = [e for e in report["journal"]["events"] if e["kind"] == "outage"]
    assert any(re.search(r"upload of \S+/model/__0_0\.distcp", e["during"]) and e["seconds"] >= OUTAGE_S - 1 and
               e["where"].startswith(f"s3://{s3.bucket}") for e in outages), outages


@pytest.mark.long
@pytest.mark.timeout(3600)
def test_twenty_random_faults_in_one_run_end_on_the_uninterrupted_runs_parameters(tmp_path):
    check(run_chaos(20, SEED, list(SIGNALS), tmp_path), list(SIGNALS))
