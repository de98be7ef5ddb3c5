"""The per-worker DDP loop: train epoch, global loss, exact evaluation.

It reads like the practices it implements (see DESIGN.md):

1. every rank starts from identical parameters (seeded init, DDP's broadcast,
   and a check that they really are equal);
2. a DistributedSampler splits the data, ``set_epoch`` every epoch;
3. DDP averages gradients with its bucketed all-reduce during backward
   (skipped with ``no_sync`` on non-final gradient-accumulation micro-steps);
4. the logged loss is the sample-weighted global mean over ranks;
5. evaluation gathers predictions from all ranks and drops the sampler's
   padded duplicates, so accuracy equals a single-process evaluation;
6. only rank 0 prints and serves metrics.

Infrastructure arrives as small objects: ``runtime`` (topology, DDP wrapping,
reporting), ``checkpointer`` and ``metrics``. No Ray, S3 or Prometheus here.
"""

from __future__ import annotations

import contextlib
import math
import random
import socket
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from ray_app import __version__
from ray_app.checkpoint import CheckpointPayload, capture_rng_state, restore_rng_state
from ray_app.config import Config
from ray_app.data import build_datasets
from ray_app.models import build_model


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start part-way into an epoch (mid-epoch resume)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start_index = 0

    def set_start_batch(self, batch: int, batch_size: int) -> None:
        self.start_index = batch * batch_size

    def __iter__(self):
        indices = list(super().__iter__())
        return iter(indices[self.start_index:])

    def __len__(self):
        return max(self.num_samples - self.start_index, 0)


@dataclass
class Position:
    """Where training is: epoch (0-based), batches done in it, optimizer steps so far."""

    epoch: int = 0
    batches_done: int = 0
    global_step: int = 0


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


def global_mean(loss_sum: torch.Tensor, count: torch.Tensor) -> float:
    """Practice 4: sample-weighted mean over all ranks (one all_reduce of [sum, n])."""
    t = torch.stack([loss_sum.double(), count.double()])
    dist.all_reduce(t)  # sync point: all ranks
    return (t[0] / t[1].clamp(min=1)).item()


def gather_predictions(indices: torch.Tensor, preds: torch.Tensor, targets: torch.Tensor, losses: torch.Tensor,
                       world_size: int):
    """Practice 5: all_gather (index, prediction, target, loss) from every rank, drop duplicates.

    DistributedSampler pads the last round with repeated indices so every rank
    gets the same count; keeping each dataset index once makes the global
    metric equal a single-process evaluation exactly.
    """
    local = torch.stack([indices.double(), preds.double(), targets.double(), losses.double()], dim=1)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)  # sync point: all ranks
    rows = torch.cat(gathered).cpu()
    _, first = np.unique(rows[:, 0].numpy(), return_index=True)
    unique = rows[torch.from_numpy(np.sort(first))]
    return unique[:, 0].long(), unique[:, 1].long(), unique[:, 2].long(), unique[:, 3]


