"""Chaos on a local Ray (CPU, gloo): one training run, five random faults (SIGKILL, SIGTERM, SIGSTOP of a
random rank, each after the group recovered from the previous one; every kind at least once). The run
exits 0 on the uninterrupted run's parameters, bit for bit; a SIGTERM loses no step, a kill or a stop at
most one checkpoint interval. ``make chaos`` runs the same driver (``tests.integration.chaos``) longer.
"""

from __future__ import annotations

import pytest

from tests.integration.chaos import EVERY_STEPS, SIGNALS, WORLD_SIZE, plan, print_report, run_chaos

pytestmark = pytest.mark.integration

FAULTS = 5
SEED = 20261201  # a fixed plan, so a failure replays with --seed; any seed's first three take every kind, both ranks


def test_a_seed_replays_its_plan_and_the_first_faults_take_every_kind_and_every_rank():
    kinds = list(SIGNALS)
    assert plan(FAULTS, kinds, SEED) == plan(FAULTS, kinds, SEED)
    for seed in range(50):
        first = plan(len(kinds), kinds, seed)
        assert {f.kind for f in first} == set(kinds) and {f.rank for f in first} == set(range(WORLD_SIZE))


def test_five_random_faults_in_one_run_end_on_the_uninterrupted_runs_parameters(tmp_path):
    report = run_chaos(FAULTS, SEED, list(SIGNALS), tmp_path)
    print_report(report)  # the per-fault table and the per-kind recovery figures
    assert report["problems"] == [], f"logs in {tmp_path}"
    assert report["exit_code"] == 0 and report["bit_identical"]
    faults = report["per_fault"]
    assert {f["kind"] for f in faults} == set(SIGNALS) and {f["rank"] for f in faults} == set(range(WORLD_SIZE))
    for f in faults:
        assert f["resumed_from_step"] is not None, f
        if f["kind"] == "term":
            assert f["steps_lost"] == 0 and f["resumed_from_step"] == f["preempted_at_step"], f
        else:
            assert 0 <= f["steps_lost"] <= EVERY_STEPS, f
