"""The run journal: written in the background through the kit's storage, never in training's way; its
accounting of the wall time; rank 0's share (attempt, first step, checkpoints, goodput); ``ray-app runs``."""

from __future__ import annotations

import json
import threading
import time

import pytest

from ray_app.shared import journal
from ray_app.shared.lease import RunLease, lease_store
from ray_app.shared.storage import LocalStorage


class StalledStore:
    """A store whose writes hang until ``release`` (a slow or unreachable S3), then go to a real folder."""

    def __init__(self, root, fail_first: int = 0):
        self.real = LocalStorage(str(root))
        self.gate = threading.Event()
        self.fail_first = fail_first
        self.calls = 0

    def uri(self, *parts):
        return self.real.uri(*parts)

    def write_bytes(self, rel, data):
        self.calls += 1
        if self.calls <= self.fail_first:
            raise ConnectionError("store unreachable")
        self.gate.wait()
        self.real.write_bytes(rel, data)


def _events(t0: float, *spec) -> list[dict]:
    """Events from (offset seconds, kind, fields) tuples."""
    return [{"kind": kind, "time": t0 + dt, "source": "test", **fields} for dt, kind, fields in spec]


# a launch with a worker killed (restart), a preemption, and an outage waited out
KILL_PREEMPT_OUTAGE = (
    (0, "launch", {"launch": "L"}),
    (4, "attempt", {"attempt": "a", "resumed_from_step": 0, "world_size": 2, "hosts": ["h1", "h2"]}),
    (6, "first_step", {"attempt": "a", "global_step": 1}),
    (16, "checkpoint", {"attempt": "a", "global_step": 50, "blocked_seconds": 0.5, "eval_seconds": 1.0}),
    (20, "outage", {"where": "s3://b", "during": "upload", "seconds": 3.0}),
    (24, "restart", {"cause": "rank 1: ActorDiedError: the actor died unexpectedly", "count": "restart 1 of 3"}),
    (30, "attempt", {"attempt": "b", "resumed_from_step": 50, "world_size": 2, "hosts": ["h1", "h2"]}),
    (31, "first_step", {"attempt": "b", "global_step": 51}),
    (40, "checkpoint", {"attempt": "b", "global_step": 90, "blocked_seconds": 0.5, "eval_seconds": 0.0}),
    (41, "preemption", {"cause": "rank 0: Preempted: preempted at step 90"}),
    (45, "attempt", {"attempt": "c", "resumed_from_step": 90, "world_size": 2, "hosts": ["h1", "h3"]}),
    (46, "first_step", {"attempt": "c", "global_step": 91}),
    (60, "checkpoint", {"attempt": "c", "global_step": 150, "blocked_seconds": 1.0, "eval_seconds": 2.0}),
    (61, "trained", {"attempt": "c", "global_step": 150, "eval_seconds": 2.0}),
    (63, "end", {"exit_code": 0, "global_step": 150}),
)


def test_the_parts_of_a_run_with_a_kill_a_preemption_and_an_outage_sum_to_its_wall_time():
    out = journal.account(_events(1000.0, *KILL_PREEMPT_OUTAGE))
    p = out["parts"]
    assert out["wall_seconds"] == 63.0 and sum(p.values()) == pytest.approx(63.0)
    assert p["startup"] == pytest.approx(6 + 2)  # to the first step; after the loop ended
    assert p["restarts"] == pytest.approx(7 + 5)  # restart -> first step of the next attempt, twice
    assert p["recomputed"] == pytest.approx(24 - 16 + 41 - 40)  # after the checkpoint each next attempt resumed
    assert p["checkpoint_blocked"] == pytest.approx(2.0) and p["evaluation"] == pytest.approx(3.0)
    assert p["productive"] == pytest.approx(10 - 1.5 + 9 - 0.5 + 15 - 3)
    assert out["goodput_ratio"] == pytest.approx(p["productive"] / 63.0, abs=1e-4)


def test_an_attempt_that_committed_nothing_is_recomputed_whole_and_one_that_never_stepped_is_restart_time():
    out = journal.account(_events(0.0,
                                  (0, "launch", {}),
                                  (2, "attempt", {"attempt": "a", "resumed_from_step": 0}),
                                  (3, "first_step", {"attempt": "a"}),
                                  (10, "restart", {"cause": "x"}),
                                  (12, "restart", {"cause": "a group that did not start"}),  # no attempt between
                                  (15, "attempt", {"attempt": "c", "resumed_from_step": 0}),
                                  (16, "first_step", {"attempt": "c"}),
                                  (20, "end", {"exit_code": 0})))
    assert out["parts"] == {"productive": 4.0, "startup": 3.0, "restarts": 2.0 + 4.0, "recomputed": 7.0,
                            "checkpoint_blocked": 0.0, "evaluation": 0.0}


