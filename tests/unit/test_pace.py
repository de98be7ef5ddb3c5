"""Every rank's pace: each rank's own step time and data wait reach rank 0 in one all_gather per log interval;
a rank that stays behind is named once, with its host and why; an even run names none.

The runs are the real loop on a real gloo group of 2 ranks (torch.multiprocessing, no Ray): one even, one
whose rank 1 sleeps in its data set (``tests.support.faulty_data:slow_rank``), one whose rank 1 sleeps in
its forward (``SlowForwardNet``). Under DDP both ranks take the same wall time per step either way; the
pace tells the rank that the other waits for.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket

import pytest
import torch

from ray_app.shared.config import load_config
from ray_app.shared.storage import LocalStorage
from ray_app.worker.checkpoint import Checkpointer
from ray_app.worker.loop import Trainer
from ray_app.worker.pace import RankPace, StragglerWatch, own_seconds, straggler_line
from ray_app.worker.parts import build_parts
from tests.unit.test_loop_ddp import NO_CKPT, FakeRuntime, RecordingMetrics, _finish, _init, _load_ranks, _spawn

# digits: 719 train samples per rank -> 23 batches of 32, 23 steps; log every 2 steps: 11 intervals
BASE = ["data.batch_size=32", "train.epochs=1", "train.log_every_steps=2", "metrics.enabled=false",
        "model.name=tests.support.faulty_data:SlowForwardNet", "model.args.delay_s=0"] + NO_CKPT
RUNS = {
    "even": ["data.name=digits"],
    "slow-data": ["data.name=tests.support.faulty_data:slow_rank", "data.args={name: digits, delay_s: 0.08}"],
    "slow-forward": ["data.name=digits", "model.args.delay_s=0.06"],
}


def _pace_worker(rank: int, world: int, port: int, out: str) -> None:
    _init(rank, world, port)
    results = {}
    for name, overrides in RUNS.items():
        cfg = load_config(None, BASE + overrides + [f"run.name={name}", f"run.storage={out}"])
        rt, metrics = FakeRuntime(rank, world), RecordingMetrics()
        ckpt = Checkpointer(LocalStorage(cfg.run.storage), cfg.run.name, rt.report, every_epochs=0, every_steps=0)
        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            Trainer(cfg, rt, build_parts(cfg, rt), ckpt, metrics).fit()
        results[name] = {"lines": said.getvalue().splitlines(),
                         "paces": [[vars(p) for p in rows] for rows in metrics.paces]}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    _finish()


@pytest.fixture(scope="module")
def paced(tmp_path_factory, port_picker):
    out = tmp_path_factory.mktemp("pace")
    _spawn(_pace_worker, 2, port_picker(), str(out))
    return _load_ranks(out, 2)


def stragglers(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("straggler:")]


def test_every_rank_s_pace_reaches_rank_0_at_each_log_interval_with_its_host(paced):
    rank0, rank1 = paced
    paces = rank0["even"]["paces"]
    assert len(paces) == 11  # steps 2, 4, ..., 22
    host = socket.gethostname()
    for rows in paces:
        assert [(p["rank"], p["host"]) for p in rows] == [(0, host), (1, host)]
        assert all(p["step_seconds"] > 0 and p["data_wait_seconds"] >= 0 and p["samples_per_second"] > 0 for p in rows)
    assert all(r["paces"] == [] for r in rank1.values())  # only rank 0 exports


def test_an_even_run_names_no_rank(paced):
    assert stragglers(paced[0]["even"]["lines"]) == []
    assert all(stragglers(r["lines"]) == [] for r in paced[1].values())  # rank 1 never prints one


def test_a_rank_slowed_by_its_data_is_named_once_within_three_intervals_with_its_host(paced):
    run = paced[0]["slow-data"]
    (line,) = stragglers(run["lines"])
    print(line)
    assert f"rank 1 on host {socket.gethostname()} is behind for 3 log intervals to step 6:" in line
    assert "its data wait explains it" in line
    for rows in run["paces"]:
        fast, slow = rows
        assert slow["data_wait_seconds"] > 0.06 > fast["data_wait_seconds"] * 4
        assert slow["step_seconds"] > 2 * fast["step_seconds"]
        # the wall time per step is the same on both: rank 0 waited in the all-reduce
        assert fast["wall_seconds"] == pytest.approx(slow["wall_seconds"], rel=0.25)


def test_a_rank_slowed_in_its_forward_is_named_and_not_by_its_data(paced):
    run = paced[0]["slow-forward"]
    (line,) = stragglers(run["lines"])
    print(line)
    assert "rank 1 on host" in line and "to step 6:" in line and "not its data wait" in line
    last = run["paces"][-1]
    assert last[1]["step_seconds"] - last[0]["step_seconds"] > 0.04


# ---------------------------------------------------------------- the estimate and the watch, by themselves

def sums(data, forward, backward, optimizer, wait_for_others, steps=10):
    """FIELDS sums of one rank: per-step seconds times ``steps``; the wait is inside forward + backward."""
    fb = forward + backward + wait_for_others
    wall = data + fb + optimizer
    return [steps, data * steps, forward * steps, fb * steps, optimizer * steps, wall * steps]


def test_own_seconds_leave_the_wait_for_other_ranks_out_whichever_part_is_slow():
    # rank 2's data takes 0.2 s more: ranks 0 and 1 wait 0.2 s in the all-reduce
    slow_data = [sums(0.001, 0.01, 0.02, 0.005, 0.2), sums(0.001, 0.01, 0.02, 0.005, 0.2), sums(0.201, 0.01, 0.02, 0.005, 0)]
    assert own_seconds(slow_data) == pytest.approx([0.036, 0.036, 0.236])
    # rank 1 computes 5x slower: rank 0 waits 0.12 s
    slow_compute = [sums(0.001, 0.01, 0.02, 0.005, 0.12), sums(0.001, 0.05, 0.1, 0.005, 0)]
    assert own_seconds(slow_compute) == pytest.approx([0.036, 0.156])


def test_the_watch_names_a_rank_after_three_intervals_once_and_again_only_after_it_kept_up():
    watch = StragglerWatch()
    even, behind = [0.03, 0.03, 0.03], [0.03, 0.2, 0.03]
    assert [watch.update(behind) for _ in range(2)] == [[], []]
    assert watch.update(behind) == [(1, 0.03)]
    assert [watch.update(behind) for _ in range(5)] == [[]] * 5  # not every interval
    assert [watch.update(even) for _ in range(3)] == [[]] * 3  # kept up for 3 intervals: forgiven
    assert [watch.update(behind) for _ in range(3)] == [[], [], [(1, 0.03)]]


@pytest.mark.parametrize("own", [
    [0.004, 0.012, 0.005],  # 2.4x the median, but by 7 ms: a loaded machine's jitter
    [0.30, 0.52, 0.31],  # 170 ms more, but 1.7x
])
def test_the_watch_needs_both_the_ratio_and_the_floor(own):
    watch = StragglerWatch()
    assert [watch.update(own) for _ in range(10)] == [[]] * 10


def test_the_line_says_by_how_much_and_whether_the_data_wait_explains_it():
    p = RankPace(rank=3, host="n3", step_seconds=0.25, data_wait_seconds=0.21, wall_seconds=0.26, samples_per_second=128)
    line = straggler_line(p, median=0.05, others_wait=0.01, intervals=3, global_step=60)
    assert line == ("straggler: rank 3 on host n3 is behind for 3 log intervals to step 60: 0.250 s of its own per "
                    "step, 5.0x the other ranks' median 0.050 s (+0.200 s); its data wait explains it "
                    "(0.210 s per step, the others' 0.010 s)")
    assert "not its data wait" in straggler_line(RankPace(3, "n3", 0.25, 0.02, 0.26, 128), 0.05, 0.01, 3, 60)
