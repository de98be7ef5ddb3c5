"""Bare-torchrun twin of ray_app's DDP loop: the same work, no Ray, no kit Trainer.

    torchrun --standalone --nproc-per-node 2 bench/twin.py --config configs/local.yaml --set model.name=resnet18 ...
    python bench/twin.py --device cuda ...            # one process, no process group (bench/gpu.sh)

It reads the same config (file + ``--set``) as ``ray-app train`` and takes the
kit's pure pieces, so the work is identical: model and data
(``ray_app.shared.plugins.build_model`` / ``build_data``), seeding, the train sampler
(``ray_app.worker.ddp.ResumableDistributedSampler``, DistributedSampler's order) and
the optimizer with its warmup + cosine LR schedule
(``ray_app.worker.loop.build_optimizer``), per-worker batch size, log cadence
(global-mean loss with one all_reduce every ``train.log_every_steps``), exact
evaluation after every epoch and at the end (all_gather). The loop, the
collectives and the checkpoints are its own, plain torch:
DistributedDataParallel with its defaults, gloo on CPU; with ``--set train.strategy=fsdp``
plain FSDP2 instead: ``torch.distributed.fsdp.fully_shard`` on each of the units the kit picks
(``ray_app.worker.strategy.shard_units``, a pure function of the model and ``train.fsdp_units``), then on
the root, with ``train.reshard_after_forward`` and, with ``train.precision=bf16-mixed``, bf16 parameters
and fp32 gradient reduction (the root's outputs in fp32); under DDP bf16-mixed is bf16 autocast, and
``train.precision=bf16`` casts the model to bf16 and autocasts, as the kit does. A Hugging Face model
(``model.name=hf``) is loaded by transformers itself (``AutoModelForCausalLM.from_pretrained`` of the same
folder) and trained with ``task.name=causal_lm``'s loss written out here: cross-entropy of each next token (the
labels shifted by one, ``-100`` and padding no target), the mean over the micro-batch's target tokens, logged
weighted by their number; its evaluation is the loss over every target token of the distinct eval samples.
``train.grad_accum`` micro-steps accumulate locally (DDP's ``no_sync``,
FSDP2's ``set_requires_gradient_sync(False)``) and sync on the last. Kit-only keys
(checkpoint.*, metrics.*, failure.*) are ignored; with ``--ckpt-dir`` it saves
``torch.save`` checkpoints and resumes from them (for the recovery case, under
``torchrun --max-restarts``).

Rank 0 prints one JSON line (and appends it to ``--out``) with wall-clock
timestamps of each start-up phase, ``first_step_unix`` and the steady-state
rate counted from the end of step ``--skip-steps`` (see :class:`Steady`).

The speed switches, as the kit applies them and in its order (:func:`speed_switches`): ``train.precision``
(above), then ``train.activation_checkpointing`` and ``train.compile`` written as plain torch on the blocks the
kit picks (``ray_app.worker.strategy.blocks``), then DDP or FSDP.
"""

from __future__ import annotations

import time

T_SCRIPT = time.time()  # before the heavy imports: python start-up is torchrun's share

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ray_app.shared.config import load_config  # noqa: E402  (the kit's pure pieces: no Ray, no Trainer)
from ray_app.shared.plugins import build_data, build_model  # noqa: E402
from ray_app.worker.ddp import ResumableDistributedSampler, seed_everything  # noqa: E402
from ray_app.worker.parts import build_optimizer  # noqa: E402
from ray_app.worker.strategy import shard_units  # noqa: E402  (pure: which sub-modules are FSDP units)

T_IMPORTS = time.time()
IGNORE = -100  # a label that is no target (causal_lm: a prompt's tokens, padding)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="YAML config, as for ray-app train")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--skip-steps", type=int, default=5, help="optimizer steps left out of the steady-state rate")
    p.add_argument("--out", default=None, help="append rank 0's JSON line to this file")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (one process per GPU)")
    p.add_argument("--data-parallel", action="store_true",
                   help="one process, nn.DataParallel over every visible GPU (the source article's baseline)")
    p.add_argument("--ckpt-dir", default=None, help="save/resume torch.save checkpoints here")
    p.add_argument("--ckpt-every-steps", type=int, default=0, help="checkpoint cadence with --ckpt-dir")
    return p.parse_args(argv)


