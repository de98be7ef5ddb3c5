"""The hang report: which rank did not arrive, where every other rank waited, and their stacks.

Worker side: ``start_watchdog`` (every rank, each worker-group start) learns every rank's host and the
attempt's number, then watches this rank's collective counter (``ray_app.collectives``) on a thread.
When the training thread has been inside the same collective for ``fire_after(failure.hang_timeout_s)``
(a little before the collective's own timeout and Ray Train's health check end the group), the
thread writes this rank's report through the kit's storage (a local folder or S3):

    {run.storage}/{run.name}/reports/{launch}-attempt-{n}/rank-{r}.json   the counter, hosts, why, stacks
    {run.storage}/{run.name}/reports/{launch}-attempt-{n}/rank-{r}.txt    the stacks of every thread
    {run.storage}/{run.name}/reports/{launch}-attempt-{n}/verdict.json    the failure policy's verdict

A rank that is not inside a collective but whose counter has not moved for as long (stuck in its own
code, its data loader) writes its report too, once another rank's report is there. A stopped process
writes nothing; the others' counters still name it: every rank enters the same collectives in the same
order, so the ranks inside collective #K wait for those whose count stopped short of K.

Controller side: ``HangReports.line`` (in the failure policy, before the restart line) reads the newest
attempt's reports, gives the ``verdict`` and prints one line:

    ray-app: hang: rank 1 (host h; no report: stopped or gone) did not reach gradient all-reduce
    (backward) #412 at step 57 that rank 0 waits in; stacks in s3://bucket/runs/r/reports/20261204T140501Z-attempt-1/

The failure policy records the line in the run's journal (``ray_app.journal``: a ``hang_report`` event).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field

from ray_app.collectives import COUNTER, CollectiveCounter, entered

REPORTS = "reports"


def margin_s(hang_timeout_s: float) -> float:
    """The time a report has to reach storage before the group is torn down: a fifth of
    ``failure.hang_timeout_s``, at least 2 s and at most 30 s."""
    return min(max(0.2 * hang_timeout_s, 2.0), 30.0)


def fire_after(hang_timeout_s: float) -> float:
    """Seconds inside one collective after which a rank writes its report: ``margin_s`` before the
    collective times out (``failure.hang_timeout_s``) and Ray Train's health check gives up."""
    return hang_timeout_s - margin_s(hang_timeout_s)


def attempt_folder(run: str, launch: str, attempt: int) -> str:
    """Where one worker group's reports go, under the run (``launch``: the driver's start, sortable)."""
    return f"{run}/{REPORTS}/{launch}-attempt-{attempt}"


