"""Exact evaluation of any task on every rank (practice 5), for training and for ``ray-app eval``.

``Evaluator.evaluate(model)`` runs the task's ``evaluate(model, batch)`` over this rank's share of the
eval set, sums each metric's per-sample values with the sampler's padded duplicates masked out, and
all-reduces the sums and the count once: every mean equals a single-process evaluation of the same set,
exactly. Only a task that needs every value (``summarize_rows``) has the rows gathered, by the sampler's
indices. It knows nothing of the optimizer, the train loader or checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader

from ray_app.shared.errors import PluginError
from ray_app.worker.ddp import ExactSums, gather_eval_rows, to_device


@dataclass
class EvalSet:
    """This rank's share of the eval set, as its DistributedSampler deals it."""

    loader: DataLoader
    indices: torch.Tensor  # this rank's eval indices, in the order the loader yields them
    keep: torch.Tensor  # bool, the same order: False where the sampler padded (a repeated sample)
    batch_sizes: list[int]


class Evaluator:
    def __init__(self, task, task_name: str, eval_set: EvalSet, world_size: int, device: torch.device,
                 autocast: bool = False, on_eval=None):
        self.task, self.task_name, self.data = task, task_name, eval_set
        self.world_size, self.device, self.autocast = world_size, device, autocast  # training's (train.precision)
        self.on_eval = on_eval  # rank 0's metrics sink, told every result

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> dict:
        """Practice 5: every metric of the task, exact over the distinct eval samples of all ranks.
        Collective: every rank calls it at the same point."""
        model.eval()
        data, names, sums, columns, start = self.data, None, None, [], 0
        summarize_rows = getattr(self.task, "summarize_rows", None)
        for i, batch in enumerate(data.loader):
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                values = self.task.evaluate(model, to_device(batch, self.device))
            names = names or self._check_names(values)
            size = data.batch_sizes[i]
            batch_columns = self._columns(values, names, size)
            sums = sums or ExactSums(len(names), batch_columns.device)
            sums.add(batch_columns, data.keep[start:start + size])
            start += size
            if callable(summarize_rows):  # this task needs every value, not only the means
                columns.append(batch_columns)
        sums.all_reduce()  # sync point: all ranks
        model.train()
        means = dict(zip(names, sums.means()))
        if callable(summarize_rows):
            idx, rows = gather_eval_rows(data.indices.to(self.device), torch.cat(columns), self.world_size)
            rows = rows[idx.argsort()]  # in the data set's order
            means.update({k: float(v) for k, v in summarize_rows({n: rows[:, j] for j, n in enumerate(names)}).items()})
        summarize = getattr(self.task, "summarize", None)
        if callable(summarize):
            means.update({k: float(v) for k, v in summarize(dict(means)).items()})
        if self.on_eval is not None:
            self.on_eval(dict(means))
        return {**{f"eval_{k}": v for k, v in means.items()}, "num_samples": sums.num_samples()}

    def _check_names(self, values) -> list[str]:
        if not isinstance(values, dict) or not values:
            raise PluginError(f"config key task.name: {self.task_name}.evaluate(model, batch) returned "
                              f"{describe(values)}; it must return {{name: per-sample tensor of shape [B]}}")
        bad = [k for k in values if not (isinstance(k, str) and k.isidentifier() and k == k.lower())]
        if bad:
            raise PluginError(f"config key task.name: {self.task_name}.evaluate returned the metric name "
                              f"{bad[0]!r}; use lower-case names such as 'accuracy' (reported as eval_<name>)")
        return list(values)

    def _columns(self, values: dict, names: list[str], batch_size: int) -> torch.Tensor:
        if list(values) != names:
            raise PluginError(f"config key task.name: {self.task_name}.evaluate returned {sorted(values)} for "
                              f"one batch and {sorted(names)} for another; return the same metrics for every batch")
        for name, v in values.items():
            if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.shape[0] != batch_size:
                shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise PluginError(f"config key task.name: {self.task_name}.evaluate returned {name!r} of shape "
                                  f"{shape}; each value must be a per-sample tensor of shape [{batch_size}] "
                                  "(the batch's size)")
        return torch.stack([values[n].double() for n in names], dim=1)


def describe(obj) -> str:
    """What a plug-in returned, for a one-line error."""
    if isinstance(obj, torch.Tensor):
        return f"a tensor of shape {tuple(obj.shape)}"
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of {len(obj)} items"
    return f"a {type(obj).__name__}"