class Steady:
    """Steady-state global samples/s, counted from the end of step ``skip`` of this attempt.

    ``steady_samples_per_second``: wall time from the end of that step to the end of the last one
    (evaluation between epochs included, as the kit's ``_Steady`` counts it);
    ``steady_step_samples_per_second``: the summed wall time of those steps only.
    """

    def __init__(self, skip: int):
        self.skip, self.t0, self.t1, self.samples, self.step_seconds = skip, None, None, 0, 0.0

    def on_step(self, step: int, now: float, step_seconds: float, samples: int) -> None:
        if step == self.skip:
            self.t0 = now
        elif self.t0 is not None:
            self.samples += samples
            self.t1 = now
            self.step_seconds += step_seconds

    def figures(self) -> dict:
        wall = (self.t1 - self.t0) if self.t1 else 0.0
        return {"steady_samples_per_second": self.samples / wall if wall > 0 else None,
                "steady_step_samples_per_second": self.samples / self.step_seconds if self.step_seconds else None,
                "steady_samples": self.samples}


class Twin:
    def __init__(self, args, cfg):
        self.args, self.cfg = args, cfg
        self.distributed = "RANK" in os.environ
        self.stamps = {"script": T_SCRIPT, "imports": T_IMPORTS}
        if self.distributed:
            dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        else:
            self.rank, self.world = 0, 1
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = torch.device(f"cuda:{local_rank}" if args.device == "cuda" else "cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        precision, sharded = cfg.train.precision, cfg.train.strategy == "fsdp"
        self.amp = precision == "bf16" or (precision == "bf16-mixed" and not sharded)  # bf16 autocast
        self.gather_bf16 = precision == "bf16-mixed" and sharded  # FSDP's MixedPrecisionPolicy
        self.stamps["process_group"] = time.time()
        self.epoch = self.batches_done = self.step = self.resumed_from = 0
        self.steady = Steady(args.skip_steps)
        self.first_step_unix = None

    # ---------------------------------------------------------------- set-up
    def build(self) -> None:
        cfg = self.cfg
        train_set, eval_set, info = build_data(cfg)
        self.stamps["data"] = time.time()
        seed_everything(cfg.run.seed)  # identical init on every rank (DDP also broadcasts rank 0's)
        self.lm = cfg.task.name == "causal_lm"
        model = (from_pretrained(cfg) if cfg.model.name == "hf" else build_model(cfg, info)).to(self.device)
        if cfg.train.precision == "bf16":
            model = model.to(torch.bfloat16)
        self.fsdp = cfg.train.strategy == "fsdp"
        model = speed_switches(model, cfg.train)  # activation checkpointing, then compile, then FSDP or DDP
        if self.fsdp:
            model = self.fully_shard(model)
        elif self.distributed:
            model = DistributedDataParallel(model, bucket_cap_mb=cfg.train.bucket_cap_mb)
        elif self.args.data_parallel and self.device.type == "cuda":
            model = torch.nn.DataParallel(model)  # one process scatters each batch over the GPUs
        self.model = model
        self.stamps["model"] = time.time()
        seed_everything(cfg.run.seed * 1000 + self.rank)
        self.sampler = ResumableDistributedSampler(train_set, self.world, self.rank, shuffle=True, seed=cfg.run.seed)
        eval_sampler = DistributedSampler(eval_set, self.world, self.rank, shuffle=False)
        self.eval_indices = torch.tensor(list(iter(eval_sampler)))
        self.loader_gen = torch.Generator()
        bs = cfg.data.batch_size
        self.loader = DataLoader(train_set, batch_size=bs, sampler=self.sampler, generator=self.loader_gen,
                                 num_workers=cfg.data.loader_workers, pin_memory=self.device.type == "cuda",
                                 persistent_workers=cfg.data.loader_workers > 0)
        # evaluation draws its loader seed from its own generator, not the global RNG (as the kit does)
        self.eval_loader = DataLoader(eval_set, batch_size=bs, sampler=eval_sampler,
                                      num_workers=cfg.data.loader_workers,
                                      generator=torch.Generator().manual_seed(cfg.run.seed))
        self.batches_per_epoch = math.ceil(self.sampler.num_samples / bs)
        self.steps_per_epoch = math.ceil(self.batches_per_epoch / cfg.train.grad_accum)
        self.total_steps = self.steps_per_epoch * cfg.train.epochs
        self.opt, self.sched = build_optimizer(cfg, model, self.steps_per_epoch, self.total_steps)
        self.resume()

    def fully_shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """Plain FSDP2 over every rank: each unit, then the root (identical init on every rank: nothing is
        broadcast)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not self.distributed:
            raise SystemExit("twin.py: train.strategy=fsdp needs a process group (run it under torchrun)")
        cfg = self.cfg
        kwargs = {"mesh": init_device_mesh(self.device.type, (self.world,)),
                  "reshard_after_forward": cfg.train.reshard_after_forward}
        root = kwargs
        if self.gather_bf16:
            kwargs = dict(kwargs, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
            root = dict(kwargs, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                               output_dtype=torch.float32))
        for unit in shard_units(model, cfg.train.fsdp_units):
            fully_shard(unit, **kwargs)
        fully_shard(model, **root)
        return model

    def no_sync(self):
        """Non-final micro-steps: gradients accumulate locally (no all-reduce, no reduce-scatter)."""
        if self.fsdp:
            return _FsdpNoSync(self.model)
        return self.model.no_sync() if hasattr(self.model, "no_sync") else contextlib.nullcontext()

    def _ckpt_path(self) -> Path | None:
        return Path(self.args.ckpt_dir) / "twin.pt" if self.args.ckpt_dir else None

    def resume(self) -> None:
        path = self._ckpt_path()
        if path is None or not path.exists():
            return
        state = torch.load(path, map_location="cpu", weights_only=True)
        getattr(self.model, "module", self.model).load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.epoch, self.batches_done, self.step = state["epoch"], state["batches_done"], state["step"]
        self.resumed_from = self.step

    def save(self) -> None:
        if self.fsdp:
            raise SystemExit("twin.py: --ckpt-dir is for DDP (the bench saves no FSDP twin checkpoints)")
        if self.rank == 0:
            path = self._ckpt_path()
            path.parent.mkdir(parents=True, exist_ok=True)
            state = {"model": getattr(self.model, "module", self.model).state_dict(),
                     "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
                     "epoch": self.epoch, "batches_done": self.batches_done, "step": self.step}
            torch.save(state, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
        if self.distributed:
            dist.barrier()  # sync point: nobody runs ahead of a checkpoint that may be needed

    # ---------------------------------------------------------------- the loss
    def token_losses(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """causal_lm: each target token's loss [B, T-1] (0 where none) and whether it is a target."""
        ids, labels, mask = (batch[k].to(self.device, non_blocking=True) for k in ("input_ids", "labels", "attention_mask"))
        logits = self.model(ids, attention_mask=mask).logits
        targets = labels.masked_fill(mask == 0, IGNORE)[:, 1:]  # position t predicts token t + 1
        per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), reduction="none",
                                    ignore_index=IGNORE).view(targets.shape)
        return per_token, targets != IGNORE

    def batch_loss(self, batch) -> tuple[torch.Tensor, torch.Tensor | int]:
        """The micro-batch's mean loss and what it averages over: samples, or (causal_lm) target tokens."""
        if self.lm:
            per_token, counted = self.token_losses(batch)
            n = counted.sum()
            return per_token.sum() / n.clamp(min=1), n
        x, y = batch[0].to(self.device, non_blocking=True), batch[1].to(self.device, non_blocking=True)
        return F.cross_entropy(self.model(x), y), y.shape[0]

    # ---------------------------------------------------------------- collectives
    def global_mean(self, loss_sum: torch.Tensor, count: torch.Tensor) -> float:
        t = torch.stack([loss_sum.double(), count.double()])
        if self.distributed:
            dist.all_reduce(t)  # sync point: all ranks
        return (t[0] / t[1].clamp(min=1)).item()

    @torch.no_grad()
    def evaluate(self) -> dict:
        if self.lm:
            return self.evaluate_lm()
        self.model.eval()
        rows = []
        for x, y in self.eval_loader:
            x, y = x.to(self.device), y.to(self.device)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
                logits = self.model(x)
            loss = F.cross_entropy(logits.float(), y, reduction="none")
            rows.append(torch.stack([logits.argmax(1).double(), y.double(), loss.double()], 1))
        keep = self.distinct_rows(rows)
        self.model.train()
        return {"eval_accuracy": (keep[:, 1] == keep[:, 2]).double().mean().item(),
                "eval_loss": keep[:, 3].mean().item(), "num_samples": int(keep.shape[0])}

    def distinct_rows(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """This rank's eval rows, each led by its sample's index, gathered from every rank (a sync point), one
        row per distinct sample (the sampler's padding dropped)."""
        local = torch.cat([self.eval_indices.to(self.device).double().unsqueeze(1), torch.cat(rows)], 1)
        gathered = [torch.empty_like(local) for _ in range(self.world)]
        if self.distributed:
            dist.all_gather(gathered, local)
        else:
            gathered = [local]
        allrows = torch.cat(gathered).cpu()
        _, first = np.unique(allrows[:, 0].numpy(), return_index=True)
        return allrows[torch.from_numpy(np.sort(first))]

    @torch.no_grad()
    def evaluate_lm(self) -> dict:
        """causal_lm: the loss over every target token of the distinct eval samples (and its exp)."""
        self.model.eval()
        rows = []
        for batch in self.eval_loader:
            per_token, counted = self.token_losses(batch)
            rows.append(torch.stack([per_token.double().sum(1), counted.double().sum(1)], 1))
        keep = self.distinct_rows(rows)
        self.model.train()
        loss = (keep[:, 1].sum() / keep[:, 2].sum()).item()
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0)), "num_samples": int(keep.shape[0])}

    # ---------------------------------------------------------------- training
    def done(self) -> bool:
        return bool(self.cfg.train.max_steps) and self.step >= self.cfg.train.max_steps

    def train_epoch(self) -> None:
        cfg = self.cfg
        self.sampler.set_epoch(self.epoch)  # a new order every epoch
        self.sampler.set_start(self.batches_done * cfg.data.batch_size * self.world)  # samples of all ranks
        self.loader_gen.manual_seed(cfg.run.seed * 1_000_003 + self.epoch)
        loss_sum = torch.zeros((), device=self.device)
        count = torch.zeros((), device=self.device)
        self.epoch_loss = torch.zeros((), device=self.device)
        self.epoch_count = torch.zeros((), device=self.device)
        step_t0 = time.perf_counter()
        accum = cfg.train.grad_accum
        for batch in self.loader:
            b = self.batches_done
            group_size = min(accum, self.batches_per_epoch - (b - b % accum))
            last_micro = b % accum + 1 == group_size
            with contextlib.nullcontext() if last_micro else self.no_sync():
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
                    loss, n = self.batch_loss(batch)
                # DDP all-reduces gradient buckets during backward, FSDP reduce-scatters each unit's
                (loss / group_size).backward()
            self.batches_done += 1
            loss_sum += loss.detach() * n
            count += n
            if not last_micro:
                continue
            if cfg.train.clip_grad_norm:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.train.clip_grad_norm)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.sched.step()
            self.step += 1
            now = time.perf_counter()
            if self.first_step_unix is None:
                self.first_step_unix = time.time()
            self.steady.on_step(self.step - self.resumed_from, now, now - step_t0,
                                cfg.data.batch_size * accum * self.world)
            step_t0 = now
            if self.step % cfg.train.log_every_steps == 0:
                self.log(loss_sum, count)
                self.epoch_loss += loss_sum
                self.epoch_count += count
                loss_sum, count = torch.zeros_like(loss_sum), torch.zeros_like(count)
            if self.args.ckpt_every_steps and self.step % self.args.ckpt_every_steps == 0:
                self.save()
            if self.done():
                break
        if self.batches_done >= self.batches_per_epoch:
            if count.item():
                self.log(loss_sum, count)
            self.train_loss = self.global_mean(self.epoch_loss + loss_sum, self.epoch_count + count)
            self.last_eval = self.evaluate()
            self.epoch += 1
            self.batches_done = 0

    def log(self, loss_sum, count) -> None:
        loss = self.global_mean(loss_sum, count)  # sync point: every rank at the same step
        if self.rank == 0:
            print(f"epoch {self.epoch} step {self.step}/{self.total_steps} loss {loss:.4f}", flush=True)

    def fit(self) -> dict:
        self.build()
        self.train_loss, self.last_eval = float("nan"), {}
        t_start = time.perf_counter()
        while self.epoch < self.cfg.train.epochs and not self.done():
            self.train_epoch()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.last_eval = self.evaluate()
        self.stamps["first_step"] = self.first_step_unix
        return {"kind": "twin", "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                "world_size": self.world, "global_step": self.step, "resumed_from_step": self.resumed_from,
                "train_loss": self.train_loss, **self.last_eval,
                "train_seconds": time.perf_counter() - t_start, "first_step_unix": self.first_step_unix,
                **self.steady.figures(),
                "cuda_peak_bytes": torch.cuda.max_memory_allocated() if self.device.type == "cuda" else None,
                "stamps": self.stamps}