def launch_stamp(unix: float | None = None) -> str:
    """The driver's launch as a folder name that sorts in time order (UTC)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if unix is None else unix))


# ---------------------------------------------------------------- a rank's report

def stacks_text(first: int | None = None) -> str:
    """The Python stack of every thread of this process, each headed by its name: first the thread
    ``first`` (the one that entered the latest collective), then the main thread, then the rest."""
    frames = sys._current_frames()
    names = {t.ident: (t.name, t.daemon) for t in threading.enumerate()}
    main = threading.main_thread().ident
    parts = []
    for ident in sorted(frames, key=lambda i: (i != first, i != main, i)):
        name, daemon = names.get(ident, (f"thread {ident}", None))
        head = f'Thread "{name}" (id {ident}{", daemon" if daemon else ""}{", entered the collective" if ident == first else ""})'
        parts.append(head + ":\n" + "".join(traceback.format_stack(frames[ident])))
    return "\n".join(parts)


@dataclass
class RankReport:
    """One rank's report: its counter when it wrote, the group's hosts, why it wrote, its stacks."""

    rank: int
    world_size: int
    hosts: list[str]
    seq: int
    name: str
    step: int
    inside: bool
    waited_s: float  # seconds in (or, when not inside, since leaving) the counter's latest collective
    why: str
    pid: int = field(default_factory=os.getpid)
    written_unix: float = field(default_factory=time.time)
    stacks: str = ""

    @property
    def host(self) -> str:
        return self.hosts[self.rank] if 0 <= self.rank < len(self.hosts) else "?"

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, indent=1).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> RankReport:
        d = json.loads(raw)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def write_report(storage, folder: str, report: RankReport) -> None:
    """``rank-R.json`` and ``rank-R.txt`` (the stacks, for reading) under ``folder``, through the storage."""
    upload_bytes(storage, f"{folder}/rank-{report.rank}.txt", report.stacks.encode())
    upload_bytes(storage, f"{folder}/rank-{report.rank}.json", report.to_json())


def upload_bytes(storage, rel: str, body: bytes) -> None:
    with tempfile.NamedTemporaryFile(prefix="ray-app-hang-", delete=False) as f:
        f.write(body)
    try:
        storage.upload_file(f.name, rel)
    finally:
        os.unlink(f.name)


def read_reports(storage, folder: str) -> list[RankReport]:
    """Every readable ``rank-R.json`` under ``folder`` (one that cannot be read is left out)."""
    out = []
    for rel in storage.list_files(folder):
        if rel.startswith("rank-") and rel.endswith(".json"):
            try:
                out.append(RankReport.from_json(storage.read_bytes(f"{folder}/{rel}")))
            except (ValueError, TypeError, KeyError):
                continue
    return sorted(out, key=lambda r: r.rank)


# ---------------------------------------------------------------- the watchdog (every rank, a thread)

class Watchdog:
    """Watches ``counter`` every ``poll_s``. Inside one collective for ``after_s``, it calls ``write(why)``.
    Outside any collective with the counter unmoved for ``after_s``, it writes once ``others_reported()``
    is true (asked every ``ask_every_s``), or at once with ``stale_alone`` (nccl: a collective returns when
    it is queued, and a rank waits for it later, at its next sync with the GPU, outside the count). It
    writes once per position of the counter: a counter that moves on and stops again is reported again.
    ``clock``: time.monotonic."""

    def __init__(self, counter: CollectiveCounter, after_s: float, write, others_reported=lambda: False,
                 poll_s: float | None = None, ask_every_s: float = 2.0, stale_alone: bool = False,
                 clock=time.monotonic):
        self.counter, self.after_s, self.write, self.others_reported = counter, after_s, write, others_reported
        self.poll_s = poll_s if poll_s is not None else min(1.0, max(0.05, after_s / 20))
        self.ask_every_s, self.stale_alone, self.clock = ask_every_s, stale_alone, clock
        self.fired = threading.Event()
        self._stop = threading.Event()
        self._asked = 0.0
        self._written_for = None  # the counter's position of the latest report
        self.thread = threading.Thread(target=self._run, name="ray-app-hang-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> str | None:
        """Why this rank should write its report now, or None."""
        p, now = self.counter.position, self.clock()
        waited = now - p.since
        if waited < self.after_s or p == self._written_for:
            return None
        if p.inside:
            return f"inside {p.name} #{p.seq} at step {p.step} for {waited:.1f} s"
        stale = f"no collective entered for {waited:.1f} s (the last: {p.name} #{p.seq} at step {p.step})"
        if self.stale_alone:
            return stale
        if now - self._asked >= self.ask_every_s:
            self._asked = now
            if self.others_reported():
                return stale + " while other ranks reported a hang"
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            why = self.check()
            if why is None:
                continue
            self._written_for = self.counter.position
            try:
                self.write(why)
            except Exception as exc:  # a report must never be what fails the run
                print(f"ray-app: could not write the hang report: {type(exc).__name__}: {exc}", flush=True)
            self.fired.set()


def report_now(counter: CollectiveCounter, rank: int, world_size: int, hosts: list[str], why: str,
               clock=time.monotonic) -> RankReport:
    """This rank's report: its counter now and the stacks of all its threads."""
    p = counter.position
    return RankReport(rank=rank, world_size=world_size, hosts=list(hosts), seq=p.seq, name=p.name, step=p.step,
                      inside=p.inside, waited_s=round(clock() - p.since, 3), why=why, stacks=stacks_text(p.thread))


