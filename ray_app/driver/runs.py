"""``ray-app runs list STORAGE`` and ``ray-app runs show RUN_URI``: what the run journals say.

Both only read (no lease is taken): the runs under a storage with their state, last step, last event and
the driver holding each (its lease, ``ray_app.shared.lease``); one run's timeline and its wall time split into
productive training, start-up, restarts, recomputed steps, checkpoint blocking and evaluation
(``ray_app.shared.journal.account``), and each attempt's seconds from its worker group's start to its first
step (``ray_app.shared.journal.first_steps``). A URI that holds no run, a store that cannot be read: one line, exit 2.
"""

from __future__ import annotations

import sys
import time

from ray_app.shared import journal
from ray_app.shared.errors import UserError
from ray_app.shared.lease import describe, lease_store

AT_START = "check AWS_ENDPOINT_URL_S3 and that the store is running, then run the command again"
STEP_KINDS = ("end", "trained", "checkpoint", "first_step", "attempt")  # events that carry the run's step
LEASE_STALE_S = 60.0  # run.lease_stale_s's default: a lease not renewed for longer holds nothing


def _open(uri: str, retry_s: float):
    from ray_app.shared.storage import open_storage

    storage = open_storage(uri, retry_s=retry_s, then=AT_START)
    root = getattr(storage, "root", None)
    if root is not None and not root.is_dir():
        raise UserError(f"storage {uri}: no such folder; give the run.storage the runs were trained with "
                        "(a folder or s3://bucket/prefix)")
    return storage


def _holder(storage, run: str, now: float) -> tuple[bool, str]:
    """(whether a driver holds the run now, who: its lease described, or '')."""
    found = lease_store(storage, run).read()
    if found is None:
        return False, ""
    record = found[0]
    fresh = now - float(record.get("renewed", 0)) <= LEASE_STALE_S
    return fresh, describe(record, now) + ("" if fresh else " (stale)")


def _last_end(events: list[dict]) -> dict | None:
    """The ``end`` of the run's last launch; None while it runs or when it was lost (no end after it)."""
    ends = [e for e in events if e["kind"] == "end"]
    launches = [e for e in events if e["kind"] == "launch"]
    return ends[-1] if ends and (not launches or ends[-1]["time"] >= launches[-1]["time"]) else None


def _run_row(storage, run: str, names: list[str], now: float) -> dict:
    """One run's line: its state, last step and last event from every event that can be read (as ``runs show``
    reads them), and how many of its files cannot be."""
    events, unreadable = journal.read_journal(storage, run, names)
    stepped = [e for e in events if e["kind"] in STEP_KINDS and journal.last_step([e]) is not None]
    step = journal.last_step(stepped[-1:])  # the newest event that carries the run's step
    held, holder = _holder(storage, run, now)
    last = events[-1] if events else None
    return {"run": run, "uri": storage.uri(run), "state": journal.state_of(_last_end(events), held), "last_step": step,
            "last_event": last["kind"] if last else None,
            "last_event_time": journal.when(float(last["time"])) if last else None, "events": len(events),
            "unreadable": len(unreadable), "holder": holder}


def list_runs(uri: str, retry_s: float) -> list[dict]:
    """Every run under the storage ``uri`` that has a journal or a lease, with its state."""
    storage = _open(uri, retry_s)
    now = time.time()
    rows = []
    for run in storage.list_dirs(""):
        names = journal.list_names(storage, run)
        if not names and lease_store(storage, run).read() is None:
            continue  # no journal, no lease: not a run of this kit (or one from before the journal)
        rows.append(_run_row(storage, run, names, now))
    return rows


def list_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return ["no runs with a journal here"]
    out = []
    for r in rows:
        step = "-" if r["last_step"] is None else r["last_step"]
        last = f"{r['last_event']} at {r['last_event_time']}" if r["last_event"] else \
            ("none readable" if r["unreadable"] else "no events")
        bad = f"  {r['unreadable']} of {r['events'] + r['unreadable']} events not readable" if r["unreadable"] else ""
        held = f"  held by {r['holder']}" if r["holder"] else ""
        out.append(f"{r['run']}  {r['state']}  step {step}  last event {last}{bad}{held}")
    return out


def _locate(uri: str, retry_s: float):
    uri = uri.rstrip("/")
    parent, _, run = uri.rpartition("/")
    if not run or uri in ("s3:", "s3:/") or (uri.startswith("s3://") and parent in ("s3:/", "s3:")):
        raise UserError(f"{uri}: expected a run URI such as s3://bucket/prefix/run-name or runs/run-name")
    return _open(parent or ".", retry_s), run


def show_run(uri: str, retry_s: float, say=None) -> dict:
    """The run's events, state and the split of its wall time (``journal.account``). Each journal file that is
    no event is named in one line (``say``: standard error) and left out, and listed under ``unreadable``."""
    storage, run = _locate(uri, retry_s)
    events, unreadable = journal.read_journal(storage, run)
    for name, why in unreadable:
        (say or _to_stderr)(f"ray-app: {journal.EVENTS}/{name}: not readable ({why}), left out")
    if not events:
        found = f"has {len(unreadable)} journal files, none of them readable" if unreadable else "has no journal"
        raise UserError(f"run {storage.uri(run)} {found} ({journal.EVENTS}/): check the URI "
                        f"(`ray-app runs list {storage.uri('')}` lists the runs there)")
    now = time.time()
    held, holder = _holder(storage, run, now)
    accounted = journal.account(events, now=now if held else None)
    return {"run": run, "uri": storage.uri(run), "state": journal.state_of(_last_end(events), held), "holder": holder,
            "last_step": journal.last_step(events), **accounted, "attempts": journal.first_steps(events),
            "events": events,
            "unreadable": [{"name": f"{journal.EVENTS}/{name}", "error": why} for name, why in unreadable]}


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def show_lines(shown: dict) -> list[str]:
    events = shown["events"]
    t0 = float(events[0]["time"])
    out = [f"run {shown['uri']}: {shown['state']}, step {shown['last_step']}"
           + (f", held by {shown['holder']}" if shown["holder"] else "")]
    for e in events:
        t = float(e["time"])
        out.append(f"  {journal.when(t)}  +{t - t0:8.1f} s  {journal.describe_event(e)}")
    wall = shown["wall_seconds"]
    out.append(f"wall time {wall:.1f} s (launches only; time between them is not counted):")
    for key in journal.PARTS:
        seconds = shown["parts"][key]
        share = 100 * seconds / wall if wall else 0.0
        out.append(f"  {journal.PART_NAMES[key]:34s} {seconds:9.1f} s  {share:5.1f} %")
    if shown["goodput_ratio"] is not None:
        out.append(f"goodput {100 * shown['goodput_ratio']:.1f} %")
    return out + attempt_lines(shown.get("attempts", []))


def attempt_lines(attempts: list[dict]) -> list[str]:
    """Each attempt's seconds from its worker group's start to its first step (a compile cache shows here)."""
    if not attempts:
        return []
    out = ["seconds to the first step, by attempt (from the worker group's start; after a restart also from its decision):"]
    for i, a in enumerate(attempts, 1):
        took = a["seconds_to_first_step"]
        shown = f"{took:.1f} s" if took is not None else "not recorded"
        why = "first of its launch" if a["after"] == "first" else f"after a {a['after']}"
        since = f" ({a['seconds_from_restart']:.1f} s after the {a['after']}'s decision)" \
            if a["seconds_from_restart"] is not None else ""
        out.append(f"  {i}. attempt {a['attempt']}, {why}, from step {a['resumed_from_step']}: {shown}{since}")
    return out
