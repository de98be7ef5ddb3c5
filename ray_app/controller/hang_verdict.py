"""The hang report, controller side: the failure policy (in Ray Train's controller) reads the newest
attempt's reports (``ray_app.shared.reports``), gives the ``verdict`` and prints one line:

    ray-app: hang: rank 1 (host h; no report: stopped or gone) did not reach gradient all-reduce
    (backward) #412 at step 57 that rank 0 waits in; stacks in s3://bucket/runs/r/reports/20261204T140501Z-attempt-1/

A storage outage is no hang: when the failed ranks gave up on the store (``StorageUnavailable``) or the
reports cannot be read because the store does not answer, the line says so instead:

    ray-app: storage unavailable (not a hang): rank 0 gave up on the store; no hang report read

(the restart's line after it names the store and the call that had no answer).

The failure policy records the line in the run's journal (``ray_app.shared.journal``: a ``hang_report`` event).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from ray_app.shared.errors import StorageUnavailable, first_line
from ray_app.shared.reports import REPORTS, RankReport, read_reports, upload_bytes
from ray_app.shared.retry import transient

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
    budget: str = "the hang reports' read: failure.storage_retry_s, at most 5 s"  # how lines name retry_s
    max_age_s: float = 600.0  # reports older than this at a failure belong to an earlier stall, not to it
    wait_s: float = 0.0  # how long a failure that looks like a hang waits for reports still on their way
    said: set = field(default_factory=set)
    step: int | None = None  # the step of the newest line's collective (the restart's journal event names it)

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
        from ray_app.shared.storage import open_storage

        gave_up = storage_gave_up(failures or {})
        if gave_up:  # the store is down: its reports could not be read, and no rank hung
            return f"storage unavailable (not a hang): {gave_up}; no hang report read"
        try:
            storage = open_storage(self.storage_uri, retry_s=self.retry_s, budget=self.budget,
                                   then="the restart goes on without them")
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
            self.step = found.step
        except Exception as exc:  # the report is a help; the restart does not wait on it
            if isinstance(exc, StorageUnavailable) or transient(exc):
                return f"storage unavailable: the hang reports under {self.storage_uri} could not be read ({first_line(exc)})"
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


def storage_gave_up(failures: dict) -> str:
    """The ranks whose error is ``StorageUnavailable``, said ("" when none did)."""
    ranks = sorted(r for r, e in failures.items() if isinstance(e, StorageUnavailable))
    if not ranks:
        return ""
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks)) + " gave up on the store"


HUNG_ERRORS = ("WorkerHealthCheckTimeoutError", "CollectiveTimeoutError", "BroadcastCollectiveTimeoutError")


def looks_hung(failures: dict) -> bool:
    """Whether a failed group's errors say a rank made no progress: Ray Train's health check or barrier
    timed out (by the names of its errors), or a collective did (its message)."""
    return any(type(e).__name__ in HUNG_ERRORS or "timed out" in str(e).lower() for e in failures.values())
