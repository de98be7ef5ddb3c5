"""The per-worker DDP loop: train epoch, global loss, exact evaluation, for any task.

It reads like the practices it implements (the one list of them; the README
links here, and the code marks each as ``practice N``):

1. every rank starts from identical parameters (seeded init, DDP's broadcast,
   and a check that they really are equal);
2. a DistributedSampler splits the data, ``set_epoch`` every epoch;
3. DDP averages gradients with its bucketed all-reduce, overlapped with backward
   (skipped with ``no_sync`` on non-final gradient-accumulation micro-steps);
4. the logged loss is the sample-weighted global mean over ranks (one ``all_reduce``);
5. evaluation sums every rank's per-sample values, the sampler's padded duplicates
   masked out, exactly (whatever the order), and all-reduces the sums and the count
   (one ``all_reduce`` of O(metrics) numbers), so each mean equals a single-process
   evaluation exactly; only a task that needs every value (``summarize_rows``) has
   them gathered (``all_gather``) by the sampler's indices;
6. rank 0 alone logs progress, writes checkpoints and serves metrics (every rank prints one
   line at the start: its host and device).

What a batch means, the loss and the metrics come from the task (``ray_app.tasks``);
the data, model and task are built by :func:`build_parts` from the config's plug-ins.
Infrastructure arrives as small objects typed by the protocols below: a
:class:`Runtime` (topology, DDP wrapping, Ray's report), a checkpointer and a
:class:`MetricsSink`. No Ray, S3 or Prometheus here.
"""

from __future__ import annotations

import contextlib
import math
import random
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from ray_app import __version__
from ray_app.checkpoint import CheckpointError, CheckpointPayload, capture_rng_state, restore_rng_state
from ray_app.config import Config, resume_conflicts
from ray_app.plugins import PluginError, build_data, build_model, build_task
from ray_app.preemption import STOP, TRAINING, Agreement, Preempted, Stopped

# ---------------------------------------------------------------- the seams (real objects and test fakes)

@runtime_checkable
class Runtime(Protocol):
    """Topology and the framework's calls, read in one place (``ray_app.worker.RayRuntime`` in production)."""

    rank: int
    world_size: int
    device: torch.device

    def prepare_model(self, model: torch.nn.Module, bucket_cap_mb: int = 25) -> torch.nn.Module: ...

    def report(self, metrics: dict, local_dir=None, dir_name=None, upload=None) -> None: ...


@runtime_checkable
class MetricsSink(Protocol):
    """Where rank 0's numbers go (``metrics.PrometheusMetrics``; ``metrics.NullMetrics`` elsewhere)."""

    def start(self, **info) -> None: ...

    def on_step(self, step_seconds: float) -> None: ...

    def on_progress(self, *, epoch, global_step, lr, train_loss, samples, samples_per_second) -> None: ...

    def on_eval(self, values: dict) -> None: ...

    def on_checkpoint(self, *, blocked_seconds) -> None: ...

    def on_gpu_memory(self, *, allocated, max_allocated) -> None: ...

    def checkpoint_state(self) -> dict: ...  # kept in each checkpoint; given back to start(tracking=...) on resume

    def close(self) -> None: ...


# ---------------------------------------------------------------- small DDP pieces

def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start part-way into an epoch, at the world size it stopped at or another.

    An epoch's order is DistributedSampler's: one permutation of the dataset (seeded by ``seed + epoch``,
    the same at every world size) padded to a multiple of the world size W, rank r reading every W-th
    sample from r. After b batches of B on every rank, all ranks together have read exactly its first
    b * B * W samples, so ``set_start(samples_done)`` resumes any world size W' on the rest: it is padded
    to a multiple of W' (from its own beginning, as DistributedSampler pads) and dealt out the same way.
    At an unchanged world size that is DistributedSampler's own order from batch b on, sample for sample.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start = 0  # samples of this epoch's order already read, by all ranks together

    def set_start(self, samples_done: int) -> None:
        self.start = samples_done

    def _rest(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=g).tolist()
        else:
            order = list(range(len(self.dataset)))
        order = _pad_or_trim(order, self.total_size)  # = DistributedSampler's
        rest = order[self.start:]
        return rest[:len(rest) - len(rest) % self.num_replicas] if self.drop_last else \
            _pad_or_trim(rest, math.ceil(len(rest) / self.num_replicas) * self.num_replicas)

    def __iter__(self):
        return iter(self._rest()[self.rank::self.num_replicas])

    def __len__(self):
        rest = max(self.total_size - self.start, 0)
        return rest // self.num_replicas if self.drop_last else math.ceil(rest / self.num_replicas)


def _pad_or_trim(indices: list[int], size: int) -> list[int]:
    """``indices`` cut to ``size``, or padded to it by repeating them from the start."""
    if size <= len(indices) or not indices:
        return indices[:size]
    return (indices * math.ceil(size / len(indices)))[:size]


