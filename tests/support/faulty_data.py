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
        if i == 37:
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