def test_time_between_launches_is_not_counted_and_a_running_launch_counts_to_now():
    events = _events(0.0, (0, "launch", {}), (1, "attempt", {"attempt": "a"}), (2, "first_step", {"attempt": "a"}),
                     (10, "end", {"exit_code": 143}),
                     (1000, "launch", {}), (1001, "attempt", {"attempt": "b"}), (1002, "first_step", {"attempt": "b"}))
    assert journal.account(events)["wall_seconds"] == pytest.approx(10 + 2)  # the second: to its last event
    live = journal.account(events, now=1010.0)
    assert live["wall_seconds"] == pytest.approx(10 + 10) and live["parts"]["productive"] == pytest.approx(8 + 8)


@pytest.mark.timeout(30)
def test_a_stalled_store_never_blocks_record_and_a_full_queue_drops_and_counts(tmp_path):
    store = StalledStore(tmp_path)
    w = journal.JournalWriter(store, "r", source="rank0", capacity=4)
    w.record("checkpoint", global_step=0)
    deadline = time.time() + 5
    while store.calls == 0 and time.time() < deadline:  # the thread hangs in its first write
        time.sleep(0.01)
    t0 = time.perf_counter()
    for i in range(1, 20):
        w.record("checkpoint", global_step=i)
    assert time.perf_counter() - t0 < 0.05  # a store that does not answer costs training nothing
    assert w.dropped == 19 - 4  # the queue holds 4 beside the one being written
    assert not w.flush(0.2)
    store.gate.set()
    assert w.flush(5.0)
    names = journal.list_names(store.real, "r")
    assert len(names) == 5 and names == sorted(names)
    steps = [e["global_step"] for e in journal.read_events(store.real, "r")]
    assert steps == [0, 1, 2, 3, 4]  # the first ones kept, in order; the rest dropped and counted


@pytest.mark.timeout(30)
def test_an_unreachable_store_is_retried_until_it_answers(tmp_path):
    store = StalledStore(tmp_path, fail_first=2)
    store.gate.set()
    w = journal.JournalWriter(store, "r", source="driver")
    w.record("launch", launch="L")
    assert w.flush(10.0) and w.failed == 0
    assert [e["kind"] for e in journal.read_events(store.real, "r")] == ["launch"]


def test_record_never_raises_and_one_writer_serves_a_run_per_process(tmp_path):
    storage = LocalStorage(str(tmp_path))
    journal.record(storage, "r", "hang_report", ranks=[1], step=7, report="reports/x")
    journal.record(object(), "r", "anything")  # not a store: nothing written, nothing raised
    assert journal.writer(storage, "r") is journal.writer(storage, "r")
    assert journal.flush(5.0)
    (event,) = journal.read_events(storage, "r")
    assert event["kind"] == "hang_report" and event["ranks"] == [1] and event["time"] > 0
    assert journal.describe_event(event) == "hang_report: ranks [1], report reports/x, step 7"


def test_with_the_journal_off_no_process_writes_an_event(tmp_path, monkeypatch):
    """RAY_APP_JOURNAL=0 (the bench's "off" arm of case j): no writer in any process, rank 0 adds no sink."""
    from ray_app.shared.config import Config
    from ray_app.worker.entry import journal_sink

    storage = LocalStorage(str(tmp_path))
    monkeypatch.setenv(journal.OFF_ENV, "0")
    journal.record(storage, "quiet", "launch", mode="train")
    assert journal.writer(storage, "quiet") is None
    assert journal_sink(Config(), storage, {"launch_id": "x"}, ["h"], None) == []
    assert journal.flush(5.0) and journal.list_names(storage, "quiet") == []
    monkeypatch.setenv(journal.OFF_ENV, "1")
    (sink,) = journal_sink(Config(), storage, {"launch_id": "x"}, ["h"], None)
    assert isinstance(sink, journal.JournalSink) and journal.writer(storage, "quiet") is not None


class Gauge:
    def __init__(self):
        self.values = []

    def on_goodput(self, ratio):
        self.values.append(ratio)


