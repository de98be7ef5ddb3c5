"""The hang report: every rank's collective counter, its stacks in storage, and the verdict naming the rank
that did not arrive (real gloo groups in spawned processes; a rank stopped with SIGSTOP, one stuck in its
own code)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ray_app.controller import hang_verdict
from ray_app.shared import reports as stored
from ray_app.shared.storage import LocalStorage
from ray_app.worker import watchdog as rank_watchdog
from ray_app.worker.collectives import COUNTER, CollectiveCounter, Position
from tests.support.ports import free_port
from tests.support.ranks import rank_context

HANG_TIMEOUT_S = 5.0  # the collectives' timeout in the spawned groups: the report comes 2 s before it


# ---------------------------------------------------------------- in every spawned rank

def _init(rank: int, world: int, port: int, timeout_s: float = 60) -> None:
    torch.set_num_threads(1)  # 2 shared cores: no oversubscription
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def _counted_collectives(rank: int, world: int, port: int, out: str) -> None:
    """The kit's collectives, as the loop calls them; each rank writes the positions it went through."""
    from ray_app.worker.ddp import ExactSums, assert_identical_parameters, gather_eval_rows, global_mean
    from ray_app.worker.preemption import Agreement

    _init(rank, world, port)
    COUNTER.reset()
    seen = []
    note = lambda: seen.append(COUNTER.position.as_dict())  # noqa: E731
    assert_identical_parameters(_same_model())
    note()
    global_mean(torch.tensor(float(rank)), torch.tensor(1.0))
    note()
    sums = ExactSums(1, torch.device("cpu"))
    sums.add(torch.ones(3, 1, dtype=torch.float64), torch.ones(3, dtype=torch.bool))
    sums.all_reduce()
    note()
    gather_eval_rows(torch.arange(2) + 2 * rank, torch.ones(2, 1), world)
    note()
    flag = Agreement()
    for _ in range(3):  # the first poll starts the flag's all-reduce; the next ones wait for it
        flag.poll()
        note()
    flag.close()
    note()
    Path(out, f"rank-{rank}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


def _same_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(2, 2)


def _hung_rank(rank: int, world: int, port: int, folder: str) -> None:
    """Rank 0 waits in the global loss's all-reduce; rank 1 stops itself (SIGSTOP) before it; rank 2 is
    stuck in its own code (a sleep) and never calls it."""
    from ray_app.worker.ddp import global_mean

    _init(rank, world, port, timeout_s=HANG_TIMEOUT_S)
    storage = LocalStorage(folder)
    watchdog = rank_watchdog.start_watchdog(storage, "run", "20260101T000000Z", HANG_TIMEOUT_S, rank, world)
    COUNTER.enter("gradient all-reduce (backward)", step=57)  # a step's collectives, all ranks alike
    COUNTER.leave()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    if rank == 2:
        _users_own_code_that_never_returns()
    try:
        global_mean(torch.tensor(1.0), torch.tensor(1.0))
    except Exception:  # the collective's timeout, on the rank still alive
        pass
    watchdog.fired.wait(30)
    time.sleep(1)  # the watchdog's upload, after it set the event
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


def _users_own_code_that_never_returns() -> None:
    time.sleep(120)


# ---------------------------------------------------------------- tests

@pytest.mark.timeout(90)
def test_every_rank_counts_the_kits_collectives_in_the_same_order_on_a_real_gloo_group(tmp_path):
    ctx = rank_context()
    port = free_port()
    procs = [ctx.Process(target=_counted_collectives, args=(r, 2, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(80)
    assert [p.exitcode for p in procs] == [0, 0]
    seen = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert seen[0] == seen[1]  # the ranks' counters line up
    assert [(s["seq"], s["name"], s["inside"]) for s in seen[0]] == [
        (1, "parameter check (all_reduce)", False),
        (2, "global loss (all_reduce)", False),
        (3, "eval sums (all_reduce)", False),
        (4, "eval rows (all_gather)", False),
        (4, "eval rows (all_gather)", False),  # the first poll only starts the flag's all-reduce
        (5, "preemption flag (all_reduce)", False),
        (6, "preemption flag (all_reduce)", False),
        (7, "preemption flag (all_reduce)", False),
    ]


def test_counting_a_collective_costs_microseconds_and_no_io():
    counter = CollectiveCounter()
    n = 100_000
    t0 = time.perf_counter()
    for step in range(n):
        with counter.entered("gradient all-reduce (backward)", step):
            pass
    per = (time.perf_counter() - t0) / n
    print(f"\n[hang] counting one collective: {per * 1e6:.2f} us")
    assert counter.position.seq == n and counter.position.step == n - 1 and not counter.position.inside
    assert counter.position.thread == threading.get_ident()
    assert per < 50e-6  # a DDP step of the smallest model takes milliseconds


@pytest.mark.timeout(100)
def test_a_stopped_rank_and_a_stuck_one_are_named_and_the_waiting_ranks_stacks_are_in_storage(tmp_path):
    ctx = rank_context()
    port = free_port()
    procs = [ctx.Process(target=_hung_rank, args=(r, 3, port, str(tmp_path))) for r in range(3)]
    for p in procs:
        p.start()
    folder = tmp_path / "run" / "reports" / "20260101T000000Z-attempt-1"
    try:
        deadline = time.monotonic() + 80
        while time.monotonic() < deadline and not all((folder / f"rank-{r}.json").exists() for r in (0, 2)):
            time.sleep(0.2)
    finally:
        for p in procs:  # the stopped rank, the stuck one: killed, as Ray Train kills a hung group
            if p.pid is not None and p.exitcode is None:
                os.kill(p.pid, signal.SIGKILL)
            p.join(10)
    assert sorted(f.name for f in folder.iterdir()) == ["rank-0.json", "rank-0.txt", "rank-2.json", "rank-2.txt"]
    reports = stored.read_reports(LocalStorage(str(tmp_path)), "run/reports/20260101T000000Z-attempt-1")
    waiting, stuck = reports
    # the waiting rank wrote a little before the collective's timeout, from inside it
    assert (waiting.rank, waiting.seq, waiting.name, waiting.step, waiting.inside) == (0, 3, "global loss (all_reduce)", 57, True)
    assert stored.fire_after(HANG_TIMEOUT_S) <= waiting.waited_s < HANG_TIMEOUT_S, waiting.waited_s
    assert waiting.stacks.startswith('Thread "MainThread" (id ') and ", entered the collective)" in waiting.stacks
    assert "in global_sum_and_count" in waiting.stacks
    assert 'Thread "ray-app-hang-watchdog"' in waiting.stacks  # every thread, the watchdog's own included
    # the stuck rank wrote too, once the other's report was there: its stack shows where it is
    assert (stuck.rank, stuck.seq, stuck.inside) == (2, 2, False)
    assert "in _users_own_code_that_never_returns" in stuck.stacks
    assert (folder / "rank-2.txt").read_text() == stuck.stacks

    found = hang_verdict.verdict(reports)
    assert (found.missing, [r.rank for r in found.behind], found.waiting) == ([1], [2], [0])
    host = waiting.hosts[1]
    line = found.line("/x/reports/a/")
    print(f"\n[hang] {line}")
    assert line == (f"hang: rank 1 (host {host}; no report: stopped or gone), rank 2 (host {host}; after "
                    "gradient all-reduce (backward) #2 at step 57) did not reach global loss (all_reduce) #3 at step 57 "
                    "that rank 0 waits in; stacks in /x/reports/a/")


def _report(rank: int, seq: int, inside: bool, name: str = "global loss (all_reduce)", step: int = 8,
            world: int = 4) -> stored.RankReport:
    return stored.RankReport(rank=rank, world_size=world, hosts=[f"h{k}" for k in range(world)], seq=seq, name=name,
                           step=step, inside=inside, waited_s=12.0, why="test")


def test_the_verdict_names_the_ranks_that_did_not_reach_the_collective_the_others_wait_in():
    found = hang_verdict.verdict([_report(0, 9, True), _report(2, 9, True), _report(3, 9, True)])
    assert found.absent == [1]
    assert found.line("s3://b/r/reports/x/") == ("hang: rank 1 (host h1; no report: stopped or gone) did not reach "
                                                 "global loss (all_reduce) #9 at step 8 that ranks 0,2,3 wait in; "
                                                 "stacks in s3://b/r/reports/x/")
    # a rank inside an earlier collective is behind too (it waits for something the others never call)
    found = hang_verdict.verdict([_report(0, 9, True), _report(1, 8, True, "eval sums (all_reduce)"), _report(2, 9, True)])
    assert found.absent == [1, 3] and found.waiting == [0, 2]
    assert "rank 1 (host h1; in eval sums (all_reduce) #8 at step 8)" in found.line("w")
    # every rank inside the same collective: none is missing, the collective itself did not return
    everyone = hang_verdict.verdict([_report(r, 9, True) for r in range(4)])
    assert everyone.absent == [] and "every rank waits in global loss (all_reduce) #9" in everyone.line("w")
    # a rank already past it (it returned on that rank) is not blamed
    assert hang_verdict.verdict([_report(0, 9, True), _report(1, 9, False), _report(2, 9, True), _report(3, 9, True)]).absent == []
    assert hang_verdict.verdict([_report(0, 0, False)]).line("w").startswith("hang: no rank waits in a collective")
    assert hang_verdict.verdict([]) is None


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_watchdog_fires_inside_one_collective_for_too_long_and_asks_others_only_when_stale():
    clock, counter, asked = Clock(), CollectiveCounter(), []
    counter.position = Position(seq=4, name="global loss (all_reduce)", step=3, inside=True, since=clock.now)
    dog = rank_watchdog.Watchdog(counter, after_s=8.0, write=None, others_reported=lambda: asked.append(clock.now) or True,
                        ask_every_s=2.0, clock=clock)
    clock.now += 7.9
    assert dog.check() is None
    clock.now += 0.2
    assert dog.check() == "inside global loss (all_reduce) #4 at step 3 for 8.1 s" and asked == []
    # outside any collective: only a counter unmoved for as long asks whether others reported, every 2 s
    counter.position = Position(seq=4, name="global loss (all_reduce)", step=3, inside=False, since=clock.now)
    clock.now += 5.0
    assert dog.check() is None and asked == []
    clock.now += 3.0
    assert dog.check().startswith("no collective entered for 8.0 s (the last: global loss (all_reduce) #4 at step 3)")
    clock.now += 1.0
    dog.others_reported = lambda: False
    assert dog.check() is None and len(asked) == 1  # asked again only after ask_every_s
    assert stored.fire_after(15) == 12 and stored.fire_after(300) == 270 and stored.fire_after(10) == 8


def test_stacks_cover_every_thread_with_its_name():
    release = threading.Event()

    def waiting_for_the_release():
        release.wait(10)

    t = threading.Thread(target=waiting_for_the_release, name="a-waiting-thread")
    t.start()
    try:
        text = rank_watchdog.stacks_text(first=t.ident)
    finally:
        release.set()
        t.join()
    # the thread that entered the collective first, then the main thread
    assert text.startswith(f'Thread "a-waiting-thread" (id {t.ident}, entered the collective):')
    assert text.index("in waiting_for_the_release") < text.index('Thread "MainThread"') < \
        text.index("in test_stacks_cover_every_thread_with_its_name")


def test_the_failure_policy_says_the_newest_attempts_verdict_once_before_the_restart(tmp_path, capsys):
    from ray.train import FailureConfig
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from ray.train.v2.api.exceptions import WorkerGroupError

    from ray_app.controller.failure_policy import KitFailurePolicy

    storage = LocalStorage(str(tmp_path))
    for attempt, seq in ((1, 5), (2, 9)):
        for rank in (0, 2, 3):
            stored.write_report(storage, stored.attempt_folder("r", "20260101T000000Z", attempt), _report(rank, seq, True))
    policy = KitFailurePolicy(FailureConfig(max_failures=5), hang_reports=hang_verdict.HangReports(str(tmp_path), "r", "20260101T000000Z"))
    lost = WorkerGroupError("x", {1: RuntimeError("the health check timed out")})
    assert policy.make_decision(lost) == FailureDecision.RETRY
    out = capsys.readouterr().out.splitlines()
    where = f"{tmp_path}/r/reports/20260101T000000Z-attempt-2/"
    assert out[0] == (f"ray-app: hang: rank 1 (host h1; no report: stopped or gone) did not reach global loss (all_reduce) "
                      f"#9 at step 8 that ranks 0,2,3 wait in; stacks in {where}")
    assert out[1].startswith("ray-app: rank 1: RuntimeError: the health check timed out; the worker group restarts")
    verdict = json.loads((tmp_path / "r/reports/20260101T000000Z-attempt-2/verdict.json").read_text())
    assert verdict["line"] == out[0][len("ray-app: "):] and verdict["did_not_arrive"] == [1]  # kept beside the reports
    assert (verdict["collective"], verdict["seq"], verdict["step"], verdict["waiting"]) == ("global loss (all_reduce)", 9, 8, [0, 2, 3])
    policy.make_decision(lost)  # another failure, no new reports: no hang line again
    assert "hang:" not in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_reports_go_to_s3_and_the_line_names_the_folder_there(s3, monkeypatch):
    """Through the kit's storage on a real S3 API server (moto_server): each rank's two objects, read back
    by the failure policy's reader, and the line's folder is the s3:// URI."""
    from ray_app.shared.storage import S3Storage

    for key, value in s3.env().items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)
    uri = f"s3://{s3.bucket}/hang-runs"
    storage = S3Storage(uri, retry_s=5)
    folder = stored.attempt_folder("r", "20260101T000000Z", 1)
    for rank in (0, 1, 3):
        stored.write_report(storage, folder, _report(rank, 12, True, step=40))
    assert sorted(storage.list_files(folder)) == [f"rank-{r}.{x}" for r in (0, 1, 3) for x in ("json", "txt")]
    line = hang_verdict.HangReports(uri, "r", "20260101T000000Z").line()
    assert line == ("hang: rank 2 (host h2; no report: stopped or gone) did not reach global loss (all_reduce) #12 at "
                    f"step 40 that ranks 0,1,3 wait in; stacks in {uri}/r/reports/20260101T000000Z-attempt-1/")


@pytest.mark.timeout(60)
def test_a_storage_outage_is_said_as_one_not_as_a_hang(tmp_path, capsys, monkeypatch):
    """Rank 0 gave up on the store (the other rank lost its peer): the policy's line says storage, not hang,
    and reads no report. Reports that cannot be read because the store does not answer: the same."""
    from ray.train import FailureConfig
    from ray.train.v2.api.exceptions import WorkerGroupError

    from ray_app.controller.failure_policy import KitFailurePolicy
    from ray_app.shared.errors import PeerLost, StorageUnavailable

    gave_up = StorageUnavailable("storage s3://b at http://127.0.0.1:9: no answer for 20 s during upload of r/x "
                                 "(ReadTimeoutError), retried for up to 20 s (failure.storage_retry_s); the worker "
                                 "group restarts from the newest committed checkpoint")
    policy = KitFailurePolicy(FailureConfig(max_failures=5),
                              hang_reports=hang_verdict.HangReports(str(tmp_path), "r", "20260101T000000Z"))
    policy.make_decision(WorkerGroupError("x", {0: gave_up, 1: PeerLost("gloo: Connection closed by peer")}))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "ray-app: storage unavailable (not a hang): rank 0 gave up on the store; no hang report read", out
    assert out[1].startswith(f"ray-app: {str(gave_up).split('; the worker')[0]}"), out  # the restart names the store
    assert not any("hang:" in line for line in out), out

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    for key, value in dict(AWS_ACCESS_KEY_ID="AKIAEXAMPLE", AWS_SECRET_ACCESS_KEY="x", AWS_REGION="us-east-1").items():
        monkeypatch.setenv(key, value)
    reports = hang_verdict.HangReports("s3://b/runs", "r", "20260101T000000Z", retry_s=1)
    line = reports.line({1: RuntimeError("the health check timed out")})
    assert line.startswith("storage unavailable: the hang reports under s3://b/runs could not be read (storage s3://b"), line
    assert "retried for up to 1 s (the hang reports' read: failure.storage_retry_s, at most 5 s)" in line, line


def test_with_nccl_a_stale_counter_reports_alone_and_the_verdict_reads_ranks_waiting_after_a_queued_collective():
    """nccl's collectives return once queued: a rank waits on one later, at its next sync with the GPU,
    outside the count. Its counter stops moving; it writes alone, once per position of the counter."""
    clock, counter = Clock(), CollectiveCounter()
    counter.position = Position(seq=7, name="gradient all-reduce (backward)", step=5, since=clock.now)
    written = []
    dog = rank_watchdog.Watchdog(counter, after_s=8.0, write=written.append, stale_alone=True, poll_s=0.01, clock=clock)
    clock.now += 9
    dog.start()
    try:
        assert dog.fired.wait(5)
        time.sleep(0.1)
        assert written == ["no collective entered for 9.0 s (the last: gradient all-reduce (backward) #7 at step 5)"]
        counter.position = Position(seq=8, name="global loss (all_reduce)", step=5, since=clock.now)  # it moved on
        clock.now += 9
        deadline = time.monotonic() + 5
        while len(written) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(written) == 2 and "#8" in written[1]
    finally:
        dog.stop()
    found = hang_verdict.verdict([_report(0, 9, False), _report(1, 9, False), _report(2, 8, False, "gradient all-reduce (backward)")])
    assert found.queued and found.absent == [2, 3] and found.waiting == [0, 1]
    assert found.line("w") == ("hang: rank 2 (host h2; after gradient all-reduce (backward) #8 at step 8), rank 3 (host h3; "
                               "no report: stopped or gone) did not reach global loss (all_reduce) #9 at step 8 that ranks "
                               "0,1 entered and wait on; stacks in w")


def test_reports_older_than_the_stall_that_failed_are_left_out(tmp_path):
    storage = LocalStorage(str(tmp_path))
    folder = stored.attempt_folder("r", "20260101T000000Z", 1)
    old = _report(0, 3, False)
    old.written_unix -= 3600  # a long evaluation an hour ago, no hang
    stored.write_report(storage, folder, old)
    assert hang_verdict.HangReports(str(tmp_path), "r", "20260101T000000Z", max_age_s=60).line() is None


def test_a_failure_that_looks_like_a_hang_waits_for_reports_still_on_their_way(tmp_path, capsys):
    """Ray Train's health check of a stopped rank can give up before the waiting rank's watchdog wrote (it
    entered its collective late): the policy waits up to ``wait_s`` for the reports; a killed worker
    (no timeout in its error) does not wait."""
    from ray.train import FailureConfig
    from ray.train.v2._internal.exceptions import WorkerHealthCheckTimeoutError
    from ray.train.v2.api.exceptions import WorkerGroupError

    from ray_app.controller.failure_policy import KitFailurePolicy

    storage = LocalStorage(str(tmp_path))
    reports = hang_verdict.HangReports(str(tmp_path), "r", "20260101T000000Z", wait_s=20)
    policy = KitFailurePolicy(FailureConfig(max_failures=5), hang_reports=reports)
    t0 = time.monotonic()
    policy.make_decision(WorkerGroupError("x", {1: RuntimeError("the actor died unexpectedly")}))
    assert time.monotonic() - t0 < 2 and "hang:" not in capsys.readouterr().out  # no wait, no line

    def late_reports():  # the waiting ranks write one after the other
        time.sleep(1.5)
        for rank in (0, 2):
            stored.write_report(storage, stored.attempt_folder("r", "20260101T000000Z", 1), _report(rank, 4, True, world=3))
            time.sleep(0.5)

    writer = threading.Thread(target=late_reports)
    writer.start()
    t0 = time.monotonic()
    policy.make_decision(WorkerGroupError("x", {1: WorkerHealthCheckTimeoutError("rank 1 did not answer")}))
    waited = time.monotonic() - t0
    writer.join()
    assert 1.5 <= waited < 10, waited
    # read once their number settled: both waiting ranks, and only the stopped one named
    assert "ray-app: hang: rank 1 (host h1; no report: stopped or gone) did not reach global loss (all_reduce) #4 at " \
        "step 8 that ranks 0,2 wait in" in capsys.readouterr().out
    assert hang_verdict.looks_hung({0: RuntimeError("[../gloo/transport/tcp/pair.cc:534] Timed out waiting 15000ms for recv")})
