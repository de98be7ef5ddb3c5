"""Data plug-ins with the user's own bugs, for the fault tests: ragged samples (the default collate cannot
stack them) and a ``__getitem__`` that raises. Each build appends a line to ``attempts`` so a test counts
the worker-group attempts."""

from __future__ import annotations

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
        from ray_app.tasks import Classification

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