@pytest.mark.timeout(30)
def test_rank0s_sink_records_the_attempt_first_step_checkpoints_and_the_goodput_of_the_whole_run(tmp_path):
    storage = LocalStorage(str(tmp_path))
    now = [100.0]
    earlier = journal.JournalWriter(storage, "r", source="driver", clock=lambda: now[0])
    earlier.context = {"launch": "L"}
    earlier.record("launch")
    earlier.record("restart", cause="rank 1: killed")  # an earlier attempt, before its first step
    now[0] = 110.0
    assert earlier.flush(5.0)
    w = journal.JournalWriter(storage, "r", source="rank0", clock=lambda: now[0])
    gauge = Gauge()
    sink = journal.JournalSink(w, storage, "r", launch="L", hosts=["h1", "h2"], goodput=gauge, clock=lambda: now[0])
    sink.start(world_size=2, resumed_from_step=0, global_step=0)
    deadline = time.time() + 5
    while sink.history is None and time.time() < deadline:
        time.sleep(0.01)
    now[0] = 112.0
    sink.on_step(0.1)
    sink.on_step(0.1)
    now[0] = 120.0
    sink.on_step(0.1)
    now[0] = 124.0
    sink.on_eval({"loss": 1.0})  # 4 s of evaluation after the last step
    sink.on_checkpoint(blocked_seconds=1.5)  # staged: the blocked time is known before the commit
    now[0] = 126.0
    sink.on_checkpoint_committed("file:///r/ckpt-3", 3)
    sink.on_progress(epoch=0, global_step=3, lr=0.1, train_loss=1.0, samples=8, samples_per_second=1.0)
    # launch 100 -> now 126: 12 s to the first step, 14 s training of which 4 s eval and 1.5 s blocked
    assert gauge.values[-1] == pytest.approx((14 - 4 - 1.5) / 26, abs=1e-3)
    sink.close()
    kinds = [(e["kind"], e.get("attempt") == sink.attempt) for e in journal.read_events(storage, "r")]
    assert kinds == [("launch", False), ("restart", False), ("attempt", True), ("first_step", True),
                     ("checkpoint", True), ("trained", True)]
    ckpt = [e for e in journal.read_events(storage, "r") if e["kind"] == "checkpoint"][0]
    assert (ckpt["global_step"], ckpt["blocked_seconds"], ckpt["eval_seconds"]) == (3, 1.5, 4.0)
    attempt = [e for e in journal.read_events(storage, "r") if e["kind"] == "attempt"][0]
    assert attempt["hosts"] == ["h1", "h2"] and attempt["launch"] == "L" and attempt["world_size"] == 2


def test_a_checkpoint_committed_before_its_blocked_time_is_known_is_one_event(tmp_path):
    w = journal.JournalWriter(LocalStorage(str(tmp_path)), "r", source="rank0")
    sink = journal.JournalSink(w)
    sink.on_checkpoint_committed("u", 10)  # synchronous upload: the commit first
    sink.on_checkpoint(blocked_seconds=2.0)
    sink.on_checkpoint_committed("u2", 20)  # the run ends before its blocked time is known
    sink.close()
    ckpts = [(e["global_step"], e["blocked_seconds"]) for e in w.recorded if e["kind"] == "checkpoint"]
    assert ckpts == [(10, 2.0), (20, 0.0)]


def _cli(args, capsys):
    from ray_app.driver import cli

    capsys.readouterr()
    rc = cli.main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.timeout(60)
def test_runs_list_and_show_read_the_journal_and_the_lease(tmp_path, capsys, monkeypatch):
    import signal

    monkeypatch.setattr(signal, "signal", lambda *a: None)
    storage = LocalStorage(str(tmp_path))
    w = journal.JournalWriter(storage, "done", source="test")
    for e in _events(1000.0, *KILL_PREEMPT_OUTAGE):
        w.record(e.pop("kind"), **e)
    w2 = journal.JournalWriter(storage, "live", source="test")
    w2.record("launch", launch="M")
    w2.record("attempt", attempt="x", global_step=7)
    assert w.flush(5.0) and w2.flush(5.0)
    lease = RunLease(lease_store(storage, "live"), storage.uri("live"), 60.0, say=lambda m: None)
    lease.acquire()
    (tmp_path / "not-a-run").mkdir()
    try:
        rc, out, err = _cli(["runs", "list", str(tmp_path)], capsys)
        assert rc == 0 and err == "", err
        lines = out.splitlines()
        assert len(lines) == 2 and lines[0].startswith("done  finished  step 150  last event end at 1970")
        assert lines[1].startswith("live  running  step 7") and "held by" in lines[1] and "pid" in lines[1]
        rc, out, _ = _cli(["runs", "list", str(tmp_path), "--json"], capsys)
        assert [r["state"] for r in json.loads(out)] == ["finished", "running"]
    finally:
        lease.release()
    rc, out, _ = _cli(["runs", "show", str(tmp_path / "done")], capsys)
    assert rc == 0
    assert "restart: rank 1: ActorDiedError: the actor died unexpectedly (restart 1 of 3)" in out
    assert "preemption: rank 0: Preempted: preempted at step 90" in out
    assert "storage outage waited out: s3://b, 3.0 s during upload" in out
    assert "end: exit 0" in out and "wall time 63.0 s" in out
    rc, out, _ = _cli(["runs", "show", str(tmp_path / "done"), "--json"], capsys)
    shown = json.loads(out)
    assert shown["state"] == "finished" and sum(shown["parts"].values()) == pytest.approx(shown["wall_seconds"])
    assert [e["kind"] for e in shown["events"]][:3] == ["launch", "attempt", "first_step"]