@dataclass
class Position:
    """Where training is: epoch (0-based), batches done in it (on each rank), optimizer steps so far, and
    the samples of the epoch's order read so far by all ranks together (what a resume at another world
    size starts from)."""

    epoch: int = 0
    batches_done: int = 0
    global_step: int = 0
    samples_done: int = 0


def param_fingerprint(model: torch.nn.Module) -> torch.Tensor:
    """Per-tensor (sum, sum of squares) in float64: equal on all ranks iff (practically) identical."""
    with torch.no_grad():
        rows = [torch.stack([p.double().sum(), p.double().pow(2).sum()]) for p in model.parameters()]
    return torch.stack(rows).flatten()


def assert_identical_parameters(model: torch.nn.Module) -> None:
    """Practice 1: after DDP's broadcast every rank must hold rank 0's parameters."""
    fp = param_fingerprint(model)
    lo, hi = fp.clone(), fp.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)  # sync point: all ranks
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    if not torch.equal(lo, hi):
        raise RuntimeError("ranks hold different parameters after DDP wrapping")


def global_sum_and_count(loss_sum: torch.Tensor, count: torch.Tensor) -> tuple[float, float]:
    """Practice 4: (sum, n) over all ranks (one all_reduce of [sum, n])."""
    t = torch.stack([torch.as_tensor(loss_sum).double(), torch.as_tensor(count, device=loss_sum.device).double()])
    dist.all_reduce(t)  # sync point: all ranks
    return t[0].item(), t[1].item()


def global_mean(loss_sum: torch.Tensor, count: torch.Tensor) -> float:
    """Practice 4: sample-weighted mean over all ranks (one all_reduce of [sum, n])."""
    total, n = global_sum_and_count(loss_sum, count)
    return total / max(n, 1.0)


