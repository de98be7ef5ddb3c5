"""The hang report, worker side: which rank did not arrive, where every other rank waited, and their stacks.

Worker side: ``start_watchdog`` (every rank, each worker-group start) learns every rank's host and the
attempt's number, then watches this rank's collective counter (``ray_app.worker.collectives``) on a thread.
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

The failure policy records the line in the run's journal (``ray_app.shared.journal``: a ``hang_report`` event).
"""

from __future__ import annotations

import socket
import sys
import threading
import time
import traceback

from ray_app.shared.reports import RankReport, attempt_folder, fire_after, write_report
from ray_app.worker.collectives import COUNTER, CollectiveCounter, entered


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
        from ray_app.shared import ray_seam

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
