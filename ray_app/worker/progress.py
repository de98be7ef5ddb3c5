"""What a run says about itself: interval loss sums, progress lines, run statistics, the metrics sink.

Every rank adds its batches' loss sums; at a logging step (every rank at the same step) one all-reduce
gives the sample-weighted global mean (practice 4), rank 0 prints the line and tells the metrics sink.
A task whose loss count is tokens (``counts = "tokens"``, as ``causal_lm``) has its samples counted from
the batches and its tokens from that count: samples/s counts samples, tokens/s tokens. ``RunStats`` times
the start-up and the steady state for the summary. Nothing here decides what the loop does next.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from ray_app.worker.ddp import global_sum_and_count, global_sums
from ray_app.worker.flops import StepFlops


@runtime_checkable
class MetricsSink(Protocol):
    """Where rank 0's numbers go (``metrics.PrometheusMetrics``; ``metrics.NullMetrics`` elsewhere)."""

    def start(self, **info) -> None: ...

    def on_step(self, step_seconds: float) -> None: ...

    def on_progress(self, *, epoch, global_step, lr, train_loss, samples, samples_per_second,
                    tokens=None, tokens_per_second=None, mfu=None) -> None: ...  # tokens: a token task's; mfu: when known

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
    train_tokens: int = 0  # a token task's tokens trained by this worker group, all ranks (its logged intervals)
    steady_tokens: int = 0  # those of the logged intervals that began after the warm-up steps
    steady_interval_steps: int = 0
    steady_interval_seconds: float = 0.0

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

    def on_interval(self, step0: int, step1: int, seconds: float, tokens: int | None) -> None:
        """A logged interval from ``step0`` to ``step1``: its seconds and (a token task's) global tokens."""
        self.train_tokens += tokens or 0
        if step0 >= self.steady_from_step:
            self.steady_tokens += tokens or 0
            self.steady_interval_steps += step1 - step0
            self.steady_interval_seconds += seconds

    def throughput(self, *, tokens: bool, flops: StepFlops) -> dict:
        """The summary's tokens and MFU (a token task's, and where ``flops``, a ``StepFlops``, has a figure),
        over the logged intervals after the warm-up steps: tokens counted / their seconds, FLOPs per step x
        steps / seconds / peak. Keys without a figure are left out."""
        out: dict = {}
        seconds = self.steady_interval_seconds
        if tokens:
            out["train_tokens"] = self.train_tokens
            if seconds > 0:
                out["steady_tokens_per_second"] = self.steady_tokens / seconds
        if flops.per_step:
            out["flops_per_step"] = flops.per_step
            mfu = flops.mfu(self.steady_interval_steps, seconds)
            if mfu is not None:
                out["steady_mfu"] = mfu
        return out


# ---------------------------------------------------------------- the train loss and progress lines

class Progress:
    """This rank's loss sums for the current logging interval and epoch; the global mean at each log."""

    def __init__(self, metrics: MetricsSink, device: torch.device, total_steps: int, say=print, *,
                 tokens: bool = False, peak_tflops: float = 0.0, stats: RunStats | None = None):
        self.metrics, self.device, self.total_steps, self.say = metrics, device, total_steps, say
        self.tokens = tokens  # the task's loss count is tokens (a count of samples otherwise)
        self.flops = StepFlops(device, peak_tflops, say=say)  # FLOPs per step (counted in the loop's step), MFU
        self.stats = stats  # the run statistics the summary's figures come from
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
        self.samples = torch.zeros((), device=self.device, dtype=torch.float64)

    def new_epoch(self, global_step: int, batches_done: int = 0) -> None:
        """An epoch starts, or goes on after a resume (``batches_done`` > 0: the sums ``before`` it stay)."""
        self.epoch_loss.zero_(), self.epoch_count.zero_()
        if not batches_done:
            self.before = (0.0, 0.0)
        self.new_interval(global_step)

    def add(self, loss: torch.Tensor, n, batch_size: int | None = None) -> None:
        """One batch: its mean loss over ``n`` samples, or tokens for a token task, whose ``batch_size``
        samples are counted apart (kept on the device: no sync per step)."""
        self.loss_sum += loss.detach() * n
        self.count += n
        self.samples += batch_size if self.tokens and batch_size is not None else n
        self.batches += 1

    def log(self, *, epoch: int, global_step: int, lr: float) -> None:
        """Practice 4: the sample-weighted global mean of the interval's loss (collective: every rank
        calls it at the same step); rank 0's line and metrics."""
        total, n, samples = global_sums(self.loss_sum, self.count, self.samples)  # sync point: all ranks
        loss = total / max(n, 1.0)
        self.epoch_loss += self.loss_sum
        self.epoch_count += self.count
        dt = time.perf_counter() - self.t0
        steps = global_step - self.step0
        samples = int(samples)  # all ranks' samples (the task's num_samples may differ by rank)
        tokens = int(n) if self.tokens else None  # all ranks' tokens: a token task's loss count
        sps = samples / dt if dt > 0 else 0.0
        tps = tokens / dt if tokens is not None and dt > 0 else None
        mfu = self.flops.mfu(steps, dt)
        eta = (self.total_steps - global_step) * dt / max(steps, 1)
        self.metrics.on_progress(epoch=epoch, global_step=global_step, lr=lr, train_loss=loss,
                                 samples=samples, samples_per_second=sps, tokens=tokens, tokens_per_second=tps,
                                 mfu=mfu)
        if self.stats is not None:
            self.stats.on_interval(self.step0, global_step, dt, tokens)
        if self.device.type == "cuda":
            self.metrics.on_gpu_memory(allocated=torch.cuda.memory_allocated(),
                                       max_allocated=torch.cuda.max_memory_allocated())
        rates = f"{sps:,.0f} samples/s" + (f" {tps:,.0f} tokens/s" if tps is not None else "") + \
            (f" MFU {100 * mfu:.1f}%" if mfu is not None else "")
        self.say(f"epoch {epoch} step {global_step}/{self.total_steps} "
                 f"loss {loss:.4f} lr {lr:.4g} {rates} eta {fmt_eta(eta)}")
        self.new_interval(global_step)

    def throughput(self) -> dict:
        """The summary's tokens and MFU figures (``RunStats.throughput``)."""
        return self.stats.throughput(tokens=self.tokens, flops=self.flops) if self.stats is not None else {}

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