def from_pretrained(cfg):
    """``model.name=hf``'s folder as transformers loads it (a local folder: the bench's)."""
    from transformers import AutoModelForCausalLM

    args = cfg.model.args
    return AutoModelForCausalLM.from_pretrained(args["path"], dtype=getattr(torch, args.get("dtype", "float32")),
                                                trust_remote_code=args.get("trust_remote_code", False))


class _FsdpNoSync:
    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.model.set_requires_gradient_sync(False)

    def __exit__(self, *exc):
        self.model.set_requires_gradient_sync(True)


def speed_switches(model: torch.nn.Module, train) -> torch.nn.Module:
    """``train.activation_checkpointing`` and ``train.compile`` as plain torch, on the blocks the kit picks
    (``ray_app.worker.strategy.blocks``: a pure function of the model and ``train.fsdp_units``), in torchtitan's
    order: each block's forward checkpointed (``torch.utils.checkpoint``, non-reentrant; ``selective``: every
    ``train.ac_every``-th block), then each block compiled whole (``nn.Module.compile(fullgraph=True)``: the
    recomputation inside the compiled graph; a model without blocks whole), before DDP or FSDP wraps the model.
    Under no_grad (evaluation) a checkpointed forward keeps nothing and runs once, as an eager one."""
    from ray_app.shared.errors import ConfigError
    from ray_app.worker.strategy import blocks

    if train.activation_checkpointing != "none":
        found = blocks(model, train.fsdp_units, f"train.activation_checkpointing={train.activation_checkpointing}")
        every = train.ac_every if train.activation_checkpointing == "selective" else 1
        for block in found[every - 1::every]:
            block.forward = _checkpointed(block.forward)
    if train.compile and train.activation_checkpointing != "none":  # as dynamo's hint says for HF decoder layers
        import torch._dynamo

        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    if train.compile:
        if train.compile_cache_dir:  # inductor's and Triton's caches, as the kit points them
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = train.compile_cache_dir
            os.environ["TRITON_CACHE_DIR"] = os.path.join(train.compile_cache_dir, "triton")
        try:
            units = blocks(model, train.fsdp_units, "train.compile=true")
        except ConfigError:  # no blocks and none named: the whole model as one graph, as the kit does
            if train.fsdp_units.strip():
                raise
            units = [model]
        for unit in units:
            unit.compile(fullgraph=True)
    return model


def _checkpointed(forward):
    """``forward`` under ``torch.utils.checkpoint`` (a function of this file, where dynamo starts tracing: it
    takes the checkpoint whole into the compiled graph)."""
    from torch.utils.checkpoint import checkpoint

    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    twin = Twin(args, cfg)
    result = twin.fit()
    if twin.rank == 0:
        line = json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                           for k, v in result.items()})
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    if twin.distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # torch 2.x on CPU: after a gloo group, a C++ static destructor sometimes aborts the interpreter's
    # teardown (SIGABRT, no Python frame; 1 run in 8 here), so torchrun reports a failure for a run that
    # finished and printed its figures. Nothing is left to tear down: leave without it.
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)
