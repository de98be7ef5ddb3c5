"""The run journal: an append-only record of a run's events in ``{run.storage}/{run.name}/events/``.

Each event is one small JSON object of its own, ``events/{unix_ns}-{source}-{kind}-{nonce}.json``: S3 has
no append, and names that start with the time list in the order they happened. An event holds its
``kind``, its ``time`` (unix seconds), the ``source`` that wrote it (the driver, the failure policy, rank 0)
and the fields of its kind:

===================  ===================  ==============================================================
kind                 written by           fields
===================  ===================  ==============================================================
launch               the driver           launch (its id), mode, host, pid, world_size (asked)
lease_taken_over     the driver           from (the holder it took the run from), why
attempt              rank 0               launch, attempt, world_size, hosts, resumed_from_step, global_step
first_step           rank 0               launch, attempt, global_step, seconds_to_first_step (from rank 0's
                                          worker entry: build, restore, the first step, its compile)
checkpoint           rank 0               launch, attempt, global_step, uri, blocked_seconds,
                                          eval_seconds (this attempt's evaluations so far)
outage               the driver, rank 0   where, during, seconds (an outage waited out)
restart              the failure policy   launch, cause (the failure table's line), count, rank, step
preemption           the failure policy   launch, cause, rank, step
diverged             the failure policy   launch, cause
hang_report          the driver           what the hang report says (its fields are the report's)
trained              rank 0               launch, attempt, global_step, eval_seconds (the loop ended)
end                  the driver           launch, exit_code, line, global_step
===================  ===================  ==============================================================

Writing never stands in the way of training: ``record`` only puts the event on a bounded queue that a
background thread writes through the kit's storage; when the store is slow or down the thread retries
with backoff, a full queue drops the new event and counts it, and nothing raises into the caller.
``flush`` waits (bounded) for what is queued, where a process is about to end.

``account`` splits a run's wall time, from its journal alone, into productive training, start-up,
restarts, steps recomputed after a failure, checkpoint blocking and evaluation; the parts sum to the wall
time. ``ray-app runs show`` prints it and rank 0 exports its ratio as ``ray_app_goodput_ratio``.
``first_steps`` lists each attempt's seconds from its worker group's start to its first step (what a
compile cache kept across restarts shortens), which ``runs show`` prints too.
"""

from __future__ import annotations

import json
import os
import queue
import re
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

EVENTS = "events"  # the journal's folder under the run's
CAPACITY = 512  # events a process holds while the store is slow; beyond, new ones are dropped (counted)
BOUNDARIES = ("restart", "preemption")  # events that end one worker-group attempt and start the next
PARTS = ("productive", "startup", "restarts", "recomputed", "checkpoint_blocked", "evaluation")
PART_NAMES = {"productive": "productive training", "startup": "start-up and shut-down",
              "restarts": "restarts", "recomputed": "steps recomputed after a failure",
              "checkpoint_blocked": "checkpoint blocking", "evaluation": "evaluation"}


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]+", "_", str(text))[:40] or "x"


def event_name(unix: float, source: str, kind: str) -> str:
    """The object name of one event: its time first (nanoseconds, fixed width), so names sort by time."""
    return f"{int(unix * 1e9):020d}-{_safe(source)}-{_safe(kind)}-{uuid.uuid4().hex[:6]}.json"


