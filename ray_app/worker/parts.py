"""What the loop trains with, built outside it: the data, the model wrapped for DDP, the task, the samplers
and loaders, the optimizer and the LR schedule (``build_parts``), in the order that keeps every rank equal
(practice 1: seeded identical init, checked; practice 2: the samplers). ``Runtime`` is the seam to the
framework (topology, DDP wrapping, Ray's report): ``ray_app.worker.entry.RayRuntime`` in production, fakes in tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch.utils.data import DataLoader

from ray_app.shared.config import Config
from ray_app.shared.plugins import build_data, build_model, build_task
from ray_app.worker.ddp import ResumableDistributedSampler, assert_identical_parameters, data_samplers, lr_lambda, seed_everything
from ray_app.worker.evaluation import EvalSet
from ray_app.worker.lora import apply_lora, is_lora
from ray_app.worker.mesh import MeshPlan, device_mesh, mesh_plan
from ray_app.worker.pretrained import load_pretrained, pending_weights
from ray_app.worker.speed import Precision, apply_speed_switches
from ray_app.worker.strategy import fully_shard_model

# ---------------------------------------------------------------- the seam (the real object and test fakes)

@runtime_checkable
class Runtime(Protocol):
    """Topology and the framework's calls, read in one place (``ray_app.worker.entry.RayRuntime`` in production)."""

    rank: int
    world_size: int
    device: torch.device
    # optional: ``node_id``, this worker's node (Ray's node id), which HSDP's mesh groups ranks by
    # (``ray_app.worker.mesh``); without it, $RAY_APP_NODE_ID or the host name

    def prepare_model(self, model: torch.nn.Module, bucket_cap_mb: int = 25) -> torch.nn.Module: ...

    def report(self, metrics: dict, local_dir=None, dir_name=None, upload=None) -> None: ...


# ---------------------------------------------------------------- building the parts

@dataclass
class Parts:
    """Everything the loop trains with, built once per worker-group start."""

    task: Any
    model: torch.nn.Module  # DDP-wrapped, or the user's module sharded in place (train.strategy fsdp)
    module: torch.nn.Module  # the user's module inside it (under fsdp: the model itself)
    precision: Precision  # train.precision under this strategy: the autocast of forward, loss and evaluation
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    train_sampler: ResumableDistributedSampler
    train_loader: DataLoader
    loader_gen: torch.Generator
    eval_set: EvalSet  # this rank's share of the eval set (ray_app.worker.evaluation)
    batches_per_epoch: int
    steps_per_epoch: int
    total_steps: int
    param_keys: frozenset  # state-dict keys only an optimizer step changes (a staged checkpoint copies them later)
    mesh: MeshPlan | None = None  # fsdp: which ranks shard together (train.replicate); None under DDP

    @property
    def mesh_words(self) -> str:
        """What the start line says of the mesh: ``, mesh replicate 2 x shard 2 (shard groups by node)`` under
        fsdp, nothing under DDP."""
        return f", {self.mesh.describe()}" if self.mesh else ""


