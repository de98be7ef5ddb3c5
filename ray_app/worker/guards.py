"""What the loop checks of the user's code and of the numbers it trains with.

- ``LossContract``: the task's ``loss(model, batch)`` returns ``(mean_loss, num_samples)`` with a scalar
  loss that requires grad and a positive count (checked on the first call; one line naming
  ``task.name`` otherwise: bad input, exit 2); ``counts_tokens``: what that count is of.
- ``NonFinite``: ``train.nonfinite`` (stop | skip | ignore) and ``train.clip_grad_norm``: after DDP's
  all-reduce every rank holds the same gradients, so every rank gets the same answer at the same step;
  ``stop`` raises ``Diverged`` naming the newest good checkpoint, ``skip`` drops the optimizer step on every
  rank, ``ignore`` steps anyway (and no checkpoint with non-finite parameters is ever committed).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ray_app.shared.errors import Diverged, PluginError
from ray_app.worker.ddp import first_dim
from ray_app.worker.evaluation import describe
from ray_app.worker.strategy import grad_norm, is_sharded


class LossContract:
    def __init__(self, task_name: str):
        self.task_name, self.checked = task_name, False

    def __call__(self, out, batch) -> tuple[torch.Tensor, object]:
        """``(mean_loss, num_samples)`` from what the task's loss returned (a lone tensor: the batch's size)."""
        loss, n = (out, first_dim(batch)) if isinstance(out, torch.Tensor) else (out if isinstance(out, (tuple, list))
                                                                                 and len(out) == 2 else (out, None))
        if not self.checked:
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
                raise PluginError(f"config key task.name: {self.task_name}.loss(model, batch) returned "
                                  f"{describe(out)}; it must return (mean_loss, num_samples) with mean_loss a "
                                  "scalar tensor that requires grad")
            if not isinstance(n, (int, float, torch.Tensor)) or isinstance(n, bool) or \
                    (isinstance(n, torch.Tensor) and n.numel() != 1) or float(n) <= 0:
                raise PluginError(f"config key task.name: {self.task_name}.loss returned num_samples={n!r}; "
                                  "it must be a positive number (the samples the mean is over)")
            self.checked = True
        return loss.reshape(()), n


def counts_tokens(task, name: str) -> bool:
    """Whether the task's loss count is tokens: its ``counts`` attribute, ``"samples"`` (the default) or
    ``"tokens"`` (anything else is bad input naming ``task.name``)."""
    counts = getattr(task, "counts", "samples")
    if counts not in ("samples", "tokens"):
        raise PluginError(f"config key task.name: {name}.counts is {counts!r}; it must be \"samples\" or \"tokens\" "
                          "(what the count its loss returns is of)")
    return counts == "tokens"


class NonFinite:
    def __init__(self, mode: str, clip_grad_norm: float, rank: int, say=print):
        self.mode, self.clip, self.rank, self.say = mode, clip_grad_norm, rank, say
        self.skipped_steps = 0  # optimizer steps dropped for non-finite gradients (train.nonfinite=skip)
        self.last_loss = None  # this rank's loss of the step's last micro-batch (for the divergence line)

    def mask(self, loss: torch.Tensor, scaled: torch.Tensor) -> torch.Tensor:
        """``scaled`` made NaN where ``loss`` is not finite: a non-finite loss on any rank makes every rank's
        gradients NaN through DDP's own all-reduce, so the ranks agree on a divergence at this step without a
        collective of their own (no host sync)."""
        self.last_loss = loss.detach()
        if self.mode == "ignore":
            return scaled
        return scaled * torch.where(torch.isfinite(loss.detach()), 1.0, float("nan"))

    def gradients_finite(self, model: torch.nn.Module) -> bool:
        """Clip to ``train.clip_grad_norm``; whether the global gradient norm is finite."""
        if self.mode == "ignore" and not self.clip:
            return True
        norm = grad_norm(model, self.clip)  # FSDP: the global norm in one all_reduce, the same on every rank
        return self.mode == "ignore" or bool(torch.isfinite(norm))  # one number to the host

    def step_dropped(self, step: int, newest_checkpoint: str | None) -> None:
        """The optimizer step ``step`` had non-finite gradients: skip it (every rank) or raise ``Diverged``."""
        loss = float(self.last_loss) if self.last_loss is not None else float("nan")
        if self.mode == "skip":
            self.skipped_steps += 1
            self.say(f"step {step}: the loss or the gradients are not finite (rank {self.rank}'s loss {loss:g}); "
                     "this optimizer step is skipped on every rank (train.nonfinite=skip)")
            return
        newest = (f"newest good checkpoint: {newest_checkpoint}; lower train.lr or set train.clip_grad_norm and run "
                  "again to resume from it" if newest_checkpoint else
                  "no checkpoint was committed before it; lower train.lr or set train.clip_grad_norm")
        raise Diverged(f"training diverged at step {step}: the loss or the gradients are not finite (rank "
                       f"{self.rank}'s loss {loss:g}); {newest} (or set train.nonfinite=skip)")

    @staticmethod
    def parameters_finite(module: torch.nn.Module) -> bool:
        """Every rank holds the same parameters (DDP), so every rank gets the same answer; under FSDP each rank
        holds its shards, and the ranks agree in one all_reduce (every rank calls this at the same point)."""
        if not is_sharded(module):
            return all(bool(torch.isfinite(p).all()) for p in module.parameters())
        local = all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())  # a scalar: whole
                    for p in module.parameters())
        verdict = torch.tensor([1 if local else 0], dtype=torch.int32, device=next(module.parameters()).device)
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN)  # sync point: all ranks
        return bool(verdict.item())
