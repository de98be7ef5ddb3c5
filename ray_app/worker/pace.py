"""Every rank's pace: what each rank spends a step on, gathered at each log interval; the rank that stays behind.

Under DDP every rank's step takes the same wall time: the ranks that are ahead wait in the gradient
all-reduce (inside ``backward``) for the one that is behind. Rank 0's step time therefore shows only that
all are slow. Each rank measures, with ``time.perf_counter`` marks only (no device sync, no collective per
step), the parts of its step that are its own:

- **data wait**: the time ``next()`` on the train loader took (the data set, the collate function, the
  DataLoader workers falling behind);
- **forward**: the model's own forward (hooks on the unwrapped module, so DDP's buffer broadcast before it
  is not counted);
- **forward + backward**: from the batch in hand to ``backward`` done: the forward, the loss, the backward
  and any wait for the other ranks in DDP's all-reduce (and in its buffer broadcast);
- **optimizer**: the optimizer step and what goes with it;
- **wall**: the step's wall time (the same on every rank under DDP).

At each log interval every rank contributes these sums to one ``all_gather`` of a small float tensor
(:meth:`Pace.exchange`; every rank reaches it at the same step). Rank 0 then estimates each rank's **own
seconds per step**: data wait + forward * (1 + b) + optimizer, where b is the smallest ratio over the ranks
of (forward + backward - forward) to forward: the rank that waited least is the one all others waited for,
and its ratio is the backward's own cost per unit of forward (same model, same batch shape on every rank).
That is exact whether one rank is slowed by its data (it arrives last; the others' backward holds the wait)
or by its compute (its forward is slow too). Under FSDP the forward holds all-gathers as well, so the
estimate is an upper bound there; on a GPU the marks are host-side (kernels are queued, not waited for),
so the data wait is exact and the rest shows where the host blocked.

Each row carries the rank's replica group under HSDP (``train.replicate``: ``ray_app.worker.mesh``), and the line
naming a straggler says it: a slow rank holds back its own shard group's collectives every unit, the other
groups only at the gradients' all-reduce across groups.

Rank 0 exports each rank's own seconds per step and data wait per step (``ray_app_rank_step_seconds``,
``ray_app_rank_data_wait_seconds``, labelled ``rank`` and ``host``) and names, in one progress line, a rank
whose own time per step stays above ``STRAGGLER_RATIO`` times the other ranks' median and above it by at
least ``STRAGGLER_FLOOR_S`` for ``STRAGGLER_INTERVALS`` consecutive intervals (both a ratio and an absolute
floor: a loaded machine's jitter of a few milliseconds is no straggler), with whether its data wait explains
it. It is named once; again only after it has kept up for as many intervals.
"""

from __future__ import annotations

import socket
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ray_app.worker.collectives import entered

# the sums each rank contributes at a log interval, in this order
FIELDS = ("steps", "data_wait", "forward", "forward_backward", "optimizer", "wall")

STRAGGLER_RATIO = 2.0  # own seconds per step above this multiple of the other ranks' median ...
STRAGGLER_FLOOR_S = 0.05  # ... and above it by at least this many seconds per step ...
STRAGGLER_INTERVALS = 3  # ... for this many log intervals in a row


@dataclass(frozen=True)
class RankPace:
    """One rank's numbers over one log interval, per optimizer step."""

    rank: int
    host: str
    step_seconds: float  # its own seconds per step (data wait, forward, backward, optimizer; no waits for others)
    data_wait_seconds: float  # seconds per step waiting for the next batch
    wall_seconds: float  # wall seconds per step (the same on every rank under DDP)
    samples_per_second: float  # this rank's samples over the interval's wall time
    replica: int = 0  # its replica group under HSDP (train.replicate; 0 for every rank otherwise)