def lr_lambda(warmup_steps: int, total_steps: int):
    """Linear warmup, then cosine decay to zero."""
    def f(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return f


class Trainer:
    """One worker's view of a DDP run."""

    def __init__(self, cfg: Config, runtime, checkpointer, metrics):
        self.cfg, self.rt, self.ckpt, self.metrics = cfg, runtime, checkpointer, metrics
        self.rank, self.world_size, self.device = runtime.rank, runtime.world_size, runtime.device
        self.is_rank0 = self.rank == 0  # the one predicate that decides who prints, writes and serves
        self.pos = Position()
        self.resumed_from_step = 0
        self.resumed_checkpoint_unix = 0.0
        self.last_eval: dict = {}
        self.last_train_loss = float("nan")

    # ------------------------------------------------------------ set-up
    def print0(self, msg: str) -> None:
        if self.is_rank0:
            print(msg, flush=True)

    def build(self) -> None:
        cfg = self.cfg
        train_set, eval_set, self.data_info = build_datasets(cfg.data)
        seed_everything(cfg.run.seed)  # practice 1: identical init on every rank
        model = build_model(cfg.model.name, self.data_info).to(self.device)
        self.model = self.rt.prepare_model(model, bucket_cap_mb=cfg.train.bucket_cap_mb)
        self.module = getattr(self.model, "module", self.model)
        # state-dict keys only an optimizer step changes (a staged checkpoint copies them in the background)
        self.param_keys = frozenset(n for n, _ in self.module.named_parameters(remove_duplicate=False))
        assert_identical_parameters(self.model)
        seed_everything(cfg.run.seed * 1000 + self.rank)  # per-rank streams (dropout, augmentation)

        self.train_sampler = ResumableDistributedSampler(train_set, self.world_size, self.rank, shuffle=True,
                                                         seed=cfg.run.seed, drop_last=False)
        self.eval_sampler = DistributedSampler(eval_set, self.world_size, self.rank, shuffle=False, drop_last=False)
        self.eval_indices = torch.tensor(list(iter(self.eval_sampler)))
        self.loader_gen = torch.Generator()  # reseeded every epoch: never touches the global RNG
        self.train_loader = self._loader(train_set, self.train_sampler, self.loader_gen)
        # its own generator too: iterating a DataLoader draws a seed, and evaluation
        # must not move the training RNG (or a resumed run would diverge)
        self.eval_loader = self._loader(eval_set, self.eval_sampler, torch.Generator().manual_seed(cfg.run.seed))
        self.batches_per_epoch = math.ceil(self.train_sampler.num_samples / cfg.data.batch_size)
        self.steps_per_epoch = math.ceil(self.batches_per_epoch / cfg.train.grad_accum)
        # the LR schedule is planned for all epochs; train.max_steps only stops early
        # (like a preemption), so a run stopped that way resumes onto the same schedule
        self.total_steps = self.steps_per_epoch * cfg.train.epochs
        self._build_optimizer()

    def _loader(self, dataset, sampler, generator) -> DataLoader:
        cfg = self.cfg.data
        loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.loader_workers,
                            pin_memory=self.device.type == "cuda", generator=generator,
                            persistent_workers=cfg.loader_workers > 0)
        return self.rt.prepare_loader(loader)

    def _build_optimizer(self) -> None:
        t = self.cfg.train
        params = self.model.parameters()
        if t.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
        warmup = round(t.warmup_epochs * self.steps_per_epoch)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(warmup, self.total_steps))
        self.amp = t.amp and self.device.type == "cuda"
        self.scaler = torch.amp.GradScaler("cuda", enabled=False)  # bf16 needs no loss scaling; kept for fp16 parity

    def restore(self) -> None:
        loaded = self.ckpt.restore(self.rank)
        if loaded is None:
            return
        self.module.load_state_dict(loaded.model)
        self.optimizer.load_state_dict(loaded.optimizer)
        if loaded.scheduler:
            self.scheduler.load_state_dict(loaded.scheduler)
        if loaded.scaler:
            self.scaler.load_state_dict(loaded.scaler)
        s = loaded.state
        self.pos = Position(s["epoch"], s["batches_done"], s["global_step"])
        if loaded.rng is not None:
            restore_rng_state(loaded.rng)
        self.resumed_from_step = self.pos.global_step
        self.resumed_checkpoint_unix = loaded.created
        self.last_eval = loaded.state.get("last_eval", {})
        self.print0(f"resumed from {loaded.uri} at epoch {self.pos.epoch} batch {self.pos.batches_done} "
                    f"step {self.pos.global_step}")

    # ------------------------------------------------------------ training
    def fit(self) -> dict:
        self.timeline = {"worker_start_unix": time.time()}  # where start-up time goes (benchmarks read it)
        self.build()
        self.timeline["model_ready_unix"] = time.time()
        self.restore()
        self._announce()
        self.t_start = time.perf_counter()
        self.samples_seen = 0
        self.ckpt_blocked_seconds, self.checkpoints_written, self._ckpt_pending_blocked = 0.0, 0, None
        self._steady = _Steady(first_step=self.pos.global_step + STEADY_SKIP_STEPS)
        while self.pos.epoch < self.cfg.train.epochs and not self._done():
            self.train_epoch(self.pos.epoch)
        self.last_eval = self.evaluate()
        summary = self._final_metrics()
        self._final_checkpoint(summary)
        self._settle_checkpoint()
        summary.update(checkpoint_blocked_seconds=round(self.ckpt_blocked_seconds, 4),
                       checkpoints_written=self.checkpoints_written, **self.metrics.cost_summary())
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
        self.print0(f"run {self.cfg.run.name}: {self.cfg.model.name} on {self.cfg.data.name}, "
                    f"{self.steps_per_epoch} steps/epoch x {self.cfg.train.epochs} epochs, world size {self.world_size}")
        self.metrics.start(run=self.cfg.run.name, model=self.cfg.model.name, dataset=self.cfg.data.name,
                           version=__version__, world_size=self.world_size, resumed_from_step=self.resumed_from_step,
                           global_step=self.pos.global_step, epoch=self.pos.epoch, use_gpu=self.device.type == "cuda",
                           last_checkpoint_unix=self.resumed_checkpoint_unix)

    def train_epoch(self, epoch: int) -> None:
        cfg, accum = self.cfg, self.cfg.train.grad_accum
        self.model.train()
        self.train_sampler.set_epoch(epoch)  # practice 2: a new order every epoch
        self.train_sampler.set_start_batch(self.pos.batches_done, cfg.data.batch_size)
        self.loader_gen.manual_seed(cfg.run.seed * 1_000_003 + epoch)
        loss_sum = torch.zeros((), device=self.device)  # this logging interval
        count = torch.zeros((), device=self.device)
        self.epoch_loss = torch.zeros((), device=self.device)  # this epoch (this attempt)
        self.epoch_count = torch.zeros((), device=self.device)
        self.interval_batches = 0
        interval = _Interval(time.perf_counter(), self.pos.global_step)
        step_t0 = time.perf_counter()
        for x, y in self.train_loader:
            b = self.pos.batches_done
            group_start = b - b % accum
            group_size = min(accum, self.batches_per_epoch - group_start)
            last_micro = (b - group_start + 1) == group_size
            loss = self._forward_backward(x, y, group_size, sync=last_micro)
            loss_sum += loss.detach() * y.shape[0]
            count += y.shape[0]
            self.interval_batches += 1
            self.pos.batches_done += 1
            if not last_micro:
                continue
            self._optimizer_step()
            now = time.perf_counter()
            self.metrics.on_step(now - step_t0)
            step_t0 = now
            if self.pos.global_step % cfg.train.log_every_steps == 0:
                self._log_progress(interval, loss_sum, count)
                self.epoch_loss += loss_sum
                self.epoch_count += count
                loss_sum.zero_(), count.zero_()
                self.interval_batches = 0
                interval = _Interval(time.perf_counter(), self.pos.global_step)
            if cfg.checkpoint.every_steps and self.pos.global_step % cfg.checkpoint.every_steps == 0 \
                    and self.pos.batches_done < self.batches_per_epoch and not self._done():
                self.checkpoint()
            if self._done():
                break
        if self.pos.batches_done >= self.batches_per_epoch:
            self._end_epoch(interval, loss_sum, count)

    def _forward_backward(self, x, y, group_size: int, sync: bool) -> torch.Tensor:
        # practice 3: DDP all-reduces gradients during backward; on non-final
        # micro-steps no_sync() skips that all-reduce (gradients accumulate locally)
        ctx = contextlib.nullcontext() if sync or not hasattr(self.model, "no_sync") else self.model.no_sync()
        with ctx:
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
                loss = F.cross_entropy(self.model(x), y)
            (loss / group_size).backward()
        return loss

    def _optimizer_step(self) -> None:
        self._settle_checkpoint()  # a staged snapshot is still copying what step() changes
        if self.cfg.train.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.clip_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.pos.global_step += 1
        if "first_step_unix" not in self.timeline:
            self.timeline["first_step_unix"] = time.time()
        self._steady.on_step(self.pos.global_step, self.cfg.data.batch_size * self.cfg.train.grad_accum * self.world_size)

    def _log_progress(self, interval: "_Interval", loss_sum, count) -> None:
        loss = global_mean(loss_sum, count)  # collective: every rank calls it at the same step
        dt = time.perf_counter() - interval.t0
        samples = int(count.item()) * self.world_size  # approximately: ranks see equal counts
        sps = samples / dt if dt > 0 else 0.0
        steps = self.pos.global_step - interval.step0
        eta = (self.total_steps - self.pos.global_step) * dt / max(steps, 1)
        lr = self.scheduler.get_last_lr()[0]
        self.samples_seen += samples
        self.metrics.on_progress(epoch=self.pos.epoch, global_step=self.pos.global_step, lr=lr, train_loss=loss,
                                 samples=samples, samples_per_second=sps)
        if self.device.type == "cuda":
            self.metrics.on_gpu_memory(allocated=torch.cuda.memory_allocated(),
                                       max_allocated=torch.cuda.max_memory_allocated())
        self.print0(f"epoch {self.pos.epoch} step {self.pos.global_step}/{self.total_steps} "
                    f"loss {loss:.4f} lr {lr:.4g} {sps:,.0f} samples/s eta {_fmt_eta(eta)}")

    def _end_epoch(self, interval, loss_sum, count) -> None:
        # every rank has the same number of batches (the sampler pads), so this branch is collective-safe
        if self.interval_batches:
            self._log_progress(interval, loss_sum, count)
        self.last_train_loss = global_mean(self.epoch_loss + loss_sum, self.epoch_count + count)
        self.last_eval = self.evaluate()
        self.print0(f"epoch {self.pos.epoch} done: train loss {self.last_train_loss:.4f} "
                    f"eval loss {self.last_eval['eval_loss']:.4f} eval accuracy {self.last_eval['eval_accuracy']:.4f}")
        self.pos.epoch += 1
        self.pos.batches_done = 0
        every = self.cfg.checkpoint.every_epochs
        if every and self.pos.epoch % every == 0 and self.pos.epoch < self.cfg.train.epochs and not self._done():
            self.checkpoint()
        else:
            self.rt.report(self._metrics_dict())  # one report per epoch on every rank (Ray's barrier)

    # ------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Practice 5: exact global accuracy and loss over the distinct eval samples."""
        self.model.eval()
        preds, targets, losses = [], [], []
        for x, y in self.eval_loader:
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
                logits = self.model(x)
            losses.append(F.cross_entropy(logits.float(), y, reduction="none"))
            preds.append(logits.argmax(dim=1))
            targets.append(y)
        dev = self.device
        idx, p, t, loss = gather_predictions(self.eval_indices.to(dev), torch.cat(preds), torch.cat(targets),
                                             torch.cat(losses), self.world_size)
        self.model.train()
        result = {"eval_accuracy": (p == t).double().mean().item(), "eval_loss": loss.mean().item(),
                  "num_samples": int(idx.numel())}
        self.metrics.on_eval(eval_loss=result["eval_loss"], eval_accuracy=result["eval_accuracy"])
        return result

    # ------------------------------------------------------------ checkpoints
    def _metrics_dict(self) -> dict:
        return {"epoch": self.pos.epoch, "global_step": self.pos.global_step, "train_loss": self.last_train_loss,
                "resumed_from_step": self.resumed_from_step, **self.last_eval}

    def checkpoint(self, metrics: dict | None = None) -> None:
        """Every rank calls this at the same point (RNG gather + Ray's report are collectives)."""
        rng_all = [None] * self.world_size
        dist.all_gather_object(rng_all, capture_rng_state())  # sync point: each rank's RNG goes to rank 0
        payload = None
        if self.is_rank0:
            payload = CheckpointPayload(
                model=self.module.state_dict(), optimizer=self.optimizer.state_dict(),
                scheduler=self.scheduler.state_dict(), scaler=self.scaler.state_dict(), rng_per_rank=rng_all,
                state={"epoch": self.pos.epoch, "batches_done": self.pos.batches_done,
                       "global_step": self.pos.global_step, "world_size": self.world_size,
                       "last_eval": self.last_eval},
                config=self.cfg.to_dict(), metrics=dict(self._metrics_dict(), **(metrics or {})),
            )
        blocked = self.ckpt.save(payload, dict(self._metrics_dict(), **(metrics or {})), is_writer=self.is_rank0,
                                 param_keys=self.param_keys)
        self._ckpt_pending_blocked = blocked
        if not self.ckpt.staged:
            self._settle_checkpoint()

    def _settle_checkpoint(self) -> None:
        """Account a checkpoint's blocked time once its snapshot (if staged) is complete."""
        if self._ckpt_pending_blocked is None:
            return
        blocked = self._ckpt_pending_blocked + self.ckpt.settle()
        self._ckpt_pending_blocked = None
        self.ckpt_blocked_seconds += blocked
        self.checkpoints_written += 1
        self.metrics.on_checkpoint(blocked_seconds=blocked)

    def _final_metrics(self) -> dict:
        return {**self._metrics_dict(), "epochs": self.pos.epoch, "train_seconds": time.perf_counter() - self.t_start,
                "steady_samples_per_second": self._steady.rate(), **self.timeline}

    def _final_checkpoint(self, summary: dict) -> None:
        """Always end on a committed checkpoint (unless checkpoints are off or nothing new was trained)."""
        trained = self.pos.global_step > self.resumed_from_step or self.ckpt.last_uri is None
        if trained and (self.cfg.checkpoint.every_epochs or self.cfg.checkpoint.every_steps):
            self.checkpoint(summary)
        else:
            self.rt.report(dict(summary, checkpoint=self.ckpt.last_uri))
        summary["checkpoint"] = self.ckpt.last_uri


STEADY_SKIP_STEPS = 5  # warm-up steps left out of the steady-state throughput


class _Steady:
    """Global samples/s from the STEADY_SKIP_STEPS-th step of this attempt on (rank 0's clock)."""

    def __init__(self, first_step: int):
        self.first_step, self.t0, self.samples, self.t1 = first_step, None, 0, None

    def on_step(self, step: int, samples_per_step: int) -> None:
        if step == self.first_step:
            self.t0 = time.perf_counter()
        elif self.t0 is not None:
            self.samples += samples_per_step
            self.t1 = time.perf_counter()

    def rate(self) -> float | None:
        return self.samples / (self.t1 - self.t0) if self.t1 and self.t1 > self.t0 else None


@dataclass
class _Interval:
    t0: float
    step0: int


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