def group_start(rank: int, attempt_key: bytes | None) -> tuple[list[str], int]:
    """Every rank's host and this worker group's attempt number (rank 0 counts the group starts of one
    launch in Ray's key-value store; 1 without one). A collective: every rank calls it once."""
    import torch.distributed as dist

    attempt = 0
    if rank == 0 and attempt_key is not None:
        from ray_app import ray_seam

        try:
            attempt = int(ray_seam.kv_get(attempt_key) or 0) + 1
            ray_seam.kv_put(attempt_key, str(attempt).encode())
        except Exception:  # no key-value store: the attempt is not numbered
            attempt = 0
    gathered = [None] * dist.get_world_size()
    with entered("start (all_gather_object)"):
        dist.all_gather_object(gathered, (socket.gethostname(), attempt))  # sync point: all ranks
    return [h for h, _ in gathered], gathered[0][1] or 1


def start_watchdog(storage, run: str, launch: str, hang_timeout_s: float, rank: int, world_size: int,
                   attempt_key: bytes | None = None, stale_alone: bool = False) -> Watchdog:
    """Every rank, at each worker-group start (a collective): the counter from zero, the group's hosts and
    attempt, and the thread that writes this rank's report under ``{run}/reports/`` when it hangs
    (``stale_alone``: the process group is nccl's, see ``Watchdog``)."""
    COUNTER.reset()
    hosts, attempt = group_start(rank, attempt_key)
    folder = attempt_folder(run, launch, attempt)

    def write(why: str) -> None:
        write_report(storage, folder, report_now(COUNTER, rank, world_size, hosts, why))

    def others_reported() -> bool:
        return any(f.startswith("rank-") and f.endswith(".json") and f != f"rank-{rank}.json"
                   for f in storage.list_files(folder))

    return Watchdog(COUNTER, fire_after(hang_timeout_s), write, others_reported, stale_alone=stale_alone).start()


# ---------------------------------------------------------------- the verdict: who did not arrive

@dataclass
class Verdict:
    """What the reports of one worker group say: the collective the others wait in, who waits there, who
    did not arrive (``missing``: wrote no report; ``behind``: reported, at an earlier collective)."""

    seq: int
    name: str
    step: int
    waiting: list[int]
    missing: list[int]
    behind: list[RankReport]
    hosts: list[str]
    queued: bool = False  # no rank is inside a collective: the waiting ranks entered #K and wait on it later

    @property
    def absent(self) -> list[int]:
        """Every rank that did not arrive, in rank order."""
        return sorted(self.missing + [r.rank for r in self.behind])

    def _host(self, rank: int) -> str:
        return self.hosts[rank] if 0 <= rank < len(self.hosts) else "?"

    def _who(self, rank: int) -> str:
        behind = {r.rank: r for r in self.behind}
        if rank in behind:
            r = behind[rank]
            state = "in" if r.inside else "after"
            return f"rank {rank} (host {self._host(rank)}; {state} {r.name} #{r.seq} at step {r.step})"
        return f"rank {rank} (host {self._host(rank)}; no report: stopped or gone)"

    def line(self, where: str) -> str:
        ranks = lambda rs: ("rank " if len(rs) == 1 else "ranks ") + ",".join(map(str, rs))  # noqa: E731
        if not self.waiting:
            return f"hang: no rank waits in a collective; stacks in {where}"
        waited = f"{self.name} #{self.seq} at step {self.step}"
        if not self.absent:
            return (f"hang: every rank {'entered and waits on' if self.queued else 'waits in'} {waited} (all "
                    f"arrived: the collective itself did not return); stacks in {where}")
        verb = "waits" if len(self.waiting) == 1 else "wait"
        who = ", ".join(self._who(r) for r in self.absent)
        wait = f"entered and {verb} on" if self.queued else f"{verb} in"
        return f"hang: {who} did not reach {waited} that {ranks(self.waiting)} {wait}; stacks in {where}"