def own_seconds(sums: list[list[float]]) -> list[float]:
    """Each rank's own seconds per step from every rank's ``FIELDS`` sums (see the module's docstring)."""
    per_step = [[v / max(s[0], 1.0) for v in s[1:]] for s in sums]  # data, forward, forward_backward, optimizer, wall
    ratios = [(fb - f) / f for _, f, fb, _, _ in per_step if f > 0]
    if len(ratios) == len(per_step) and ratios:
        backward = max(min(ratios), 0.0)
        return [d + f * (1.0 + backward) + o for d, f, _, o, _ in per_step]
    # no forward seen (a model called outside nn.Module.__call__): the quickest forward + backward for all
    quickest = min(fb for _, _, fb, _, _ in per_step)
    return [d + quickest + o for d, _, _, o, _ in per_step]


@dataclass
class StragglerWatch:
    """Which rank to name, interval after interval: above the ratio and the floor for ``intervals`` in a row,
    named once, named again only after as many intervals of keeping up."""

    ratio: float = STRAGGLER_RATIO
    floor_s: float = STRAGGLER_FLOOR_S
    intervals: int = STRAGGLER_INTERVALS
    behind: dict = field(default_factory=dict)  # rank -> intervals in a row above the threshold
    named: dict = field(default_factory=dict)  # rank -> intervals in a row keeping up since it was named

    def is_behind(self, own: list[float], r: int) -> tuple[bool, float]:
        """Whether rank ``r`` is above the threshold, and the other ranks' median."""
        others = own[:r] + own[r + 1:]
        if not others:
            return False, own[r]
        median = statistics.median(others)
        return own[r] > self.ratio * median and own[r] - median >= self.floor_s, median

    def update(self, own: list[float]) -> list[tuple[int, float]]:
        """The ranks to name now, each with the other ranks' median."""
        out = []
        for r in range(len(own)):
            behind, median = self.is_behind(own, r)
            if behind:
                self.behind[r] = self.behind.get(r, 0) + 1
                if r in self.named:
                    self.named[r] = 0
                elif self.behind[r] >= self.intervals:
                    self.named[r] = 0
                    out.append((r, median))
            else:
                self.behind[r] = 0
                if r in self.named:
                    self.named[r] += 1
                    if self.named[r] >= self.intervals:
                        del self.named[r]
        return out


def straggler_line(p: RankPace, median: float, others_wait: float, intervals: int, global_step: int,
                   hsdp: bool = False) -> str:
    """The one progress line naming a rank that stays behind (under HSDP, with its replica group)."""
    excess = p.step_seconds - median
    extra_wait = p.data_wait_seconds - others_wait
    why = (f"its data wait explains it ({p.data_wait_seconds:.3f} s per step, the others' {others_wait:.3f} s)"
           if extra_wait >= 0.5 * excess else
           f"not its data wait ({p.data_wait_seconds:.3f} s per step): its forward, backward or optimizer step")
    replica = f" (replica group {p.replica})" if hsdp else ""
    return (f"straggler: rank {p.rank}{replica} on host {p.host} is behind for {intervals} log intervals to step "
            f"{global_step}: {p.step_seconds:.3f} s of its own per step, {p.step_seconds / max(median, 1e-9):.1f}x "
            f"the other ranks' median {median:.3f} s (+{excess:.3f} s); {why}")


