"""Built-in tasks: what a batch means, the loss, and the eval metrics.

A task is any object with two methods (:class:`Task`); the loop calls them and
does everything distributed itself:

- ``loss(model, batch) -> (mean_loss, num_samples)``: the mean loss of this
  batch and the number of samples it averages over (the kit's logged loss is
  the sample-weighted global mean over all ranks).
- optional class attribute ``counts = "tokens"``: that number is of tokens, not
  samples (``causal_lm``'s target tokens). The kit then counts samples from the
  batches (their first dimension) and shows tokens/s beside samples/s: in the
  progress lines, the summary (``train_tokens``, ``steady_tokens_per_second``)
  and ``ray_app_tokens_per_second``. Default ``"samples"``.
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


class CausalLM:
    """Next-token cross-entropy for causal language models, as transformers counts it.

    Batches are dicts with ``input_ids`` [B, T] and optionally ``labels`` [B, T] (aligned with ``input_ids``;
    the task shifts by one, so ``labels[:, t]`` is predicted from the tokens up to ``t - 1``; without ``labels``
    the ``input_ids`` are the labels) and ``attention_mask`` [B, T] (1: a real token; 0: padding, which is
    neither attended to where the model takes a mask, nor a target). Labels equal to ``ignore_index``
    (``-100``: a prompt's tokens, padding) are no target either. A tuple ``(input_ids, labels)`` or a lone
    tensor of ``input_ids`` works too.

    The model returns logits [B, T, V], or an object with ``.logits`` (transformers' output), or a tuple whose
    first item is the logits. ``loss`` returns ``(mean over this micro-batch's target tokens, their number)``:
    the kit's logged loss, weighted by that count over every rank and micro-batch, is the token-weighted global
    mean. Eval: each sample's summed target-token loss and its number of target tokens; ``eval_loss`` is the
    sum of every target token's loss over the distinct eval samples divided by the number of those tokens, and
    ``eval_perplexity`` its exp, exactly (both sums are the kit's exact eval sums).
    """

    counts = "tokens"  # the loss count is target tokens: the kit shows tokens/s, and samples/s from the batches

    def __init__(self, ignore_index: int = -100, input_key: str = "input_ids", labels_key: str = "labels",
                 mask_key: str = "attention_mask"):
        self.ignore_index = ignore_index
        self.input_key, self.labels_key, self.mask_key = input_key, labels_key, mask_key
        self._takes_mask: dict[int, bool] = {}

    def split(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(input_ids, labels, attention_mask)`` of a batch; labels with padding set to ``ignore_index``."""
        mask = None
        if isinstance(batch, dict):
            if self.input_key not in batch:
                raise TypeError(f"causal_lm expects batches with {self.input_key!r} (and optionally "
                                f"{self.labels_key!r}, {self.mask_key!r}); got the keys {sorted(batch)}")
            ids = batch[self.input_key]
            labels, mask = batch.get(self.labels_key), batch.get(self.mask_key)
        elif isinstance(batch, (tuple, list)):
            ids, labels = batch[0], batch[1] if len(batch) > 1 else None
        else:
            ids, labels = batch, None
        labels = ids if labels is None else labels
        if mask is not None:
            labels = labels.masked_fill(mask == 0, self.ignore_index)
        return ids, labels, mask

    def logits(self, model, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        out = model(ids, attention_mask=mask) if mask is not None and self._mask_arg(model) else model(ids)
        if hasattr(out, "logits"):
            return out.logits
        return out[0] if isinstance(out, (tuple, list)) else out

    def _mask_arg(self, model) -> bool:
        """Whether the model's forward takes ``attention_mask`` (transformers' models do; a plain module may not)."""
        key = id(model)
        if key not in self._takes_mask:
            import inspect

            inner = getattr(model, "module", model)  # DDP's wrapper
            try:
                params = inspect.signature(inner.forward).parameters
            except (TypeError, ValueError):
                params = {}
            self._takes_mask[key] = "attention_mask" in params or any(
                p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        return self._takes_mask[key]

    def token_losses(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each target token's loss [B, T-1] (0 where no target) and whether it is a target [B, T-1]."""
        ids, labels, mask = self.split(batch)
        logits = self.logits(model, ids, mask)
        targets = labels[:, 1:]
        per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), reduction="none",
                                    ignore_index=self.ignore_index).view(targets.shape)
        return per_token, targets != self.ignore_index

    def loss(self, model, batch):
        per_token, counted = self.token_losses(model, batch)
        n = counted.sum()
        return per_token.sum() / n.clamp(min=1), n

    def evaluate(self, model, batch):
        per_token, counted = self.token_losses(model, batch)
        return {"token_loss_sum": per_token.double().sum(dim=1), "target_tokens": counted.double().sum(dim=1)}

    def summarize(self, means: dict) -> dict:
        # both means are over the same distinct samples: their ratio is sum of losses / sum of tokens
        loss = means["token_loss_sum"] / means["target_tokens"] if means["target_tokens"] > 0 else float("nan")
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)) if loss == loss else float("nan")}