def gather_eval_rows(indices: torch.Tensor, values: torch.Tensor, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Practice 5: all_gather (index, value columns...) from every rank, keep each index once.

    DistributedSampler pads the last round with repeated indices so every rank
    gets the same count; keeping each dataset index once makes every metric
    equal a single-process evaluation exactly. Returns (indices, rows) in gather order.
    """
    local = torch.cat([indices.double().unsqueeze(1), values.double()], dim=1)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)  # sync point: all ranks
    rows = torch.cat(gathered).cpu()
    _, first = np.unique(rows[:, 0].numpy(), return_index=True)
    unique = rows[torch.from_numpy(np.sort(first))]
    return unique[:, 0].long(), unique[:, 1:]


# Exact sums of float64 values, whatever their order (and so the world size): every finite float64 is
# M * 2^(e - 53) with an integer |M| < 2^53 and e - 53 >= -1126, an integer multiple of 2^-1126; its
# 16-bit pieces are counted in int64 limbs (each add < 2^32: exact for up to 2^31 samples).
_EXACT_SHIFT, _LIMB_BITS = 1126, 16
_LIMBS = (1024 - 53 + _EXACT_SHIFT + 53) // _LIMB_BITS + 2


class ExactSums:
    """Per-metric sums and the sample count of this rank's eval values, padding masked out, exact; one
    ``all_reduce`` makes them every rank's (O(metrics) numbers, not O(samples)). ``means()`` rounds once:
    it equals ``math.fsum(values) / n`` over the distinct samples of a single process, bit for bit."""

    CHUNK_ROWS = 1 << 16  # batches are summed in chunks of this many rows: fewer, larger tensor ops

    def __init__(self, num_metrics: int, device: torch.device):
        self.limbs = torch.zeros(num_metrics, _LIMBS, dtype=torch.int64, device=device)
        self.special = torch.zeros(num_metrics, 3, dtype=torch.int64, device=device)  # nan, +inf, -inf
        self.count = torch.zeros(1, dtype=torch.int64, device=device)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pending_rows = 0

    def add(self, values: torch.Tensor, keep: torch.Tensor) -> None:
        """``values`` [B, K] float64; ``keep`` [B] bool (False: a padded duplicate)."""
        self._pending.append((values, keep.to(values.device)))
        self._pending_rows += values.shape[0]
        if self._pending_rows >= self.CHUNK_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            values, keep = (torch.cat(t) for t in zip(*self._pending))
            self._pending, self._pending_rows = [], 0
            self._add(values, keep)

    def _add(self, values: torch.Tensor, keep: torch.Tensor) -> None:
        k = keep.unsqueeze(1).to(torch.int64)
        finite = torch.isfinite(values)
        self.special += torch.stack([torch.isnan(values), values == math.inf, values == -math.inf], dim=2) \
            .to(torch.int64).mul(k.unsqueeze(2)).sum(dim=0)
        mantissa, exponent = torch.frexp(torch.where(finite, values, torch.zeros_like(values)))
        m = torch.ldexp(mantissa, torch.tensor(53.0, dtype=values.dtype, device=values.device)).to(torch.int64)
        offset = exponent.to(torch.int64) - 53 + _EXACT_SHIFT
        limb, shift = offset // _LIMB_BITS, offset % _LIMB_BITS
        sign, magnitude = torch.sign(m) * k, m.abs()
        for j in range(4):  # 4 x 16 bits >= 53
            piece = torch.bitwise_left_shift(torch.bitwise_right_shift(magnitude, _LIMB_BITS * j) & 0xFFFF, shift)
            self.limbs.scatter_add_(1, (limb + j).T, (piece * sign).T)
        self.count += keep.sum()

    def all_reduce(self) -> None:
        self._flush()
        t = torch.cat([self.limbs.flatten(), self.special.flatten(), self.count])
        dist.all_reduce(t)  # sync point: all ranks (sums and counts only, padding already masked)
        n_limbs, n_special = self.limbs.numel(), self.special.numel()
        self.limbs = t[:n_limbs].view_as(self.limbs)
        self.special = t[n_limbs:n_limbs + n_special].view_as(self.special)
        self.count = t[-1:]

    def num_samples(self) -> int:
        return int(self.count.item())

    def means(self) -> list[float]:
        limbs, special, n = self.limbs.cpu().tolist(), self.special.cpu().tolist(), self.num_samples()
        out = []
        for row, (nan, pos, neg) in zip(limbs, special):
            if nan or (pos and neg):
                total = math.nan
            elif pos or neg:
                total = math.inf if pos else -math.inf
            else:
                exact = sum(v << (_LIMB_BITS * i) for i, v in enumerate(row))
                try:
                    total = exact / (1 << _EXACT_SHIFT)  # int / int: correctly rounded
                except OverflowError:
                    total = math.copysign(math.inf, exact)
            out.append(total / n if n else math.nan)
        return out


def lr_lambda(warmup_steps: int, total_steps: int):
    """Linear warmup, then cosine decay to zero."""
    def f(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return f


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor of a batch (tensor, tuple, list, namedtuple, dict, nested) to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, dict):
        return type(batch)((k, to_device(v, device)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def first_dim(batch: Any) -> int:
    """The batch size: the length of the first tensor found in the batch."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()
    for item in items:
        n = first_dim(item)
        if n:
            return n
    return 0


# ---------------------------------------------------------------- building the parts

@dataclass
class Parts:
    """Everything the loop trains with, built once per worker-group start."""

    task: Any
    model: torch.nn.Module  # DDP-wrapped
    module: torch.nn.Module  # the user's module inside it
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    train_sampler: ResumableDistributedSampler
    train_loader: DataLoader
    loader_gen: torch.Generator
    eval_loader: DataLoader
    eval_indices: torch.Tensor  # this rank's eval indices, in the order the eval loader yields them
    eval_keep: torch.Tensor  # bool, the same order: False where the sampler padded (a repeated sample)
    eval_batch_sizes: list[int]
    batches_per_epoch: int
    steps_per_epoch: int
    total_steps: int
    param_keys: frozenset  # state-dict keys only an optimizer step changes (a staged checkpoint copies them later)


def build_parts(cfg: Config, runtime: Runtime) -> Parts:
    """Data, model, task, samplers, loaders, optimizer and LR schedule, in the order that keeps ranks equal."""
    train_set, eval_set, info = build_data(cfg)
    info = dict(info)
    collate_fn = info.pop("collate_fn", None)  # a data plug-in may hand over its own
    seed_everything(cfg.run.seed)  # practice 1: identical init on every rank
    module = build_model(cfg, info).to(runtime.device)
    model = runtime.prepare_model(module, bucket_cap_mb=cfg.train.bucket_cap_mb)
    module = getattr(model, "module", model)
    assert_identical_parameters(model)
    seed_everything(cfg.run.seed * 1000 + runtime.rank)  # per-rank streams (dropout, augmentation)
    task = build_task(cfg)

    world, rank, bs = runtime.world_size, runtime.rank, cfg.data.batch_size
    train_sampler = ResumableDistributedSampler(train_set, world, rank, shuffle=True, seed=cfg.run.seed, drop_last=False)
    eval_sampler = DistributedSampler(eval_set, world, rank, shuffle=False, drop_last=False)
    eval_indices = torch.tensor(list(iter(eval_sampler)))
    loader_gen = torch.Generator()  # reseeded every epoch: never touches the global RNG
    pin = runtime.device.type == "cuda"

    def loader(dataset, sampler, generator):
        return DataLoader(dataset, batch_size=bs, sampler=sampler, num_workers=cfg.data.loader_workers,
                          pin_memory=pin, generator=generator, collate_fn=collate_fn,
                          persistent_workers=cfg.data.loader_workers > 0)

    batches_per_epoch = math.ceil(train_sampler.num_samples / bs)
    steps_per_epoch = math.ceil(batches_per_epoch / cfg.train.grad_accum)
    # the LR schedule is planned for all epochs; train.max_steps only stops early
    # (like a preemption), so a run stopped that way resumes onto the same schedule
    total_steps = steps_per_epoch * cfg.train.epochs
    optimizer, scheduler = build_optimizer(cfg, model, steps_per_epoch, total_steps)
    n_eval = len(eval_indices)
    return Parts(
        task=task, model=model, module=module, optimizer=optimizer, scheduler=scheduler,
        train_sampler=train_sampler, train_loader=loader(train_set, train_sampler, loader_gen), loader_gen=loader_gen,
        # its own generator too: iterating a DataLoader draws a seed, and evaluation
        # must not move the training RNG (or a resumed run would diverge)
        eval_loader=loader(eval_set, eval_sampler, torch.Generator().manual_seed(cfg.run.seed)),
        # DistributedSampler deals position p of the padded order to rank p % world; positions past the
        # data set's end are the padding (repeats of its first samples)
        eval_keep=torch.arange(n_eval) * world + rank < len(eval_set),
        eval_indices=eval_indices, eval_batch_sizes=[min(bs, n_eval - i) for i in range(0, n_eval, bs)],
        batches_per_epoch=batches_per_epoch, steps_per_epoch=steps_per_epoch, total_steps=total_steps,
        param_keys=frozenset(n for n, _ in module.named_parameters(remove_duplicate=False)),
    )


def build_optimizer(cfg: Config, model: torch.nn.Module, steps_per_epoch: int, total_steps: int):
    t = cfg.train
    if t.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    warmup = round(t.warmup_epochs * steps_per_epoch)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(warmup, total_steps))


