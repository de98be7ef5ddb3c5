"""The hang report's format, shared by the rank that writes it (``ray_app.worker.watchdog``) and the
failure policy that reads it (``ray_app.controller.hang_verdict``): where a worker group's reports go, when a
rank writes, and one rank's report as stored.

    {run.storage}/{run.name}/reports/{launch}-attempt-{n}/rank-{r}.json   the counter, hosts, why, stacks
    {run.storage}/{run.name}/reports/{launch}-attempt-{n}/rank-{r}.txt    the stacks of every thread
    {run.storage}/{run.name}/reports/{launch}-attempt-{n}/verdict.json    the failure policy's verdict
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field

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


# ---------------------------------------------------------------- a rank's report

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
