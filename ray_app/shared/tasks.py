"""Built-in tasks: what a batch means, the loss, and the eval metrics.

A task is any object with two methods (:class:`Task`); the loop calls them and
does everything distributed itself:

- ``loss(model, batch) -> (mean_loss, num_samples)``: the mean loss of this
  batch and the number of samples it averages over (the kit's logged loss is
  the sample-weighted global mean over all ranks).
- ``evaluate(model, batch) -> {name: per-sample tensor of shape [B]}``: each
  rank sums the values with the sampler's padded duplicates masked out, the
  kit all-reduces the sums and the count (exactly: each mean equals a
  single-process evaluation's) and reports each mean over the distinct eval
  samples as ``eval_<name>``. Nothing of size [samples] leaves a rank.
- optional ``summarize(means) -> {name: value}``: metrics derived from those
  means (perplexity from the mean loss), reported beside them.
- optional ``summarize_rows(values) -> {name: value}``: metrics that need
  every value, not only the mean (a median, an AUC). ``values`` maps each
  name to a tensor of shape [N] over the N distinct eval samples, in the data
  set's order; only for such a task are the values gathered to every rank
  (memory and traffic O(samples x metrics)). Its results are reported beside
  the means (and passed on to ``summarize``).

Batches are what the DataLoader yields, already on the device: a tuple or list
``(input, target)`` or a dict with ``input_key`` / ``target_key`` entries for
the built-in tasks; anything at all for yours.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F


@runtime_checkable
class Task(Protocol):
    def loss(self, model: torch.nn.Module, batch) -> tuple[torch.Tensor, int | torch.Tensor]: ...

    def evaluate(self, model: torch.nn.Module, batch) -> dict[str, torch.Tensor]: ...


class _SupervisedTask:
    """Batches of (input, target): a tuple/list, or a dict with ``input_key`` and ``target_key``."""

    def __init__(self, input_key: str = "input", target_key: str = "target"):
        self.input_key, self.target_key = input_key, target_key

    def split(self, batch):
        if isinstance(batch, dict):
            return batch[self.input_key], batch[self.target_key]
        if isinstance(batch, (tuple, list)) and len(batch) >= 2:
            return batch[0], batch[1]
        raise TypeError(f"{type(self).__name__} expects batches of (input, target) or a dict with "
                        f"{self.input_key!r} and {self.target_key!r}; got {type(batch).__name__}")


class Classification(_SupervisedTask):
    """Cross-entropy on logits [B, C] against class indices [B]; eval: loss and accuracy."""

    def __init__(self, label_smoothing: float = 0.0, input_key: str = "input", target_key: str = "target"):
        super().__init__(input_key, target_key)
        self.label_smoothing = label_smoothing

    def loss(self, model, batch):
        x, y = self.split(batch)
        return F.cross_entropy(model(x), y, label_smoothing=self.label_smoothing), y.shape[0]

    def evaluate(self, model, batch):
        x, y = self.split(batch)
        logits = model(x).float()
        return {"loss": F.cross_entropy(logits, y, reduction="none"),
                "accuracy": (logits.argmax(dim=1) == y).double()}


class Regression(_SupervisedTask):
    """Mean squared error of predictions against targets of the same shape; eval: mse and mae."""

    def __init__(self, input_key: str = "input", target_key: str = "target"):
        super().__init__(input_key, target_key)

    def loss(self, model, batch):
        x, y = self.split(batch)
        return F.mse_loss(model(x), y), y.shape[0]

    def evaluate(self, model, batch):
        x, y = self.split(batch)
        err = (model(x).float() - y.float()).reshape(y.shape[0], -1)
        return {"mse": err.pow(2).mean(dim=1), "mae": err.abs().mean(dim=1)}


class LanguageModel(_SupervisedTask):
    """Next-token cross-entropy: logits [B, T, V] for targets [B, T]; eval: loss (per token) and perplexity."""

    def __init__(self, input_key: str = "input", target_key: str = "target", ignore_index: int = -100):
        super().__init__(input_key, target_key)
        self.ignore_index = ignore_index

    def loss(self, model, batch):
        x, y = self.split(batch)
        logits = model(x)
        return F.cross_entropy(logits.flatten(0, -2), y.flatten(), ignore_index=self.ignore_index), y.shape[0]

    def evaluate(self, model, batch):
        x, y = self.split(batch)
        logits = model(x).float()
        per_token = F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction="none",
                                    ignore_index=self.ignore_index).view(y.shape[0], -1)
        counted = (y != self.ignore_index).view(y.shape[0], -1).sum(dim=1).clamp(min=1)
        return {"loss": per_token.sum(dim=1) / counted}

    def summarize(self, means: dict) -> dict:
        return {"perplexity": math.exp(min(means["loss"], 700.0))}