def default_source() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class JournalWriter:
    """One process's writer of one run's journal: ``record`` queues, a daemon thread writes.

    ``storage``: a ``LocalStorage`` or an ``S3Storage`` without retries of its own (the thread retries, so
    an outage is never waited out inside it, nor reported as an outage of the run)."""

    def __init__(self, storage, run: str, source: str | None = None, capacity: int = CAPACITY,
                 clock=time.time, retry_s: float = 300.0):
        self.storage, self.run, self.source = storage, run, source or default_source()
        self.clock, self.retry_s = clock, retry_s
        self.context: dict = {}  # fields every event of this writer carries (launch, attempt)
        self.recorded: list[dict] = []  # what this writer was given, in order (rank 0's goodput reads it)
        self.dropped = 0  # events the full queue refused
        self.failed = 0  # events the store would not take within retry_s
        self.written = 0
        self._queue: queue.Queue = queue.Queue(maxsize=capacity)
        self._thread = threading.Thread(target=self._run, name="ray-app-journal", daemon=True)
        self._thread.start()

    def record(self, kind: str, **fields) -> dict | None:
        """Queue one event; never raises, never blocks. Returns the event (None when dropped)."""
        try:
            event = {"kind": kind, "time": self.clock(), "source": self.source, **self.context, **fields}
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1
            return None
        except Exception:  # a field that is not JSON is found by the thread; nothing here may raise
            self.dropped += 1
            return None
        self.recorded.append(event)
        return event

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait up to ``timeout`` seconds until every queued event is written (or given up); whether it was."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self._queue.unfinished_tasks

    def _run(self) -> None:
        while True:
            event = self._queue.get()
            try:
                self._write(event)
            finally:
                self._queue.task_done()

    def _write(self, event: dict) -> None:
        try:
            body = json.dumps(event, sort_keys=True, default=str).encode()
        except Exception:
            self.failed += 1
            return
        rel = f"{self.run}/{EVENTS}/{event_name(event['time'], self.source, event['kind'])}"
        first, delay = time.monotonic(), 0.5
        while True:
            try:
                self.storage.write_bytes(rel, body)
                self.written += 1
                return
            except Exception:
                if time.monotonic() - first + delay > self.retry_s:
                    self.failed += 1
                    return
                time.sleep(delay)
                delay = min(delay * 2, 8.0)


# ---------------------------------------------------------------- one writer per run and process

_WRITERS: dict[str, JournalWriter] = {}
_LOCK = threading.Lock()


OFF_ENV = "RAY_APP_JOURNAL"  # "0": no journal in any process of the run (the bench measures its cost so)


def enabled(environ=None) -> bool:
    """Whether this process journals: always, unless ``RAY_APP_JOURNAL=0`` (set before the run starts, it
    reaches the driver, the failure policy and rank 0; ``runs show`` then has nothing to show)."""
    value = (os.environ if environ is None else environ).get(OFF_ENV, "").strip().lower()
    return value not in ("0", "false", "no", "off")


def writer(storage, run: str, source: str | None = None) -> JournalWriter | None:
    """This process's writer of ``run``'s journal in ``storage`` (made on first use); None if it cannot be
    or the journal is off (``enabled``)."""
    if not enabled():
        return None
    try:
        key = storage.uri(run)
        with _LOCK:
            found = _WRITERS.get(key)
            if found is None:
                found = _WRITERS[key] = JournalWriter(_unretried(storage), run, source)
            elif source:
                found.source = source
        return found
    except Exception:
        return None


def _unretried(storage):
    """The same store without the kit's retries (the writer's thread retries itself)."""
    settings = getattr(storage, "settings", None)
    if settings is None:
        return storage
    return type(storage)(storage.uri())


def record(storage, run: str, kind: str, **fields) -> None:
    """Add one event to ``run``'s journal in ``storage`` (a ``ray_app.shared.storage`` store): queued, written in
    the background, never raising, never blocking. ``kind``: one of the table's (or a new one: ``runs show``
    lists any kind on the timeline); ``fields``: JSON values."""
    w = writer(storage, run)
    if w is not None:
        w.record(kind, **fields)


def flush(timeout: float = 5.0) -> bool:
    """Wait up to ``timeout`` seconds in all until every writer of this process has written its queue."""
    deadline = time.monotonic() + timeout
    ok = True
    for w in list(_WRITERS.values()):
        ok = w.flush(max(0.0, deadline - time.monotonic())) and ok
    return ok


# ---------------------------------------------------------------- reading


READERS = 8  # events read at once (one small object each: on S3 a request each)


def read_journal(storage, run: str, names: list[str] | None = None) -> tuple[list[dict], list[tuple[str, str]]]:
    """The run's events in the order of their times, and its files that are no event, each ``(name, why)``
    (not JSON, not text, no kind or time: a write cut short, a file changed by hand), left out of the events.
    A store that cannot be read raises."""
    from ray_app.shared.errors import first_line

    if names is None:
        names = list_names(storage, run)
    with ThreadPoolExecutor(max_workers=READERS) as pool:
        bodies = list(pool.map(lambda name: storage.read_bytes(f"{run}/{EVENTS}/{name}"), names))
    events, unreadable = [], []
    for name, body in zip(names, bodies):
        try:
            event = json.loads(body)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            unreadable.append((name, f"{type(exc).__name__}: {first_line(exc)}"))
            continue
        if isinstance(event, dict) and "kind" in event and "time" in event:
            events.append(event)
        else:
            unreadable.append((name, "not an event: no kind or time"))
    events.sort(key=lambda e: float(e["time"]))
    return events, unreadable


