"""A run that ends on an epoch boundary (the usual case) evaluates once per epoch on every rank, on a
real local Ray with 2 workers: the epoch's end is also the run's, not a second pass over the eval set.
(1 and 3 ranks, `ray-app eval` and ``train.max_steps``: tests/unit/test_loop_counts.py, the proof CI keeps; this
one, through Ray, is in ``make test-long``.) One Ray run."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest

from tests.support.processes import run_cli

pytestmark = [pytest.mark.integration, pytest.mark.long]

N_TRAIN, N_EVAL, BATCH, EPOCHS, WORKERS = 32, 13, 4, 2, 2

TASK = '''
    import os

    import torch.distributed as dist

    from ray_app.shared.tasks import Classification


    def data():
        import torch
        from torch.utils.data import TensorDataset

        g = torch.Generator().manual_seed(0)
        x = torch.randn({n_train} + {n_eval}, 4, generator=g)
        y = (x[:, 0] > 0).long()
        return TensorDataset(x[:{n_train}], y[:{n_train}]), TensorDataset(x[{n_train}:], y[{n_train}:])


    class CountingTask(Classification):
        """Appends one line per evaluate() call to calls/rank<r>."""

        def __init__(self, calls_dir):
            super().__init__()
            self.calls_dir = calls_dir

        def evaluate(self, model, batch):
            with open(os.path.join(self.calls_dir, f"rank{{dist.get_rank()}}"), "a") as f:
                f.write("1\\n")
            return super().evaluate(model, batch)
'''


@pytest.mark.timeout(300)
def test_an_epoch_boundary_run_evaluates_once_per_epoch_on_every_rank(tmp_path: Path, port_picker):
    (tmp_path / "counting.py").write_text(textwrap.dedent(TASK.format(n_train=N_TRAIN, n_eval=N_EVAL)))
    calls = tmp_path / "calls"
    calls.mkdir()
    rc, out, err = run_cli(["train", "--set", "data.name=counting:data", "--set", "model.name=torch.nn:Linear",
                            "--set", "model.args={in_features: 4, out_features: 2}",
                            "--set", "task.name=counting:CountingTask", "--set", f"task.args={{calls_dir: {calls}}}",
                            "--set", f"data.batch_size={BATCH}", "--set", f"train.epochs={EPOCHS}",
                            "--set", f"scaling.num_workers={WORKERS}", "--set", "run.storage=./runs",
                            "--set", "metrics.enabled=false", "--set", f"metrics.port={port_picker()}"],
                           env={"RAY_ADDRESS": None}, timeout=280, cwd=tmp_path)
    assert rc == 0, f"{out[-3000:]}\n{err[-3000:]}"
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["epochs"] == EPOCHS and summary["num_eval_samples"] == N_EVAL
    batches_per_pass = math.ceil(math.ceil(N_EVAL / WORKERS) / BATCH)
    for rank in range(WORKERS):
        n = len((calls / f"rank{rank}").read_text().splitlines())
        assert n == EPOCHS * batches_per_pass, (rank, n)