class Pace:
    """This rank's step timing marks and the log interval's exchange (rank 0 exports and names)."""

    def __init__(self, rank: int, world_size: int, module: torch.nn.Module, metrics, device: torch.device,
                 samples_per_step: int, say=print, watch: StragglerWatch | None = None, enabled: bool = True,
                 replicas: list[int] | None = None):
        self.rank, self.world_size, self.metrics, self.device, self.say = rank, world_size, metrics, device, say
        self.replicas = replicas or [0] * world_size  # each rank's replica group (HSDP), in rank order
        self.enabled = enabled  # metrics.rank_pace; off: the loader as it is, no hooks, no all_gather
        self.samples_per_step = samples_per_step  # this rank's samples per optimizer step
        self.watch = watch or StragglerWatch()
        self.hosts: list[str] | None = None  # every rank's host, gathered at the first exchange
        self.sums = [0.0] * len(FIELDS)
        self._in_step = False  # forward hooks count only a training step's forward, not evaluation's
        self._t_batch = self._t_backward = self._t_last = self._t_forward = 0.0
        if enabled:
            module.register_forward_pre_hook(self._forward_starts)
            module.register_forward_hook(self._forward_ends)

    # ------------------------------------------------------------ marks (every step; perf_counter only)
    def _forward_starts(self, *_):
        self._t_forward = time.perf_counter()

    def _forward_ends(self, *_):
        if self._in_step:
            self.sums[2] += time.perf_counter() - self._t_forward

    def timed(self, loader):
        """The loader's batches, each ``next()`` timed as data wait."""
        if not self.enabled:
            yield from loader
            return
        it = iter(loader)
        self._t_last = time.perf_counter()  # an epoch's start: the step's wall counts from here, not from eval
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            self._t_batch = time.perf_counter()
            self.sums[1] += self._t_batch - t0
            self._in_step = True
            yield batch

    def backward_done(self) -> None:
        if not self.enabled:
            return
        self._in_step = False
        self._t_backward = time.perf_counter()
        self.sums[3] += self._t_backward - self._t_batch

    def stepped(self) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        s = self.sums
        s[0] += 1
        s[4] += now - self._t_backward
        s[5] += now - self._t_last
        self._t_last = now

    # ------------------------------------------------------------ the log interval
    def exchange(self, global_step: int) -> list[RankPace] | None:
        """Collective (every rank at the same step): one all_gather of every rank's sums; rank 0 exports
        them and names a rank that stays behind. Rank 0 gets the interval's rows, the others None."""
        if not self.enabled:
            return None
        if self.hosts is None:
            self.hosts = self._gather_hosts()
        mine = torch.tensor(self.sums, dtype=torch.float64)
        self.sums = [0.0] * len(FIELDS)
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            local = mine.to(self.device)
            gathered = [torch.empty_like(local) for _ in range(self.world_size)]
            with entered("every rank's pace (all_gather)"):
                dist.all_gather(gathered, local)  # sync point: all ranks, once per log interval
            sums = [t.tolist() for t in gathered]
        else:
            sums = [mine.tolist()]
        if self.rank != 0:
            return None
        rows = self._rows(sums)
        self.metrics.on_rank_pace(rows)
        self._name_stragglers(rows, global_step)
        return rows

    def _gather_hosts(self) -> list[str]:
        host = socket.gethostname()
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            hosts = [None] * self.world_size
            with entered("hosts (all_gather_object)"):
                dist.all_gather_object(hosts, host)  # sync point: all ranks, once per worker group
            return [str(h) for h in hosts]
        return [host]

    def _rows(self, sums: list[list[float]]) -> list[RankPace]:
        own = own_seconds(sums)
        rows = []
        for r, s in enumerate(sums):
            steps, wall = max(s[0], 1.0), s[5]
            rows.append(RankPace(rank=r, host=self.hosts[r] if r < len(self.hosts) else "unknown",
                                 step_seconds=own[r], data_wait_seconds=s[1] / steps, wall_seconds=wall / steps,
                                 samples_per_second=s[0] * self.samples_per_step / wall if wall > 0 else 0.0,
                                 replica=self.replicas[r] if r < len(self.replicas) else 0))
        return rows

    def _name_stragglers(self, rows: list[RankPace], global_step: int) -> None:
        for r, median in self.watch.update([p.step_seconds for p in rows]):
            others_wait = statistics.median([p.data_wait_seconds for p in rows if p.rank != r])
            self.say(straggler_line(rows[r], median, others_wait, self.watch.intervals, global_step,
                                    hsdp=len(set(self.replicas)) > 1))
