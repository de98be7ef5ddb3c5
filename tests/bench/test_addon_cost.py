"""bench/addon_cost.py: the pace's and the journal's own time, measured inside a real two-rank DDP step."""

from __future__ import annotations

from bench import addon_cost


def test_the_add_ons_own_time_is_measured_inside_a_real_two_rank_step():
    r = addon_cost.real_step("smoke", 10)  # two gloo ranks, rank 0's journal to a local folder
    assert r["step_s"] > 0
    assert 0 < r["exchange_s"] < r["step_s"], r  # one all_gather a log interval, spread over its steps
    assert 0 < r["journal_s"] < r["step_s"], r
    assert 0 < addon_cost.event_write_seconds(events=5) < 1.0
    assert addon_cost.marks_seconds(steps=200, rounds=3) < 1e-3  # microseconds a step, never milliseconds
