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
6. rank 0 alone logs progress, commits checkpoints and serves metrics (every rank writes its
   share of a checkpoint, and prints one line at the start: its host and device).

The model is DDP-wrapped or, with ``train.strategy: fsdp``, sharded with FSDP2 (``ray_app.worker.strategy``): the
practices hold under both (practice 1 on the unsharded parameters, practice 3's skip with FSDP's own switch).

What a batch means, the loss and the metrics come from the task (``ray_app.shared.tasks``);
the data, model and task are built by :func:`build_parts` from the config's plug-ins.
The pieces live in rooms of their own: the collectives and the sampler in ``ray_app.worker.ddp``,
exact evaluation in ``ray_app.worker.evaluation``, the loss sums, progress lines and run statistics
in ``ray_app.worker.progress``, restore and re-sharding in ``ray_app.worker.resume``, what a checkpoint holds
and when one is due in ``ray_app.worker.checkpoint``. Infrastructure arrives as small objects: a
:class:`Runtime` (topology, DDP wrapping, Ray's report), a checkpointer and a metrics sink
(``ray_app.worker.progress.MetricsSink``). No Ray, S3 or Prometheus here.
"""

from __future__ import annotations

import contextlib
import math
import socket
import time

import torch.distributed as dist

from ray_app import __version__
from ray_app.shared.catalog import Position, TrainState
from ray_app.shared.config import Config
from ray_app.shared.errors import Preempted, Stopped
from ray_app.worker.checkpoint import CheckpointFiles, capture_rng_state
from ray_app.worker.collectives import entered
from ray_app.worker.ddp import first_dim, to_device
from ray_app.worker.evaluation import Evaluator
from ray_app.worker.guards import LossContract, NonFinite, counts_tokens
from ray_app.worker.pace import Pace
from ray_app.worker.parts import Parts, Runtime
from ray_app.worker.preemption import STOP, TRAINING, Agreement
from ray_app.worker.progress import MetricsSink, Progress, RunStats
from ray_app.worker.resume import restore
from ray_app.worker.strategy import no_sync

# ---------------------------------------------------------------- the loop

class Trainer:
    """One worker's view of a DDP run: fit, epoch, step; evaluation, progress and restore are its parts'."""

    def __init__(self, cfg: Config, runtime: Runtime, parts: Parts, checkpointer, metrics: MetricsSink,
                 stats: RunStats | None = None, preemption: Agreement | None = None):
        self.cfg, self.rt, self.parts, self.ckpt, self.metrics = cfg, runtime, parts, checkpointer, metrics
        if checkpointer is not None:  # its cadence is its own; it learns what the run will train
            checkpointer.plan(batches_per_epoch=parts.batches_per_epoch, epochs=cfg.train.epochs,
                              max_steps=cfg.train.max_steps)
        self.preemption = preemption or Agreement(enabled=False)  # asked at every step boundary
        self.leaving = 0  # the kind of notice every rank agreed on (PREEMPT, STOP): checkpoint at the next resumable boundary, leave
        self._checkpointed_at = -1  # global step of this attempt's newest checkpoint
        self.rank, self.world_size, self.device = runtime.rank, runtime.world_size, runtime.device
        self.is_rank0 = self.rank == 0  # the one predicate that decides who logs, writes and serves
        self.task, self.model, self.module = parts.task, parts.model, parts.module
        self.optimizer, self.scheduler = parts.optimizer, parts.scheduler
        self.autocast = parts.precision.autocast  # bf16 autocast: no loss scaling (no GradScaler)
        self.stats = stats or RunStats()
        self.progress = Progress(metrics, self.device, parts.total_steps, say=self.print0, stats=self.stats,  # tokens/s, MFU
                                 tokens=counts_tokens(self.task, cfg.task.name), peak_tflops=cfg.train.peak_tflops)
        self.pace = Pace(self.rank, self.world_size, parts.module, metrics, self.device, say=self.print0, enabled=cfg.metrics.rank_pace,
                         samples_per_step=cfg.data.batch_size * cfg.train.grad_accum, replicas=parts.mesh.replica_of() if parts.mesh else None)
        self.evaluator = Evaluator(self.task, cfg.task.name, parts.eval_set, self.world_size, self.device,
                                   autocast=parts.precision.autocasts, on_eval=metrics.on_eval)
        self.pos = Position()
        self.resumed_from_step, self.resumed_checkpoint_unix = 0, 0.0
        self.resumed_tracking: dict = {}  # the trackers' state in the checkpoint resumed from (ray_app.worker.tracking)
        self.last_eval, self.last_train_loss = {}, float("nan")  # the newest evaluation's metrics, the epoch's loss
        self._evaluated_at = -1  # global step of the newest evaluation (the final one is skipped when it is this step)
        self.loss_contract = LossContract(cfg.task.name)  # the task's loss output, checked once (ray_app.worker.guards)
        self.nonfinite = NonFinite(cfg.train.nonfinite, cfg.train.clip_grad_norm, self.rank, say=self.print0)

    def print0(self, msg: str) -> None:
        if self.is_rank0:
            print(msg, flush=True)

    def fit(self) -> dict:
        resumed = restore(self.cfg, self.parts, self.ckpt, self.rank, self.world_size, say=self.print0)
        if resumed is not None:
            self.pos, self.resumed_from_step = resumed.pos, resumed.from_step
            self.resumed_checkpoint_unix, self.last_eval = resumed.checkpoint_unix, resumed.last_eval
            self.resumed_tracking, self.progress.before = resumed.tracking, resumed.epoch_loss
            self.progress.total_steps = self._planned_last_step()
        self._announce()
        self.stats.start_training(self.pos.global_step)
        if self.preemption.enabled:
            TRAINING.set()  # a SIGTERM from now on is a notice to checkpoint (ray_app.worker.preemption)
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
        self.ckpt.wait_committed()  # a staged share still uploading: the worker stays until it is done
        summary.update(checkpoint_blocked_seconds=round(self.ckpt.blocked_seconds, 4), checkpoints_written=self.ckpt.written)
        self.metrics.close()
        return summary

    def _planned_last_step(self) -> int:
        """The global step the run ends at: the steps taken plus the rest at this world size (a run resumed at
        another world size takes the rest of its epochs in steps of another size)."""
        p, pos = self.parts, self.pos
        left_in_epoch = math.ceil((p.batches_per_epoch - pos.batches_done) / self.cfg.train.grad_accum)
        return pos.global_step + left_in_epoch + p.steps_per_epoch * max(0, self.cfg.train.epochs - pos.epoch - 1)

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
                    f"{self.parts.steps_per_epoch} steps/epoch x {c.train.epochs} epochs, world size {self.world_size}{self.parts.mesh_words}")
        self.metrics.start(run=c.run.name, model=c.model.name, dataset=c.data.name, task=c.task.name,
                           version=__version__, world_size=self.world_size, resumed_from_step=self.resumed_from_step,
                           global_step=self.pos.global_step, epoch=self.pos.epoch, use_gpu=self.device.type == "cuda",
                           last_checkpoint_unix=self.resumed_checkpoint_unix, tracking=self.resumed_tracking)

    def train_epoch(self, epoch: int) -> None:
        cfg, parts, accum = self.cfg, self.parts, self.cfg.train.grad_accum
        self.model.train()
        parts.train_sampler.set_epoch(epoch)  # practice 2: a new order every epoch
        if self.pos.samples_done == 0:  # an epoch starts: its order is cut at this world size (streamed shards)
            self.pos.epoch_world_size = self.world_size
        parts.train_sampler.set_start(self.pos.samples_done, self.pos.epoch_world_size)
        parts.loader_gen.manual_seed(cfg.run.seed * 1_000_003 + epoch)
        self.progress.new_epoch(self.pos.global_step, self.pos.batches_done)  # a resumed epoch keeps its sums before
        step_t0 = time.perf_counter()
        for batch in self.pace.timed(parts.train_loader):  # next() timed: this rank's data wait
            b = self.pos.batches_done
            group_start = b - b % accum
            group_size = min(accum, parts.batches_per_epoch - group_start)
            last_micro = (b - group_start + 1) == group_size
            with self.progress.flops.counting(self.pos.global_step + 1, b - group_start, group_size):  # once per attempt
                loss, n = self._forward_backward(to_device(batch, self.device), group_size, sync=last_micro)
            self.pace.backward_done()
            self.progress.add(loss, n, first_dim(batch))
            self.pos.batches_done += 1
            self.pos.samples_done += cfg.data.batch_size * self.world_size  # full batches until the epoch's last
            if not last_micro:
                continue
            self._optimizer_step()
            self.pace.stepped()
            now = time.perf_counter()
            self.metrics.on_step(now - step_t0)
            step_t0 = now
            if self.pos.global_step % cfg.train.log_every_steps == 0:
                self.progress.log(epoch=self.pos.epoch, global_step=self.pos.global_step, lr=self._lr())
                self.pace.exchange(self.pos.global_step)  # sync point: every rank's pace, one all_gather
            self.leaving = max(self.leaving, self.preemption.poll())  # 0, PREEMPT or STOP
            if self.ckpt.due(self.pos):  # the checkpointer's cadence (every_steps; never the last step)
                self.checkpoint()
            if self._done():
                break
            if self.leaving and self.pos.batches_done < parts.batches_per_epoch:
                self._leave()  # an epoch's last batch leaves after _end_epoch instead: that is where it resumes
        if self.pos.batches_done >= parts.batches_per_epoch:
            self._end_epoch()
            if self.leaving and self.pos.epoch < cfg.train.epochs and not self._done():
                self._leave()
        elif self._done():  # train.max_steps ends training inside the epoch: the loss of the steps trained
            self.last_train_loss = self._epoch_train_loss()

    def _leave(self) -> None:
        """Every rank: checkpoint here (unless this step has one), wait until it is committed, raise."""
        if self._checkpointed_at != self.pos.global_step:
            self.checkpoint()
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

    def _forward_backward(self, batch, group_size: int, sync: bool):
        # practice 3: DDP all-reduces gradients during backward; on non-final micro-steps no_sync() skips that
        # all-reduce (gradients accumulate locally; FSDP skips its reduce-scatter the same way: ray_app.worker.strategy)
        with contextlib.nullcontext() if sync else no_sync(self.model):
            with self.autocast(self.device):  # train.precision (ray_app.worker.speed)
                loss, n = self.loss_contract(self.task.loss(self.model, batch), batch)
            # a non-finite loss on any rank: NaN gradients on every rank (ray_app.worker.guards)
            with entered("gradient all-reduce (backward)", self.pos.global_step + 1) if sync else contextlib.nullcontext():
                self.nonfinite.mask(loss, loss / group_size).backward()
        return loss, n

    def _optimizer_step(self) -> None:
        if self.nonfinite.gradients_finite(self.model):  # the same answer on every rank (DDP's all-reduce)
            self.optimizer.step()
        else:  # stop: raises; skip: this step is dropped on every rank
            self.nonfinite.step_dropped(self.pos.global_step + 1, self.ckpt.last_uri)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()  # a skipped step keeps its place in the LR schedule and the data order
        self.pos.global_step += 1
        self.stats.on_step(self.pos.global_step, self.cfg.data.batch_size * self.cfg.train.grad_accum * self.world_size)

    def _lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]  # the LR in use (= the scheduler's, set by its step)

    def _epoch_train_loss(self) -> float:
        # collective: every rank has the same number of batches (the sampler pads), so every rank is here
        return self.progress.epoch_train_loss(epoch=self.pos.epoch, global_step=self.pos.global_step, lr=self._lr())

    def _end_epoch(self) -> None:
        self.last_train_loss = self._epoch_train_loss()
        self.last_eval = self.evaluate()
        self._evaluated_at = self.pos.global_step
        shown = " ".join(f"{k} {v:.4f}" for k, v in self.last_eval.items() if k.startswith("eval_"))
        self.print0(f"epoch {self.pos.epoch} done: train loss {self.last_train_loss:.4f} {shown}")
        self.pos.epoch += 1
        self.pos.batches_done = self.pos.samples_done = 0
        if self.ckpt.due(self.pos, epoch_end=True):
            self.checkpoint()
        elif self.pos.epoch < self.cfg.train.epochs and not self._done():
            self.rt.report(self._metrics_dict())  # one report per epoch on every rank (Ray's barrier)
        # the run's last epoch reports with the run's end (_final_checkpoint): a report right behind another
        # waits until Ray Train's controller has taken the first (ray_app.driver.launcher.BusyPolling)

    def evaluate(self) -> dict:
        """Practice 5 (``ray_app.worker.evaluation``): every metric of the task, exact over the distinct eval samples."""
        return self.evaluator.evaluate(self.model)

    # ------------------------------------------------------------ checkpoints
    def _metrics_dict(self) -> dict:
        return {"epoch": self.pos.epoch, "global_step": self.pos.global_step, "train_loss": self.last_train_loss,
                "resumed_from_step": self.resumed_from_step, **self.last_eval}

    def checkpoint(self, metrics: dict | None = None) -> None:
        """Every rank calls this at the same point (RNG gather + Ray's report are collectives). Parameters
        that are not finite are never committed (``train.nonfinite=ignore`` lets them come about): the
        step reports its metrics without a checkpoint, so retention keeps the newest good one."""
        if not self.nonfinite.parameters_finite(self.module):
            self.print0(f"step {self.pos.global_step}: parameters are not finite; no checkpoint is committed "
                        f"(newest good: {self.ckpt.last_uri})")
            self.rt.report(dict(self._metrics_dict(), **(metrics or {})))  # Ray's barrier: every rank reports
            return
        names = [self.ckpt.new_name(self.pos.global_step)]
        with entered("checkpoint (broadcast_object_list)"):  # sync point: rank 0's name, which every rank writes under
            dist.broadcast_object_list(names, src=0)
        metrics = dict(self._metrics_dict(), **(metrics or {}))
        loss_sums = self.progress.epoch_sums(self.pos.batches_done)  # sync point (mid-epoch): the epoch's global loss sums
        files = None
        if self.is_rank0:  # the small files; every rank writes its share of the model, the optimizer and its RNG
            files = CheckpointFiles(self.scheduler.state_dict(),
                                    TrainState(self.pos, self.world_size, self.last_eval, self.metrics.checkpoint_state(),
                                               loss_sums),
                                    self.cfg.to_dict(), metrics)
        self._account(self.ckpt.save_shards(self.model, self.optimizer, files, capture_rng_state(), metrics,
                                            rank=self.rank, world_size=self.world_size, name=names[0]))
        self._checkpointed_at = self.pos.global_step

    def _account(self, blocked: float | None) -> None:
        if blocked is not None:
            self.metrics.on_checkpoint(blocked_seconds=blocked)

    def _final_metrics(self) -> dict:
        return {**self._metrics_dict(), "epochs": self.pos.epoch, "world_size": self.world_size,
                "skipped_steps": self.nonfinite.skipped_steps, "train_seconds": self.stats.train_seconds(),
                "steady_samples_per_second": self.stats.steady_rate(), **self.progress.throughput(), **self.stats.timeline}

    def _final_checkpoint(self, summary: dict) -> None:
        """Always end on a committed checkpoint (unless checkpoints are off or nothing new was trained)."""
        if self.ckpt.final_due(self.pos.global_step, self.resumed_from_step):
            self.checkpoint(summary)
        else:
            self.rt.report(dict(summary, checkpoint=self.ckpt.last_uri))
        summary["checkpoint"] = self.ckpt.last_uri