def verdict(reports: list[RankReport]) -> Verdict | None:
    """The collective the most advanced waiting ranks are inside, and the ranks that are not there:
    absent from the reports, or at an earlier collective. None without reports."""
    if not reports:
        return None
    world = max(r.world_size for r in reports)
    hosts = max((r.hosts for r in reports), key=len)
    inside = [r for r in reports if r.inside]
    reported = {r.rank for r in reports}
    missing = [k for k in range(world) if k not in reported]
    if not inside:  # nccl's collectives return once queued: the ranks wait for the latest one later
        top = max(reports, key=lambda r: r.seq)
        if top.seq == 0:
            return Verdict(0, "", top.step, [], missing, [], hosts)
        waiting = [r.rank for r in reports if r.seq == top.seq]
        return Verdict(top.seq, top.name, top.step, waiting, missing, [r for r in reports if r.seq < top.seq],
                       hosts, queued=True)
    top = max(inside, key=lambda r: r.seq)
    waiting = [r.rank for r in inside if r.seq == top.seq]
    behind = [r for r in reports if r.seq < top.seq]  # a rank past #K (not inside) is not blamed
    return Verdict(top.seq, top.name, top.step, waiting, missing, behind, hosts)


# ---------------------------------------------------------------- the controller: read, say, record

@dataclass
class HangReports:
    """Where one launch's reports are, for the failure policy (in Ray Train's controller): ``line()`` reads
    the newest attempt's reports once and returns the hang's line (None: nothing new)."""

    storage_uri: str
    run: str
    launch: str
    retry_s: float = 5.0
    max_age_s: float = 600.0  # reports older than this at a failure belong to an earlier stall, not to it
    wait_s: float = 0.0  # how long a failure that looks like a hang waits for reports still on their way
    said: set = field(default_factory=set)

    def _fresh_reports(self, storage) -> tuple[str | None, list[RankReport]]:
        """The newest attempt's folder not said yet, and its reports written within ``max_age_s``."""
        folder = self.newest_folder(storage)
        if folder is None or folder in self.said:
            return folder, []
        return folder, [r for r in read_reports(storage, folder) if time.time() - r.written_unix <= self.max_age_s]

    def newest_folder(self, storage) -> str | None:
        prefix = f"{self.launch}-attempt-"
        attempts = [d for d in storage.list_dirs(f"{self.run}/{REPORTS}") if d.startswith(prefix)]
        if not attempts:
            return None
        newest = max(attempts, key=lambda d: int(d[len(prefix):]) if d[len(prefix):].isdigit() else 0)
        return f"{self.run}/{REPORTS}/{newest}"

    def line(self, failures: dict | None = None) -> str | None:
        """``failures``: each failed rank's error; one that looks like a hang (``looks_hung``) waits up to
        ``wait_s`` for the reports (a rank that entered its collective late writes late), until their
        number has not changed for a second."""
        from ray_app.storage import open_storage

        try:
            storage = open_storage(self.storage_uri, retry_s=self.retry_s)
            deadline = time.monotonic() + (self.wait_s if looks_hung(failures or {}) else 0.0)
            folder, reports = self._fresh_reports(storage)
            while time.monotonic() < deadline:
                time.sleep(1.0 if reports else 0.5)
                again = self._fresh_reports(storage)
                if reports and len(again[1]) == len(reports):
                    break  # every rank that could write has written
                folder, reports = again
            if not reports:
                return None
            self.said.add(folder)
            found = verdict(reports)
        except Exception as exc:  # the report is a help; the restart does not wait on it
            return f"hang: the reports under {self.storage_uri} could not be read ({type(exc).__name__}: {exc})"
        where = storage.uri(folder) + "/"
        line = found.line(where)
        try:  # the verdict beside the reports: it outlives the cluster, as they do
            upload_bytes(storage, f"{folder}/verdict.json", json.dumps(
                {"line": line, "seq": found.seq, "collective": found.name, "step": found.step, "waiting": found.waiting,
                 "did_not_arrive": found.absent, "hosts": found.hosts, "written_unix": time.time()}, indent=1).encode())
        except Exception:
            pass
        return line


HUNG_ERRORS = ("WorkerHealthCheckTimeoutError", "CollectiveTimeoutError", "BroadcastCollectiveTimeoutError")


def looks_hung(failures: dict) -> bool:
    """Whether a failed group's errors say a rank made no progress: Ray Train's health check or barrier
    timed out (by the names of its errors), or a collective did (its message)."""
    return any(type(e).__name__ in HUNG_ERRORS or "timed out" in str(e).lower() for e in failures.values())

