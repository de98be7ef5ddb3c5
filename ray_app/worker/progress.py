"""What a run says about itself: interval loss sums, progress lines, run statistics, the metrics sink.

Every rank adds its batches' loss sums; at a logging step (every rank at the same step) one all-reduce
gives the sample-weighted global mean (practice 4), rank 0 prints the line and tells the metrics sink.
``RunStats`` times the start-up and the steady state for the summary. Nothing here decides what the
loop does next.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from ray_app.worker.ddp import global_sum_and_count


@runtime_checkable
class MetricsSink(Protocol):
    """Where rank 0's numbers go (``metrics.PrometheusMetrics``; ``metrics.NullMetrics`` elsewhere)."""

    def start(self, **info) -> None: ...

    def on_step(self, step_seconds: float) -> None: ...

    def on_progress(self, *, epoch, global_step, lr, train_loss, samples, samples_per_second) -> None: ...

    def on_eval(self, values: dict) -> None: ...

    def on_checkpoint(self, *, blocked_seconds) -> None: ...

    def on_gpu_memory(self, *, allocated, max_allocated) -> None: ...

    def on_rank_pace(self, rows) -> None: ...  # every rank's pace at a log interval (ray_app.worker.pace.RankPace rows)

    def checkpoint_state(self) -> dict: ...  # kept in each checkpoint; given back to start(tracking=...) on resume

    def close(self) -> None: ...


# ---------------------------------------------------------------- timing for the summary

STEADY_SKIP_STEPS = 5  # warm-up steps left out of the steady-state throughput


@dataclass
class RunStats:
    """Start-up timeline (unix seconds) and steady-state throughput of this worker-group start."""

    timeline: dict = field(default_factory=lambda: {"worker_start_unix": time.time()})
    steady_from_step: int = STEADY_SKIP_STEPS
    steady_t0: float | None = None
    steady_t1: float | None = None
    steady_samples: int = 0
    t_start: float = 0.0
    global_step: int = -1  # optimizer steps taken so far (-1 before training starts): where an error was raised

    def mark(self, name: str) -> None:
        self.timeline.setdefault(name, time.time())

    def start_training(self, global_step: int) -> None:
        self.t_start = time.perf_counter()
        self.global_step = global_step
        self.steady_from_step = global_step + STEADY_SKIP_STEPS

    def on_step(self, global_step: int, samples_per_step: int) -> None:
        self.mark("first_step_unix")
        self.global_step = global_step
        if global_step == self.steady_from_step:
            self.steady_t0 = time.perf_counter()
        elif self.steady_t0 is not None:
            self.steady_samples += samples_per_step
            self.steady_t1 = time.perf_counter()

    def steady_rate(self) -> float | None:
        ok = self.steady_t1 and self.steady_t0 is not None and self.steady_t1 > self.steady_t0
        return self.steady_samples / (self.steady_t1 - self.steady_t0) if ok else None

    def train_seconds(self) -> float:
        return time.perf_counter() - self.t_start


# ---------------------------------------------------------------- the train loss and progress lines

class Progress:
    """This rank's loss sums for the current logging interval and epoch; the global mean at each log."""

    def __init__(self, metrics: MetricsSink, device: torch.device, total_steps: int, say=print):
        self.metrics, self.device, self.total_steps, self.say = metrics, device, total_steps, say
        # float64 sums of each batch's float32 loss x samples: exact in practice, so an epoch's sums cut by a
        # checkpoint and added up after a resume equal the uncut ones (the uninterrupted run's epoch loss)
        self.epoch_loss = torch.zeros((), device=device, dtype=torch.float64)  # this epoch (this attempt), this rank
        self.epoch_count = torch.zeros((), device=device, dtype=torch.float64)
        self.before = (0.0, 0.0)  # the epoch's global (loss x samples, samples) before this attempt: its checkpoint's
        self.new_interval(0)

    def new_interval(self, global_step: int) -> None:
        self.t0, self.step0, self.batches = time.perf_counter(), global_step, 0
        self.loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        self.count = torch.zeros((), device=self.device, dtype=torch.float64)

    def new_epoch(self, global_step: int, batches_done: int = 0) -> None:
        """An epoch starts, or goes on after a resume (``batches_done`` > 0: the sums ``before`` it stay)."""
        self.epoch_loss.zero_(), self.epoch_count.zero_()
        if not batches_done:
            self.before = (0.0, 0.0)
        self.new_interval(global_step)

    def add(self, loss: torch.Tensor, n) -> None:
        """One batch: its mean loss over ``n`` samples (kept on the device: no sync per step)."""
        self.loss_sum += loss.detach() * n
        self.count += n
        self.batches += 1

    def log(self, *, epoch: int, global_step: int, lr: float) -> None:
        """Practice 4: the sample-weighted global mean of the interval's loss (collective: every rank
        calls it at the same step); rank 0's line and metrics."""
        total, n = global_sum_and_count(self.loss_sum, self.count)  # sync point: all ranks
        loss = total / max(n, 1.0)
        self.epoch_loss += self.loss_sum
        self.epoch_count += self.count
        dt = time.perf_counter() - self.t0
        samples = int(n)  # all ranks' samples (the task's num_samples may differ by rank)
        sps = samples / dt if dt > 0 else 0.0
        eta = (self.total_steps - global_step) * dt / max(global_step - self.step0, 1)
        self.metrics.on_progress(epoch=epoch, global_step=global_step, lr=lr, train_loss=loss,
                                 samples=samples, samples_per_second=sps)
        if self.device.type == "cuda":
            self.metrics.on_gpu_memory(allocated=torch.cuda.memory_allocated(),
                                       max_allocated=torch.cuda.max_memory_allocated())
        self.say(f"epoch {epoch} step {global_step}/{self.total_steps} "
                 f"loss {loss:.4f} lr {lr:.4g} {sps:,.0f} samples/s eta {fmt_eta(eta)}")
        self.new_interval(global_step)

    def epoch_train_loss(self, *, epoch: int, global_step: int, lr: float) -> float:
        """The rest of the interval logged, then the epoch's global mean train loss (collective), the steps
        before a restart included (their sums came with the checkpoint resumed from)."""
        if self.batches:
            self.log(epoch=epoch, global_step=global_step, lr=lr)
        total, n = global_sum_and_count(self.epoch_loss, self.epoch_count)  # sync point: all ranks
        return (self.before[0] + total) / max(self.before[1] + n, 1.0)

    def epoch_sums(self, batches_done: int) -> tuple[float, float]:
        """The epoch's global (sum of loss x samples, samples) so far, for a checkpoint's state: a collective
        when the epoch has begun (``batches_done`` > 0; every rank calls it at the same step), else none."""
        if not batches_done:
            return 0.0, 0.0
        total, n = global_sum_and_count(self.epoch_loss + self.loss_sum, self.epoch_count + self.count)  # sync point
        return self.before[0] + total, self.before[1] + n


def fmt_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