def build_parts(cfg: Config, runtime: Runtime) -> Parts:
    """Data, model, task, samplers, loaders, optimizer and LR schedule, in the order that keeps ranks equal."""
    train_set, eval_set, info = build_data(cfg)
    info = dict(info)
    collate_fn = info.pop("collate_fn", None)  # a data plug-in may hand over its own
    seed_everything(cfg.run.seed)  # practice 1: identical init on every rank
    module = apply_lora(build_model(cfg, info), cfg.model.lora)  # before sharding: the frozen base is sharded too
    pretrained = pending_weights(module) is not None  # made on the meta device: each rank reads what it holds
    module = module if pretrained else module.to(runtime.device)
    precision = Precision(cfg.train.precision, sharded=cfg.train.strategy == "fsdp")
    # torchtitan's order: precision, activation checkpointing, compile (ray_app.worker.speed), then FSDP or DDP
    module = apply_speed_switches(module, cfg.train, precision)
    plan = None
    if cfg.train.strategy == "fsdp":  # practice 1 on the unsharded parameters: FSDP broadcasts nothing
        if not pretrained:
            assert_identical_parameters(module)
        # HSDP (train.replicate): the ranks grouped by the nodes they report (every rank: a collective)
        plan = mesh_plan(cfg.train.replicate, runtime.world_size, getattr(runtime, "node_id", None))
        model = module = fully_shard_model(module, runtime.device, runtime.world_size, units=cfg.train.fsdp_units,
                                           reshard_after_forward=cfg.train.reshard_after_forward,
                                           bf16=precision.gather_bf16, mesh=device_mesh(plan, runtime.device.type))
        load_pretrained(module, runtime.device)  # every rank its own rows: the same file, so equal by making
    else:
        load_pretrained(module, runtime.device)
        model = runtime.prepare_model(module, bucket_cap_mb=cfg.train.bucket_cap_mb)
        module = getattr(model, "module", model)
        assert_identical_parameters(model)
    seed_everything(cfg.run.seed * 1000 + runtime.rank)  # per-rank streams (dropout, augmentation)
    task = build_task(cfg)

    world, rank, bs = runtime.world_size, runtime.rank, cfg.data.batch_size
    train_sampler, eval_sampler, eval_keep, streamed = data_samplers(train_set, eval_set, world, rank, cfg.run.seed)
    # int64 from the sampler's iterator: no Python list of this rank's indices on the way
    eval_indices = torch.from_numpy(np.fromiter(iter(eval_sampler), dtype=np.int64, count=len(eval_sampler)))
    loader_gen = torch.Generator()  # reseeded every epoch: never touches the global RNG
    pin = runtime.device.type == "cuda"
    workers = 0 if streamed else cfg.data.loader_workers  # streamed shards: one prefetch thread per rank

    def loader(dataset, sampler, generator):
        return DataLoader(dataset, batch_size=bs, sampler=sampler, num_workers=workers,
                          pin_memory=pin, generator=generator, collate_fn=collate_fn,
                          persistent_workers=workers > 0)

    batches_per_epoch = math.ceil(train_sampler.num_samples / bs)
    steps_per_epoch = math.ceil(batches_per_epoch / cfg.train.grad_accum)
    # the LR schedule is planned for all epochs; train.max_steps only stops early
    # (like a preemption), so a run stopped that way resumes onto the same schedule
    total_steps = steps_per_epoch * cfg.train.epochs
    optimizer, scheduler = build_optimizer(cfg, model, steps_per_epoch, total_steps)
    n_eval = len(eval_indices)
    return Parts(
        task=task, model=model, module=module, precision=precision, optimizer=optimizer, scheduler=scheduler,
        train_sampler=train_sampler, train_loader=loader(train_set, train_sampler, loader_gen), loader_gen=loader_gen,
        # its own generator too: iterating a DataLoader draws a seed, and evaluation
        # must not move the training RNG (or a resumed run would diverge)
        eval_set=EvalSet(
            loader=loader(eval_set, eval_sampler, torch.Generator().manual_seed(cfg.run.seed)), indices=eval_indices,
            keep=eval_keep,
            batch_sizes=[min(bs, n_eval - i) for i in range(0, n_eval, bs)]),
        batches_per_epoch=batches_per_epoch, steps_per_epoch=steps_per_epoch, total_steps=total_steps,
        param_keys=frozenset(n for n, _ in module.named_parameters(remove_duplicate=False)), mesh=plan,
    )


def build_optimizer(cfg: Config, model: torch.nn.Module, steps_per_epoch: int, total_steps: int):
    t = cfg.train
    params = [p for p in model.parameters() if p.requires_grad or not is_lora(model)]  # model.lora: the adapters
    if t.optimizer == "sgd":
        optimizer = torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    else:
        optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
    warmup = round(t.warmup_epochs * steps_per_epoch)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(warmup, total_steps))
