"""A user's project of their own, written into a folder outside the repository by the tests.

Its own package ``acme``: a data factory whose items are dicts, a model class whose sizes come from
the data's info and ``model.args``, a task with two metrics of its own; and ``my.yaml`` naming them.
``BROKEN`` holds variants of its files for the bad-input tests.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

N_TRAIN, N_EVAL = 301, 97  # 97: prime, so the sampler pads it at 2 and 3 workers

FILES = {
    "acme/__init__.py": "",
    "acme/data.py": '''
        import torch
        from torch.utils.data import Dataset


        class Points(Dataset):
            """Points in R^d labelled by which of the class centres they are nearest to; items are dicts."""

            def __init__(self, n, num_features, num_classes, seed):
                g = torch.Generator().manual_seed(seed)
                centres = torch.randn(num_classes, num_features, generator=torch.Generator().manual_seed(7)) * 2
                self.label = torch.randint(0, num_classes, (n,), generator=g)
                self.features = centres[self.label] + torch.randn(n, num_features, generator=g)

            def __len__(self):
                return len(self.label)

            def __getitem__(self, i):
                return {"features": self.features[i], "label": self.label[i]}


        def build(n_train=301, n_eval=97, num_features=6, num_classes=3):
            info = {"num_features": num_features, "num_classes": num_classes, "unused_by_the_model": 1}
            return Points(n_train, num_features, num_classes, 1), Points(n_eval, num_features, num_classes, 2), info
    ''',
    "acme/model.py": '''
        from torch import nn


        class Net(nn.Module):
            def __init__(self, num_features, num_classes, hidden=16):
                super().__init__()
                self.body = nn.Sequential(nn.Linear(num_features, hidden), nn.Tanh(), nn.Linear(hidden, num_classes))

            def forward(self, x):
                return self.body(x)
    ''',
    "acme/task.py": '''
        import torch.nn.functional as F


        class NearestCentre:
            """Cross-entropy training; eval reports hits (top-1 correct, 0/1) and nll per sample."""

            def __init__(self, smoothing=0.0):
                self.smoothing = smoothing

            def loss(self, model, batch):
                logits = model(batch["features"])
                return F.cross_entropy(logits, batch["label"], label_smoothing=self.smoothing), batch["label"].shape[0]

            def evaluate(self, model, batch):
                logits = model(batch["features"]).float()
                return {"hits": (logits.argmax(1) == batch["label"]).double(),
                        "nll": F.cross_entropy(logits, batch["label"], reduction="none")}
    ''',
    "my.yaml": '''
        run: {name: acme-run, storage: ./runs}
        data: {name: "acme.data:build", args: {n_train: 301, n_eval: 97}, batch_size: 16}
        model: {name: "acme.model:Net", args: {hidden: 24}}
        task: {name: "acme.task:NearestCentre", args: {smoothing: 0.05}}
        train: {epochs: 3, lr: 0.05, log_every_steps: 5}
        checkpoint: {every_epochs: 1}
        scaling: {num_workers: 2}
        metrics: {enabled: false}
    ''',
}


def write_project(folder: Path, overrides: dict[str, str] | None = None) -> Path:
    """Write the project (files in ``overrides`` replace or add to FILES) into ``folder``."""
    for rel, text in {**FILES, **(overrides or {})}.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return folder