@pytest.mark.timeout(60)
def test_runs_show_lists_each_attempts_seconds_from_its_worker_groups_start_to_its_first_step(tmp_path, capsys,
                                                                                               monkeypatch):
    """A restart and a preemption: each attempt's own figure (a compile cache kept across restarts shortens the
    later ones), and the seconds from the failure policy's decision; a first step without the figure (a journal
    written before it) says it was not recorded."""
    import signal

    monkeypatch.setattr(signal, "signal", lambda *a: None)
    storage = LocalStorage(str(tmp_path))
    w = journal.JournalWriter(storage, "r", source="test")
    took = {"a": 41.25, "b": 6.5}  # seconds from each worker group's start to its first step, as rank 0 measured
    for e in _events(1000.0, *KILL_PREEMPT_OUTAGE):
        if e["kind"] == "first_step" and e["attempt"] in took:
            e["seconds_to_first_step"] = took[e["attempt"]]
        w.record(e.pop("kind"), **e)
    assert w.flush(5.0)
    rc, out, err = _cli(["runs", "show", str(tmp_path / "r")], capsys)
    assert rc == 0 and err == "", err
    lines = out.splitlines()
    assert any(line.endswith("first step: step 51, 6.5 s after the worker group's start") for line in lines), out
    start = lines.index("seconds to the first step, by attempt (from the worker group's start; after a restart also "
                        "from its decision):")
    assert lines[start + 1:] == ["  1. attempt a, first of its launch, from step 0: 41.2 s",
                                 "  2. attempt b, after a restart, from step 50: 6.5 s (7.0 s after the restart's decision)",
                                 "  3. attempt c, after a preemption, from step 90: not recorded "
                                 "(5.0 s after the preemption's decision)"]
    rc, out, _ = _cli(["runs", "show", str(tmp_path / "r"), "--json"], capsys)
    assert [(a["attempt"], a["after"], a["seconds_to_first_step"]) for a in json.loads(out)["attempts"]] == [
        ("a", "first", 41.25), ("b", "restart", 6.5), ("c", "preemption", None)]