def apply_hyperparameters(cfg: Config, optimizer, scheduler) -> None:
    """After loading a checkpoint: the config's lr, weight decay and momentum win over the saved ones
    (loading restores them; a resumed run may change them). Unchanged, this sets what was loaded.

    Through public attributes only: the optimizer's groups hold the LR in use (what the loop logs);
    the scheduler's record of its last LR (``get_last_lr``) follows at its next ``step``."""
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.train.lr
        group["weight_decay"] = cfg.train.weight_decay
        if cfg.train.optimizer == "sgd":
            group["momentum"] = cfg.train.momentum
    scheduler.base_lrs = [cfg.train.lr for _ in optimizer.param_groups]
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


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

    def mark(self, name: str) -> None:
        self.timeline.setdefault(name, time.time())

    def start_training(self, global_step: int) -> None:
        self.t_start = time.perf_counter()
        self.steady_from_step = global_step + STEADY_SKIP_STEPS

    def on_step(self, global_step: int, samples_per_step: int) -> None:
        self.mark("first_step_unix")
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


@dataclass
class _Interval:
    """One logging interval's sums (this rank)."""

    t0: float
    step0: int
    loss_sum: torch.Tensor
    count: torch.Tensor
    batches: int = 0


# ---------------------------------------------------------------- the loop