def read_events(storage, run: str, names: list[str] | None = None) -> list[dict]:
    """The run's events in the order of their times; a file that is no event is left out (``read_journal``)."""
    return read_journal(storage, run, names)[0]


def restarts_of(storage, run: str, launch: str) -> list[dict] | None:
    """The worker-group restarts of one launch, oldest first (its ``BOUNDARIES`` events: the failure policy's
    restarts and preemptions), each with its kind, cause, rank and step (None where not known); None when
    the journal is off (``enabled``: nothing recorded them). Reads those events only."""
    if not enabled():
        return None
    names = [n for n in list_names(storage, run) if kind_of_name(n) in BOUNDARIES]
    return [{"kind": e["kind"], "cause": e.get("cause", ""), "rank": e.get("rank"), "step": e.get("step")}
            for e in read_events(storage, run, names) if e.get("launch") == launch]


def list_names(storage, run: str) -> list[str]:
    return sorted(n for n in storage.list_files(f"{run}/{EVENTS}") if n.endswith(".json") and "/" not in n)


def kind_of_name(name: str) -> str:
    parts = name.split("-")
    return parts[-2] if len(parts) >= 4 else ""


# ---------------------------------------------------------------- where the time went


def _launches(events: list[dict]) -> list[list[dict]]:
    """The events cut at each ``launch`` (events before the first launch belong to it)."""
    out: list[list[dict]] = []
    for e in events:
        if e["kind"] == "launch" or not out:
            out.append([])
        out[-1].append(e)
    return out


def _clamp(t: float, lo: float, hi: float) -> float:
    return min(max(t, lo), hi)


def account(events: list[dict], now: float | None = None) -> dict:
    """The wall time of the run split into ``PARTS`` (seconds; they sum to ``wall``), from its events.

    The wall time is each launch's, from its ``launch`` event to its ``end`` (a launch without one: to
    ``now`` for the launch still running, else its last event); the time between launches is no one's.
    Within a launch, the restart and preemption events cut the attempts. An attempt's time up to its first
    step is start-up (the first attempt's) or restarts (a later one's). From its first step, its training
    is productive up to the checkpoint the next attempt resumed from; after it, the work was lost and is
    ``recomputed`` (the failure's detection included). Checkpoint blocking and evaluation inside the kept
    training are their own parts. The last attempt's time after its loop ended is start-up and shut-down.
    """
    parts = dict.fromkeys(PARTS, 0.0)
    events = sorted(events, key=lambda e: float(e["time"]))
    launches = _launches(events)
    for i, launch in enumerate(launches):
        start = float(launch[0]["time"])
        ends = [e for e in launch if e["kind"] == "end"]
        if ends:
            end = float(ends[-1]["time"])
        elif now is not None and i == len(launches) - 1:
            end = max(float(now), float(launch[-1]["time"]))
        else:
            end = float(launch[-1]["time"])
        _account_launch(launch, start, end, parts)
    parts = {k: round(v, 3) for k, v in parts.items()}
    wall = sum(parts.values())
    return {"wall_seconds": round(wall, 3), "parts": parts,
            "goodput_ratio": round(parts["productive"] / wall, 4) if wall > 0 else None}