@pytest.mark.timeout(60)
def test_runs_show_names_each_unreadable_journal_file_and_runs_list_agrees(tmp_path, capsys, monkeypatch):
    """A journal file cut short (not JSON) and one that is JSON but no event: ``runs show`` names each in one
    line and leaves it out; ``runs list`` counts the readable events and says how many are not."""
    import signal

    monkeypatch.setattr(signal, "signal", lambda *a: None)
    storage = LocalStorage(str(tmp_path))
    w = journal.JournalWriter(storage, "r", source="test")
    for e in _events(1000.0, *KILL_PREEMPT_OUTAGE[:8]):
        w.record(e.pop("kind"), **e)
    assert w.flush(5.0)
    names = journal.list_names(storage, "r")
    events_dir = tmp_path / "r" / journal.EVENTS
    (events_dir / names[-1]).write_bytes(b'{"kind": "first_st')  # the newest event, its write cut short
    (events_dir / names[2]).write_text(json.dumps(["not", "an", "event"]))

    rc, out, err = _cli(["runs", "show", str(tmp_path / "r")], capsys)
    assert rc == 0
    assert err.splitlines() == [
        f"ray-app: events/{names[2]}: not readable (not an event: no kind or time), left out",
        f"ray-app: events/{names[-1]}: not readable (JSONDecodeError: Unterminated string starting at: line 1 column 10 "
        "(char 9)), left out"], err
    assert "restart: rank 1: ActorDiedError" in out and "first step: step 51" not in out
    rc, out, err = _cli(["runs", "show", str(tmp_path / "r"), "--json"], capsys)
    shown = json.loads(out)
    assert len(shown["events"]) == 6 and [u["name"] for u in shown["unreadable"]] == [f"events/{n}" for n in (names[2], names[-1])]

    rc, out, err = _cli(["runs", "list", str(tmp_path)], capsys)
    assert rc == 0 and err == "", err
    assert out.startswith("r  lost  step 50  last event attempt at 1970") and out.rstrip().endswith(
        "  2 of 8 events not readable"), out
    rc, out, _ = _cli(["runs", "list", str(tmp_path), "--json"], capsys)
    row = json.loads(out)[0]
    assert (row["events"], row["unreadable"], row["last_event"]) == (6, 2, "attempt"), row

    for name in names:  # none readable: named each, then one line that the run has no readable journal
        (events_dir / name).write_bytes(b"\x00garbage")
    rc, out, err = _cli(["runs", "list", str(tmp_path)], capsys)
    assert "last event none readable  8 of 8 events not readable" in out, out
    rc, out, err = _cli(["runs", "show", str(tmp_path / "r")], capsys)
    assert rc == 2 and len(err.splitlines()) == 9 and "has 8 journal files, none of them readable" in err, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, names", [
    (["runs", "show", "{tmp}/nothing"], ["has no journal", "ray-app runs list"]),
    (["runs", "list", "{tmp}/missing"], ["no such folder", "run.storage"]),
    (["runs", "show", "s3://"], ["expected a run URI"]),
    (["runs", "frob", "x"], ["invalid choice"]),
])
def test_bad_input_to_runs_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, args, names):
    import signal

    monkeypatch.setattr(signal, "signal", lambda *a: None)
    with pytest.raises(SystemExit) if args[1] == "frob" else _no_raise() as exited:
        rc, _, err = _cli([a.format(tmp=tmp_path) for a in args], capsys)
    if exited is not None:
        rc, err = exited.value.code, capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("ray-app: error:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert all(n in lines[0] for n in names), lines[0]
    assert not (tmp_path / "missing").exists()  # read-only: nothing made


class _no_raise:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.timeout(60)
def test_the_failure_policy_journals_each_restart_preemption_and_divergence_with_its_cause(tmp_path, capsys):
    """The policy travels to Ray Train's controller pickled; there it writes each decision's event, the cause
    as the restart line names it."""
    from ray import cloudpickle
    from ray.train import FailureConfig
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from ray.train.v2.api.exceptions import WorkerGroupError

    from ray_app.controller.failure_policy import KitFailurePolicy
    from ray_app.shared.errors import Diverged, Preempted

    sent = KitFailurePolicy(FailureConfig(max_failures=3), journal_of=(str(tmp_path), "r", "L1"))
    policy = cloudpickle.loads(cloudpickle.dumps(sent))
    decide = lambda errors: policy.make_decision(WorkerGroupError("x", errors))  # noqa: E731
    assert decide({1: RuntimeError("the actor died unexpectedly")}) == FailureDecision.RETRY
    assert decide({0: Preempted("preempted at step 12"), 1: Preempted("preempted at step 12")}) == FailureDecision.RETRY
    assert decide({0: Diverged("training diverged at step 20"), 1: Diverged("x")}) == FailureDecision.RAISE
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("ray-app: ")][0]
    events = journal.read_events(LocalStorage(str(tmp_path)), "r")
    assert [(e["kind"], e["launch"]) for e in events] == [("restart", "L1"), ("preemption", "L1"), ("diverged", "L1")]
    restart, preemption, diverged = events
    assert line == f"ray-app: {restart['cause']}; the worker group restarts from the newest committed checkpoint " \
                   f"({restart['count']})"
    assert restart["cause"] == "rank 1: RuntimeError: the actor died unexpectedly"
    assert restart["count"] == "restart 1 of 3: failure.max_failures"
    assert preemption["cause"] == "rank 0: Preempted: preempted at step 12"
    assert diverged["cause"] == "training diverged at step 20"


def test_the_driver_hands_the_policy_where_the_journal_is(monkeypatch, tmp_path):
    from ray_app.driver import launcher as driver
    from ray_app.shared.config import load_config

    lean = driver.lean_trainer_class()
    base = next(c for c in lean.__mro__[1:] if "_initialize_and_run_controller" in vars(c))
    seen = {}
    monkeypatch.setattr(base, "_initialize_and_run_controller", lambda self, **kw: seen.update(kw))
    cfg = load_config(None, [f"run.storage={tmp_path}"])
    trainer = driver.build_trainer(cfg, {"mode": "train"}, None, "r", str(tmp_path))
    trainer.failure_policy_kwargs = {"journal_of": (str(tmp_path), "r", "L2")}
    trainer._initialize_and_run_controller(failure_policy=None)
    assert seen["failure_policy"].journal_of == (str(tmp_path), "r", "L2")
