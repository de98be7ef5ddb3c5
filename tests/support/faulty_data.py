"""Data plug-ins with the user's own bugs, for the fault tests: ragged samples (the default collate cannot
stack them) and a ``__getitem__`` that raises. Each build appends a line to ``attempts`` so a test counts
the worker-group attempts. And a rank slowed, by its data or by its forward, for every rank's pace."""

from __future__ import annotations

import os
import time

import torch


class Samples(torch.utils.data.Dataset):
    def __init__(self, n: int, broken: str):
        self.n, self.broken = n, broken

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == 37 and self.broken != "none":
            if self.broken == "getitem":
                return self.decode(i)
            return torch.zeros(17), i % 10  # one element longer than the others
        return torch.zeros(16), i % 10

    def decode(self, i):
        raise ValueError(f"cannot decode record {i}")


def build(broken: str = "ragged", attempts: str = "", n: int = 64):
    if attempts:
        with open(attempts, "a") as f:
            f.write("built\n")
    return Samples(n, broken), Samples(n, "none"), {"num_classes": 10}


class Linear(torch.nn.Linear):
    """The model for these samples: 16 features -> the classes."""

    def __init__(self, num_classes: int = 10):
        super().__init__(16, num_classes)


class FlakyTask:
    """Classification whose loss raises the same ``OSError`` from the same line on rank 0 at its
    ``fail_at[k]``-th call in attempt k + 1 (an attempt's number: the lines ``build`` wrote to ``attempts``,
    two workers a build each), and trains on otherwise: an intermittent read error at two different steps."""

    def __init__(self, attempts: str, fail_at: str = "3,7"):
        from ray_app.shared.tasks import Classification

        self.inner = Classification()
        with open(attempts) as f:
            attempt = (len(f.read().splitlines()) + 1) // 2
        points = [int(x) for x in fail_at.split(",")]
        self.fail_at = points[attempt - 1] if attempt <= len(points) else 0
        self.calls = 0

    def loss(self, model, batch):
        import torch.distributed as dist

        self.calls += 1
        if self.calls == self.fail_at and dist.get_rank() == 0:
            raise OSError(5, "Input/output error: a flaky read")
        return self.inner.loss(model, batch)

    def evaluate(self, model, batch):
        return self.inner.evaluate(model, batch)


# ---------------------------------------------------------------- one rank slowed (every rank's pace)

class SlowOnOneRank(torch.utils.data.Dataset):
    """A train set that sleeps ``delay_s`` per batch of ``batch_size`` on one rank, for its first ``batches``
    batches (0: all of them): a data loader that falls behind on one node."""

    def __init__(self, inner, delay_s: float, batch_size: int, batches: int):
        self.inner, self.per_item, self.items_left = inner, delay_s / batch_size, batches * batch_size or -1

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        if self.items_left != 0:
            self.items_left -= 1
            time.sleep(self.per_item)
        return self.inner[i]


def slow_rank(name: str = "synthetic", rank: int = 1, delay_s: float = 0.1, batch_size: int = 32, batches: int = 0,
              once: str = "", **args):
    """A built-in data set (``name``) whose train set is slow on rank ``rank`` (``SlowOnOneRank``). With
    ``once`` (a file path), only in the first worker group that builds it: the file is created then."""
    import torch.distributed as dist

    from ray_app.shared import data

    train, eval_set, info = getattr(data, name)(**args)
    first = not once or not os.path.exists(once)
    if dist.is_initialized() and dist.get_rank() == rank and first:
        if once:
            open(once, "a").close()
        train = SlowOnOneRank(train, delay_s, batch_size, batches)
    return train, eval_set, info


class SlowForwardNet(torch.nn.Module):
    """Digits (1x8x8) -> 10 classes, whose forward sleeps ``delay_s`` on rank ``rank`` while training: a rank
    whose compute is slow (a throttled node, a slower device), not its data."""

    def __init__(self, rank: int = 1, delay_s: float = 0.05):
        super().__init__()
        self.rank, self.delay_s = rank, delay_s
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))

    def forward(self, x):
        import torch.distributed as dist

        if self.training and dist.is_initialized() and dist.get_rank() == self.rank:
            time.sleep(self.delay_s)
        return self.net(x)