def _account_launch(launch: list[dict], start: float, end: float, parts: dict) -> None:
    cuts = [float(e["time"]) for e in launch if e["kind"] in BOUNDARIES and start <= float(e["time"]) <= end]
    spans = list(zip([start, *cuts], [*cuts, end]))
    attempts = [e for e in launch if e["kind"] == "attempt"]
    by_attempt: dict[str, list[dict]] = {}
    for e in launch:
        if e.get("attempt") is not None:
            by_attempt.setdefault(str(e["attempt"]), []).append(e)
    owners = []  # the attempt (its events) that ran in each span
    for s, t in spans:
        found = next((a for a in attempts if s <= float(a["time"]) < t or (t == end and float(a["time"]) == t)), None)
        owners.append(by_attempt.get(str(found["attempt"]), []) if found is not None else [])
    for k, ((s, t), mine) in enumerate(zip(spans, owners)):
        before_first = "startup" if k == 0 else "restarts"
        first = next((float(e["time"]) for e in mine if e["kind"] == "first_step"), None)
        if first is None:
            parts[before_first] += t - s
            continue
        first = _clamp(first, s, t)
        parts[before_first] += first - s
        checkpoints = [e for e in mine if e["kind"] == "checkpoint"]
        last = k == len(spans) - 1
        if last:
            trained = next((float(e["time"]) for e in mine if e["kind"] == "trained"), None)
            kept_end = _clamp(trained, first, t) if trained is not None else t
            parts["startup"] += t - kept_end
            eval_s = max([float(e.get("eval_seconds") or 0) for e in mine
                          if e["kind"] in ("checkpoint", "trained") and float(e["time"]) <= kept_end + 1e-6] or [0.0])
        else:
            kept_end = _kept_until(checkpoints, owners[k + 1], first, t)
            parts["recomputed"] += t - kept_end
            eval_s = max([float(e.get("eval_seconds") or 0) for e in checkpoints
                          if float(e["time"]) <= kept_end + 1e-6] or [0.0])
        kept = kept_end - first
        blocked = sum(float(e.get("blocked_seconds") or 0) for e in checkpoints if float(e["time"]) <= kept_end + 1e-6)
        blocked = min(blocked, kept)
        eval_s = min(eval_s, kept - blocked)
        parts["checkpoint_blocked"] += blocked
        parts["evaluation"] += eval_s
        parts["productive"] += kept - blocked - eval_s


def _kept_until(checkpoints: list[dict], next_attempt: list[dict], first: float, t: float) -> float:
    """Until when an attempt's training was kept: the commit of the checkpoint the next attempt resumed
    from (its newest when the next attempt did not say), else nothing after the first step."""
    resumed = next((e.get("resumed_from_step") for e in next_attempt if e["kind"] == "attempt"), None)
    kept = [e for e in checkpoints if resumed is None or int(e.get("global_step", -1)) <= int(resumed)]
    if not kept:
        return first
    return _clamp(max(float(e["time"]) for e in kept), first, t)


# ---------------------------------------------------------------- the timeline and a run's state

STATES = {0: "finished", 1: "failed", 2: "bad input", 130: "interrupted", 143: "stopped"}


def state_of(last_end: dict | None, held: bool) -> str:
    """A run's state: its driver holds it (running), else how its last launch ended (lost: no end)."""
    if held:
        return "running"
    if last_end is None:
        return "lost"
    return STATES.get(int(last_end.get("exit_code", 1)), f"exit {last_end.get('exit_code')}")


def last_step(events: list[dict]) -> int | None:
    steps = [int(e["global_step"]) for e in events if isinstance(e.get("global_step"), (int, float))]
    return max(steps) if steps else None


def describe_event(e: dict) -> str:
    """One line of the timeline (without its time)."""
    kind = e["kind"]
    f = {k: v for k, v in e.items() if k not in ("kind", "time", "source", "launch", "attempt")}
    if kind == "launch":
        return f"launch {e.get('launch', '')}: {f.get('mode', 'train')} on {f.get('host', '?')} pid {f.get('pid', '?')}"
    if kind == "attempt":
        hosts = ", ".join(sorted(set(f.get("hosts") or []))) or "?"
        return (f"attempt {e.get('attempt', '')}: world size {f.get('world_size')} on {hosts}, "
                f"from step {f.get('resumed_from_step', 0)}")
    if kind == "first_step":
        took = f.get("seconds_to_first_step")
        after = f", {float(took):.1f} s after the worker group's start" if isinstance(took, (int, float)) else ""
        return f"first step: step {f.get('global_step')}{after}"
    if kind == "checkpoint":
        return (f"checkpoint at step {f.get('global_step')} committed, training blocked "
                f"{float(f.get('blocked_seconds') or 0):.2f} s: {f.get('uri', '')}")
    if kind in ("restart", "preemption", "diverged"):
        count = f" ({f['count']})" if f.get("count") else ""
        return f"{kind}: {f.get('cause', '')}{count}"
    if kind == "outage":
        return f"storage outage waited out: {f.get('where', '')}, {float(f.get('seconds') or 0):.1f} s during {f.get('during', '')}"
    if kind == "lease_taken_over":
        return f"lease taken over from {f.get('from', '?')}: {f.get('why', '')}"
    if kind == "trained":
        return f"training loop ended at step {f.get('global_step')}"
    if kind == "end":
        return f"end: exit {f.get('exit_code')}" + (f": {f['line']}" if f.get("line") else "")
    shown = ", ".join(f"{k} {v}" for k, v in f.items())
    return f"{kind}: {shown}" if shown else kind


