"""bench/addon_cost.py: the pace's and the journal's own time, measured inside a real two-rank DDP step, and
the rows `make bench` gives them in cases (r) and (j)."""

from __future__ import annotations

from bench import addon_cost
from bench.report import table_lines
from bench.run import in_step_rows


def test_the_add_ons_own_time_is_measured_inside_a_real_two_rank_step():
    # two gloo ranks, rank 0's journal to a local folder; fewer repeats of the marks and the writes than the bench
    result = addon_cost.measure(["smoke"], 10, marks_steps=200, marks_rounds=3, events=5)
    r = result["workloads"]["smoke"]
    assert r["step_s"] > 0
    assert 0 < r["exchange_s"] < r["step_s"], r  # one all_gather a log interval, spread over its steps
    assert 0 < r["journal_s"] < r["journal_total_s"] < r["step_s"], r
    assert 0 < result["event_write_s"] < 1.0
    assert 0 < result["marks_s_per_step"] < 1e-3  # microseconds a step, never milliseconds
    assert r["pace_cost"] == (result["marks_s_per_step"] + r["exchange_s"]) / r["step_s"]

    # `make bench`: one row per workload in (r) for the pace, in (j) for the journal, judged against 0.5 %
    pace, = in_step_rows("r", "every rank's pace", result)
    journal, = in_step_rows("j", "the run journal", result)
    assert (pace["kit"], pace["ref"], pace["ratio"]) == (r["pace_s"] * 1e6, r["step_s"] * 1e3, r["pace_cost"])
    assert (journal["kit"], journal["ratio"]) == (r["journal_total_s"] * 1e6, r["journal_cost"])
    assert journal["ok"] == (r["journal_cost"] <= 0.005)
    assert "(smoke) " + r["model"] in pace["metric"] and pace["target"] == "<= 0.005"
    assert in_step_rows("p", "preemption agreement", result) == [] and in_step_rows("r", "x", {}) == []
    assert len(table_lines([pace, journal])) == 4