class Trainer:
    """One worker's view of a DDP run: fit, epoch, step, evaluate."""

    def __init__(self, cfg: Config, runtime: Runtime, parts: Parts, checkpointer, metrics: MetricsSink,
                 stats: RunStats | None = None, preemption: Agreement | None = None):
        self.cfg, self.rt, self.parts, self.ckpt, self.metrics = cfg, runtime, parts, checkpointer, metrics
        self.preemption = preemption or Agreement(enabled=False)  # asked at every step boundary
        self.leaving = 0  # the kind of notice every rank agreed on (PREEMPT, STOP): checkpoint at the next resumable boundary, leave
        self._checkpointed_at = -1  # global step of this attempt's newest checkpoint
        self.rank, self.world_size, self.device = runtime.rank, runtime.world_size, runtime.device
        self.is_rank0 = self.rank == 0  # the one predicate that decides who logs, writes and serves
        self.task, self.model, self.module = parts.task, parts.model, parts.module
        self.optimizer, self.scheduler = parts.optimizer, parts.scheduler
        self.amp = cfg.train.amp and self.device.type == "cuda"  # bf16 autocast: no loss scaling (no GradScaler)
        self.stats = stats or RunStats()
        self.pos = Position()
        self.resumed_from_step = 0
        self.resumed_checkpoint_unix = 0.0
        self.resumed_tracking: dict = {}  # the sink's checkpoint_state() of the checkpoint resumed from
        self.last_eval: dict = {}
        self.last_train_loss = float("nan")
        self._evaluated_at = -1  # global step of the newest evaluation (the final one is skipped when it is this step)
        self.epoch_loss = torch.zeros((), device=self.device)  # this epoch (this attempt), this rank
        self.epoch_count = torch.zeros((), device=self.device)
        self._loss_checked = False  # the task's loss output is checked against the contract once

    def print0(self, msg: str) -> None:
        if self.is_rank0:
            print(msg, flush=True)

    # ------------------------------------------------------------ resume
    def restore(self) -> None:
        try:
            loaded = self.ckpt.restore(self.rank)
        except CheckpointError as exc:  # run.resume_from with no checkpoint that loads, or one torch refuses
            raise PluginError(str(exc)) from None  # bad input: one line, exit 2, not retried
        if loaded is None:
            return
        conflicts = resume_conflicts(loaded.config, self.cfg)
        if conflicts and not self.ckpt.warm_start:
            raise PluginError(f"checkpoint {loaded.uri} was made with another {', '.join(conflicts)}; "
                              "use another run.name (or run.resume_from to warm-start)")
        try:
            self.module.load_state_dict(loaded.model)
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[0][:300]
            raise PluginError(f"checkpoint {loaded.uri} does not fit model.name={self.cfg.model.name} ({first}); "
                              "use another run.name for a changed model") from None
        if conflicts:  # a warm start from another run's checkpoint: its weights, a fresh start otherwise
            self.print0(f"warm start from {loaded.uri}: model weights only (it differs in {', '.join(conflicts)})")
            return
        self.optimizer.load_state_dict(loaded.optimizer)
        if loaded.scheduler:
            self.scheduler.load_state_dict(loaded.scheduler)
        s = loaded.state
        saved_world = s.get("world_size", self.world_size)
        bs = self.cfg.data.batch_size
        self.pos = Position(s["epoch"], s["batches_done"], s["global_step"],
                            s.get("samples_done", s["batches_done"] * bs * saved_world))
        if saved_world != self.world_size:
            self._reshard(saved_world)
        apply_hyperparameters(self.cfg, self.optimizer, self.scheduler)
        if loaded.rng is not None:
            restore_rng_state(loaded.rng)
        else:  # a rank the checkpoint's world did not have: a stream of its own, derived, not the run's first
            seed_everything(self.cfg.run.seed * 1000 + self.rank + 1_000_003 * self.pos.global_step)
        self.resumed_from_step = self.pos.global_step
        self.resumed_checkpoint_unix = loaded.created
        self.last_eval = s.get("last_eval", {})
        self.resumed_tracking = s.get("tracking", {})
        self.print0(f"resumed from {loaded.uri} at epoch {self.pos.epoch} batch {self.pos.batches_done} "
                    f"step {self.pos.global_step}")

    # ------------------------------------------------------------ training
    def fit(self) -> dict:
        self.restore()
        self._announce()
        self.stats.start_training(self.pos.global_step)
        if self.preemption.enabled:
            TRAINING.set()  # a SIGTERM from now on is a notice to checkpoint (ray_app.preemption)
        try:
            while self.pos.epoch < self.cfg.train.epochs and not self._done():
                self.train_epoch(self.pos.epoch)
        finally:
            TRAINING.clear()
        self.preemption.close()  # the last step's flag is still on its way
        if self._evaluated_at != self.pos.global_step:  # an epoch's end just evaluated these parameters
            self.last_eval = self.evaluate()
        summary = self._final_metrics()
        self._final_checkpoint(summary)
        self._account(self.ckpt.settle())
        summary.update(checkpoint_blocked_seconds=round(self.ckpt.blocked_seconds, 4),
                       checkpoints_written=self.ckpt.written)
        self.metrics.close()
        return summary

    def _done(self) -> bool:
        return bool(self.cfg.train.max_steps) and self.pos.global_step >= self.cfg.train.max_steps

    def _announce(self) -> None:
        host = socket.gethostname()
        try:
            ip = socket.gethostbyname(host)
        except OSError:
            ip = "unknown"
        # every rank says where it runs (one line each: the e2e tests check ranks land on different nodes)
        print(f"rank {self.rank}/{self.world_size} on host {host} ip {ip} device {self.device}", flush=True)
        c = self.cfg
        self.print0(f"run {c.run.name}: {c.model.name} on {c.data.name}, task {c.task.name}, "
                    f"{self.parts.steps_per_epoch} steps/epoch x {c.train.epochs} epochs, world size {self.world_size}")
        self.metrics.start(run=c.run.name, model=c.model.name, dataset=c.data.name, task=c.task.name,
                           version=__version__, world_size=self.world_size, resumed_from_step=self.resumed_from_step,
                           global_step=self.pos.global_step, epoch=self.pos.epoch, use_gpu=self.device.type == "cuda",
                           last_checkpoint_unix=self.resumed_checkpoint_unix, tracking=self.resumed_tracking)

    def _new_interval(self) -> _Interval:
        zero = torch.zeros((), device=self.device)
        return _Interval(time.perf_counter(), self.pos.global_step, zero, zero.clone())

    def train_epoch(self, epoch: int) -> None:
        cfg, parts, accum = self.cfg, self.parts, self.cfg.train.grad_accum
        self.model.train()
        parts.train_sampler.set_epoch(epoch)  # practice 2: a new order every epoch
        parts.train_sampler.set_start(self.pos.samples_done)
        parts.loader_gen.manual_seed(cfg.run.seed * 1_000_003 + epoch)
        self.epoch_loss.zero_(), self.epoch_count.zero_()
        interval = self._new_interval()
        step_t0 = time.perf_counter()
        for batch in parts.train_loader:
            b = self.pos.batches_done
            group_start = b - b % accum
            group_size = min(accum, parts.batches_per_epoch - group_start)
            last_micro = (b - group_start + 1) == group_size
            loss, n = self._forward_backward(to_device(batch, self.device), group_size, sync=last_micro)
            interval.loss_sum += loss.detach() * n
            interval.count += n
            interval.batches += 1
            self.pos.batches_done += 1
            self.pos.samples_done += cfg.data.batch_size * self.world_size  # full batches until the epoch's last
            if not last_micro:
                continue
            self._optimizer_step()
            now = time.perf_counter()
            self.metrics.on_step(now - step_t0)
            step_t0 = now
            if self.pos.global_step % cfg.train.log_every_steps == 0:
                self._log_progress(interval)
                interval = self._new_interval()
            self.leaving = max(self.leaving, self.preemption.poll())  # 0, PREEMPT or STOP
            if self.ckpt.step_due(self.pos, parts.batches_per_epoch) and not self._done():
                self.checkpoint()
            if self._done():
                break
            if self.leaving and self.pos.batches_done < parts.batches_per_epoch:
                self._leave()  # an epoch's last batch leaves after _end_epoch instead: that is where it resumes
        if self.pos.batches_done >= parts.batches_per_epoch:
            self._end_epoch(interval)
            if self.leaving and self.pos.epoch < cfg.train.epochs and not self._done():
                self._leave()
        elif self._done():  # train.max_steps ends training inside the epoch
            self._end_partial_epoch(interval)

    def _leave(self) -> None:
        """Every rank: checkpoint here (unless this step has one), wait until it is committed, raise."""
        if self._checkpointed_at != self.pos.global_step:
            self.checkpoint()
        self._account(self.ckpt.settle())
        self.ckpt.wait_committed()
        dist.barrier()  # no rank leaves before the writer's commit: the first to leave ends the group
        self.preemption.close()
        step, uri = self.pos.global_step, self.ckpt.last_uri
        if self.leaving == STOP:
            self.print0(f"stopped: checkpoint {uri} at step {step} committed; submit the run again "
                        f"(run.name {self.cfg.run.name}) to resume from it")
            raise Stopped(f"stopped at step {step}; checkpoint {uri}")
        self.print0(f"preempted: checkpoint {uri} at step {step} committed; the worker group restarts from it")
        raise Preempted(f"preempted at step {step}; resume from {uri}")

    def _reshard(self, saved_world: int) -> None:
        """Resuming at another world size: the rest of the epoch is dealt out over this one (the sampler),
        and the LR schedule goes to where a run at this world size would be after as many samples. The
        per-worker batch stays data.batch_size, so the global batch is data.batch_size x the world size;
        global_step keeps counting the optimizer steps taken."""
        parts, accum = self.parts, self.cfg.train.grad_accum
        parts.train_sampler.set_start(self.pos.samples_done)
        left = math.ceil(len(parts.train_sampler) / self.cfg.data.batch_size)
        self.pos.batches_done = parts.batches_per_epoch - left
        self.scheduler.last_epoch = self.pos.epoch * parts.steps_per_epoch + self.pos.batches_done // accum
        self.print0(f"world size {saved_world} -> {self.world_size}: the rest of epoch {self.pos.epoch} "
                    f"({self.pos.samples_done} of its samples read) re-sharded, {left} batches per rank left; "
                    f"global batch {self.cfg.data.batch_size * self.world_size}")

    def _forward_backward(self, batch, group_size: int, sync: bool):
        # practice 3: DDP all-reduces gradients during backward; on non-final
        # micro-steps no_sync() skips that all-reduce (gradients accumulate locally)
        ctx = contextlib.nullcontext() if sync or not hasattr(self.model, "no_sync") else self.model.no_sync()
        with ctx:
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
                loss, n = self._task_loss(batch)
            (loss / group_size).backward()
        return loss, n

    def _task_loss(self, batch):
        out = self.task.loss(self.model, batch)
        loss, n = (out, first_dim(batch)) if isinstance(out, torch.Tensor) else (out if isinstance(out, (tuple, list))
                                                                                 and len(out) == 2 else (out, None))
        if not self._loss_checked:
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
                raise PluginError(f"config key task.name: {self.cfg.task.name}.loss(model, batch) returned "
                                  f"{_describe(out)}; it must return (mean_loss, num_samples) with mean_loss a "
                                  "scalar tensor that requires grad")
            if not isinstance(n, (int, float, torch.Tensor)) or isinstance(n, bool) or \
                    (isinstance(n, torch.Tensor) and n.numel() != 1) or float(n) <= 0:
                raise PluginError(f"config key task.name: {self.cfg.task.name}.loss returned num_samples={n!r}; "
                                  "it must be a positive number (the samples the mean is over)")
            self._loss_checked = True
        return loss.reshape(()), n

    def _optimizer_step(self) -> None:
        self._account(self.ckpt.settle())  # a staged snapshot is still copying what step() changes
        if self.cfg.train.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.clip_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.pos.global_step += 1
        self.stats.on_step(self.pos.global_step, self.cfg.data.batch_size * self.cfg.train.grad_accum * self.world_size)

    def _log_progress(self, interval: _Interval) -> None:
        # collective: every rank calls it at the same step
        total, n = global_sum_and_count(interval.loss_sum, interval.count)
        loss = total / max(n, 1.0)
        self.epoch_loss += interval.loss_sum
        self.epoch_count += interval.count
        dt = time.perf_counter() - interval.t0
        samples = int(n)  # all ranks' samples (the task's num_samples may differ by rank)
        sps = samples / dt if dt > 0 else 0.0
        steps = self.pos.global_step - interval.step0
        eta = (self.parts.total_steps - self.pos.global_step) * dt / max(steps, 1)
        lr = self.optimizer.param_groups[0]["lr"]  # the LR in use (= the scheduler's, set by its step)
        self.metrics.on_progress(epoch=self.pos.epoch, global_step=self.pos.global_step, lr=lr, train_loss=loss,
                                 samples=samples, samples_per_second=sps)
        if self.device.type == "cuda":
            self.metrics.on_gpu_memory(allocated=torch.cuda.memory_allocated(),
                                       max_allocated=torch.cuda.max_memory_allocated())
        self.print0(f"epoch {self.pos.epoch} step {self.pos.global_step}/{self.parts.total_steps} "
                    f"loss {loss:.4f} lr {lr:.4g} {sps:,.0f} samples/s eta {_fmt_eta(eta)}")

    def _end_partial_epoch(self, interval: _Interval) -> None:
        """train.max_steps stopped inside an epoch (every rank at the same step): the train loss of the
        steps this epoch trained, so the summary reports what was trained (the final eval follows in fit)."""
        if interval.batches:
            self._log_progress(interval)
        self.last_train_loss = global_mean(self.epoch_loss, self.epoch_count)

    def _end_epoch(self, interval: _Interval) -> None:
        # every rank has the same number of batches (the sampler pads), so this branch is collective-safe
        if interval.batches:
            self._log_progress(interval)
        self.last_train_loss = global_mean(self.epoch_loss, self.epoch_count)
        self.last_eval = self.evaluate()
        self._evaluated_at = self.pos.global_step
        shown = " ".join(f"{k} {v:.4f}" for k, v in self.last_eval.items() if k.startswith("eval_"))
        self.print0(f"epoch {self.pos.epoch} done: train loss {self.last_train_loss:.4f} {shown}")
        self.pos.epoch += 1
        self.pos.batches_done = self.pos.samples_done = 0
        if self.ckpt.epoch_due(self.pos.epoch, self.cfg.train.epochs) and not self._done():
            self.checkpoint()
        else:
            self.rt.report(self._metrics_dict())  # one report per epoch on every rank (Ray's barrier)

    # ------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Practice 5: every metric of the task, exact over the distinct eval samples of all ranks."""
        self.model.eval()
        parts, names, sums, columns, start = self.parts, None, None, [], 0
        summarize_rows = getattr(self.task, "summarize_rows", None)
        for i, batch in enumerate(parts.eval_loader):
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
                values = self.task.evaluate(self.model, to_device(batch, self.device))
            names = names or self._check_eval_names(values)
            size = parts.eval_batch_sizes[i]
            batch_columns = self._eval_columns(values, names, size)
            sums = sums or ExactSums(len(names), batch_columns.device)
            sums.add(batch_columns, parts.eval_keep[start:start + size])
            start += size
            if callable(summarize_rows):  # this task needs every value, not only the means
                columns.append(batch_columns)
        sums.all_reduce()
        self.model.train()
        means = dict(zip(names, sums.means()))
        if callable(summarize_rows):
            idx, rows = gather_eval_rows(parts.eval_indices.to(self.device), torch.cat(columns), self.world_size)
            rows = rows[idx.argsort()]  # in the data set's order
            means.update({k: float(v) for k, v in summarize_rows({n: rows[:, j] for j, n in enumerate(names)}).items()})
        summarize = getattr(self.task, "summarize", None)
        if callable(summarize):
            means.update({k: float(v) for k, v in summarize(dict(means)).items()})
        self.metrics.on_eval(dict(means))
        return {**{f"eval_{k}": v for k, v in means.items()}, "num_samples": sums.num_samples()}

    def _check_eval_names(self, values) -> list[str]:
        if not isinstance(values, dict) or not values:
            raise PluginError(f"config key task.name: {self.cfg.task.name}.evaluate(model, batch) returned "
                              f"{_describe(values)}; it must return {{name: per-sample tensor of shape [B]}}")
        bad = [k for k in values if not (isinstance(k, str) and k.isidentifier() and k == k.lower())]
        if bad:
            raise PluginError(f"config key task.name: {self.cfg.task.name}.evaluate returned the metric name "
                              f"{bad[0]!r}; use lower-case names such as 'accuracy' (reported as eval_<name>)")
        return list(values)

    def _eval_columns(self, values: dict, names: list[str], batch_size: int) -> torch.Tensor:
        if list(values) != names:
            raise PluginError(f"config key task.name: {self.cfg.task.name}.evaluate returned {sorted(values)} for "
                              f"one batch and {sorted(names)} for another; return the same metrics for every batch")
        for name, v in values.items():
            if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.shape[0] != batch_size:
                shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise PluginError(f"config key task.name: {self.cfg.task.name}.evaluate returned {name!r} of shape "
                                  f"{shape}; each value must be a per-sample tensor of shape [{batch_size}] "
                                  "(the batch's size)")
        return torch.stack([values[n].double() for n in names], dim=1)

    # ------------------------------------------------------------ checkpoints
    def _metrics_dict(self) -> dict:
        return {"epoch": self.pos.epoch, "global_step": self.pos.global_step, "train_loss": self.last_train_loss,
                "resumed_from_step": self.resumed_from_step, **self.last_eval}

    def checkpoint(self, metrics: dict | None = None) -> None:
        """Every rank calls this at the same point (RNG gather + Ray's report are collectives)."""
        gathered = [None] * self.world_size
        # sync point: each rank's RNG goes to rank 0, and rank 0's name for the checkpoint to every rank
        dist.all_gather_object(gathered, (capture_rng_state(), self.ckpt.new_name(self.pos.global_step)))
        rng_all = [rng for rng, _ in gathered]
        name = gathered[0][1]  # the writer's: every rank reports the directory that will exist
        metrics = dict(self._metrics_dict(), **(metrics or {}))
        payload = None
        if self.is_rank0:
            payload = CheckpointPayload(
                model=self.module.state_dict(), optimizer=self.optimizer.state_dict(),
                scheduler=self.scheduler.state_dict(), rng_per_rank=rng_all,
                state={"epoch": self.pos.epoch, "batches_done": self.pos.batches_done,
                       "samples_done": self.pos.samples_done,
                       "global_step": self.pos.global_step, "world_size": self.world_size,
                       "last_eval": self.last_eval, "tracking": self.metrics.checkpoint_state()},
                config=self.cfg.to_dict(), metrics=metrics,
            )
        self._account(self.ckpt.save(payload, metrics, is_writer=self.is_rank0, param_keys=self.parts.param_keys,
                                     name=name))
        self._checkpointed_at = self.pos.global_step

    def _account(self, blocked: float | None) -> None:
        if blocked is not None:
            self.metrics.on_checkpoint(blocked_seconds=blocked)

    def _final_metrics(self) -> dict:
        return {**self._metrics_dict(), "epochs": self.pos.epoch, "world_size": self.world_size,
                "train_seconds": self.stats.train_seconds(),
                "steady_samples_per_second": self.stats.steady_rate(), **self.stats.timeline}

    def _final_checkpoint(self, summary: dict) -> None:
        """Always end on a committed checkpoint (unless checkpoints are off or nothing new was trained)."""
        if self.ckpt.final_due(self.pos.global_step, self.resumed_from_step):
            self.checkpoint(summary)
        else:
            self.rt.report(dict(summary, checkpoint=self.ckpt.last_uri))
        summary["checkpoint"] = self.ckpt.last_uri


def _describe(obj) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a tensor of shape {tuple(obj.shape)}"
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of {len(obj)} items"
    return f"a {type(obj).__name__}"


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