def first_steps(events: list[dict]) -> list[dict]:
    """Each attempt of the run, in order: its ``attempt`` and ``launch``, the step it resumed from, what started
    it (``first`` in a launch, else the kind of the restart or preemption before it), ``seconds_to_first_step``
    (from its worker group's start, as rank 0 measured it) and ``seconds_from_restart`` (from the failure
    policy's decision); None where not known (no first step, a journal from before the figure)."""
    out = []
    for launch in _launches(sorted(events, key=lambda e: float(e["time"]))):
        boundary = None
        for e in launch:
            if e["kind"] in BOUNDARIES:
                boundary = e
            elif e["kind"] == "attempt":
                first = next((x for x in launch if x["kind"] == "first_step"
                              and x.get("attempt") == e.get("attempt")), None)
                took = first.get("seconds_to_first_step") if first is not None else None
                out.append({"attempt": e.get("attempt"), "launch": e.get("launch"),
                            "resumed_from_step": e.get("resumed_from_step", 0),
                            "after": boundary["kind"] if boundary is not None else "first",
                            "seconds_to_first_step": float(took) if isinstance(took, (int, float)) else None,
                            "seconds_from_restart": round(float(first["time"]) - float(boundary["time"]), 3)
                            if first is not None and boundary is not None else None})
                boundary = None
    return out


def when(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(unix)) + f".{int(unix * 10) % 10}Z"


# ---------------------------------------------------------------- rank 0: the attempt's events and goodput


GOODPUT_EVERY_S = 5.0  # how often rank 0 recomputes the run's goodput (at a logged step)


class JournalSink:
    """Rank 0's share of the journal behind the loop's metrics sink: the attempt (at ``start``), its first
    step, each committed checkpoint with the seconds it blocked training, the end of the loop; and the
    run's goodput over every attempt so far (``goodput``: an object with ``on_goodput(ratio)``, Prometheus),
    updated at each logged step from the journal read once at the start plus this attempt's events.
    Every call is cheap (no storage call on the training thread)."""

    def __init__(self, writer_: JournalWriter | None, storage=None, run: str = "", *, launch: str = "",
                 hosts: list[str] | None = None, goodput=None, clock=time.time, started: float | None = None):
        self.writer, self.storage, self.run, self.goodput, self.clock = writer_, storage, run, goodput, clock
        self.started = started  # unix time of this worker group's start (rank 0's worker entry), if known
        self.attempt = uuid.uuid4().hex[:8]
        self.hosts = list(hosts or [socket.gethostname()])
        if self.writer is not None:
            self.writer.context = {"launch": launch, "attempt": self.attempt}
        self.history: list[dict] | None = None  # the journal as it was when this attempt started
        self._earlier: dict | None = None  # the parts of the launches before this one
        self._goodput_at = float("-inf")
        self._first_done = False
        self._last_activity = clock()  # the last step or log: an evaluation runs from there to on_eval
        self.eval_seconds = 0.0
        self.global_step = 0
        self._commits: list[tuple[str, int, float]] = []  # committed, their blocked seconds not known yet
        self._blocked: list[float] = []  # blocked seconds of checkpoints whose commit is not known yet

    def _record(self, kind: str, **fields) -> None:
        if self.writer is not None:
            self.writer.record(kind, **fields)

    def start(self, *, world_size=1, resumed_from_step=0, global_step=0, **_info) -> None:
        self.global_step = int(global_step)
        self._record("attempt", world_size=world_size, hosts=self.hosts, resumed_from_step=int(resumed_from_step),
                     global_step=int(global_step))
        self._last_activity = self.clock()
        if self.goodput is not None and self.storage is not None:
            threading.Thread(target=self._read_history, name="ray-app-journal-read", daemon=True).start()

    def _read_history(self) -> None:
        try:
            self.history = read_events(self.storage, self.run)
        except Exception:
            self.history = None

    def on_step(self, step_seconds: float) -> None:
        self._last_activity = self.clock()
        self.global_step += 1
        if not self._first_done:
            self._first_done = True
            took = {} if self.started is None else {"seconds_to_first_step": round(self.clock() - self.started, 3)}
            self._record("first_step", global_step=self.global_step, **took)

    def on_progress(self, *, global_step, **_values) -> None:
        self.global_step = int(global_step)
        self._last_activity = self.clock()
        self.update_goodput()

    def on_eval(self, values) -> None:
        now = self.clock()
        self.eval_seconds += max(0.0, now - self._last_activity)
        self._last_activity = now

    def on_checkpoint(self, *, blocked_seconds) -> None:
        self._last_activity = self.clock()
        if self._commits:
            uri, step, at = self._commits.pop(0)
            self._checkpoint(uri, step, float(blocked_seconds), at)
        else:
            self._blocked.append(float(blocked_seconds))

    def on_checkpoint_committed(self, uri: str, global_step: int) -> None:
        if self._blocked:
            self._checkpoint(uri, int(global_step), self._blocked.pop(0), self.clock())
        else:
            self._commits.append((uri, int(global_step), self.clock()))

    def _checkpoint(self, uri: str, step: int, blocked: float, at: float) -> None:
        self._record("checkpoint", global_step=step, uri=uri, blocked_seconds=round(blocked, 4),
                     eval_seconds=round(self.eval_seconds, 4), committed=at)

    def on_gpu_memory(self, *, allocated, max_allocated) -> None: ...

    def on_rank_pace(self, rows) -> None: ...

    def checkpoint_state(self) -> dict:
        return {}

    def events(self) -> list[dict]:
        """The journal as known here: what was read at the start and this attempt's own events."""
        mine = list(self.writer.recorded) if self.writer is not None else []
        seen = {(e.get("kind"), e.get("time"), e.get("source")) for e in mine}
        earlier = [e for e in (self.history or []) if (e.get("kind"), e.get("time"), e.get("source")) not in seen]
        return earlier + mine

    def update_goodput(self) -> float | None:
        """The run's goodput so far (earlier attempts and launches included), given to ``goodput``; at most
        every ``GOODPUT_EVERY_S``, and the launches before this one accounted once (their events are final)."""
        now = self.clock()
        if self.goodput is None or self.history is None or now - self._goodput_at < GOODPUT_EVERY_S:
            return None
        self._goodput_at = now
        try:
            launches = _launches(self.events())
            if self._earlier is None:
                self._earlier = account([e for launch in launches[:-1] for e in launch])["parts"]
            current = account(launches[-1] if launches else [], now=now)["parts"]
            productive = self._earlier["productive"] + current["productive"]
            wall = sum(self._earlier.values()) + sum(current.values())
            ratio = round(productive / wall, 4) if wall > 0 else None
            if ratio is not None:
                self.goodput.on_goodput(ratio)
            return ratio
        except Exception:
            return None

    def close(self) -> None:
        for uri, step, at in self._commits:  # committed, but never told how long it blocked
            self._checkpoint(uri, step, 0.0, at)
        self._commits = []
        self._record("trained", global_step=self.global_step, eval_seconds=round(self.eval_seconds, 4))
        if self.writer is not None:
            self.writer.flush(5.0)


def record_outages(w: JournalWriter) -> None:
    """Every storage outage this process waits out (``ray_app.shared.retry``) becomes an ``outage`` event of ``w``."""
    from ray_app.shared.retry import on_waited_out

    on_waited_out(lambda where, what, seconds: w.record("outage", where=where, during=what,
                                                        seconds=round(float(seconds), 2)))
