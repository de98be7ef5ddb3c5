"""Exact evaluation's memory on a real gloo group of 2 ranks: what a user would notice is that an eval set
10x larger costs evaluation no more memory (only time), while its means still equal a single-process
``math.fsum``; a task that asks for every row (``summarize_rows``) pays for them, and the same
measurement sees it.
"""

from __future__ import annotations

import ctypes
import gc
import math
import os

import pytest
import torch

from ray_app.shared.config import load_config
from ray_app.shared.storage import LocalStorage
from ray_app.worker.checkpoint import Checkpointer
from ray_app.worker.loop import Trainer
from ray_app.worker.parts import build_parts
from tests.unit.test_loop_ddp import FakeRuntime, RecordingMetrics, _finish, _init, _load_ranks, _spawn

SIZES = (10**5, 10**6)
BATCH = 8192
# Allowed between the two sizes on the reduced path: ExactSums sums up to CHUNK_ROWS (65,536) rows at once,
# 2-3 MB more temporaries than the 50,000 rows per rank of 10^5 samples; the rest is allocator noise.
SLACK_MB = 5.0
GATHER_MARGIN_MB = 10.0  # the gather path at 10^6 must exceed the reduced one by more than this
POWERS_OF_TWO = torch.tensor([2.0**k for k in range(-30, 31)], dtype=torch.float64)  # exact factors


class LazyIndices(torch.utils.data.Dataset):
    """Sample i is the integer i: nothing of O(n) is held (default_collate makes a batch one int64 tensor)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def lazy_data(n: int):
    """A data plug-in (by name: tests.unit.test_eval_memory:lazy_data): n eval samples, computed from their index."""
    return LazyIndices(8), LazyIndices(n), {}


def sample_values(i: torch.Tensor) -> torch.Tensor:
    """Each sample's metric from its index, by exact integer arithmetic and a power of two: both signs,
    magnitudes 2^-30..2^45, so a naive float64 sum depends on its order."""
    return ((i * 40503) % 65537 - 32768).double() * POWERS_OF_TWO[i % 61]


class Scale(torch.nn.Module):
    """The model: one float64 parameter, 1.0 (x * 1.0 is exact)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))

    def forward(self, x):
        return x * self.w


class ValueTask:
    """Per-sample metric ``value`` = sample_values(index), through the model."""

    def loss(self, model, batch):
        return model(sample_values(batch)).mean(), len(batch)

    def evaluate(self, model, batch):
        return {"value": model(sample_values(batch))}


class RowsValueTask(ValueTask):
    """The same metric, and a median: the kit gathers every row for it."""

    def summarize_rows(self, rows: dict) -> dict:
        return {"rows": len(rows["value"]), "median_value": rows["value"].median().item()}


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_growth_mb(fn) -> tuple[float, object]:
    """Peak resident memory growth (MB) while ``fn()`` runs: freed memory handed back to the kernel first,
    then the high-water mark (VmHWM) reset to the current resident size."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss_kb("VmRSS")
    result = fn()
    return (_rss_kb("VmHWM") - before) / 1024, result


def _memory_worker(rank: int, world: int, port: int, out: str) -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD fixed at its default: large blocks are mmapped and unmapped
    _init(rank, world, port)
    results = {}
    for task in ("ValueTask", "RowsValueTask"):
        for n in SIZES:
            cfg = load_config(None, ["data.name=tests.unit.test_eval_memory:lazy_data", f"data.args={{n: {n}}}",
                                     "model.name=tests.unit.test_eval_memory:Scale",
                                     f"task.name=tests.unit.test_eval_memory:{task}", f"data.batch_size={BATCH}",
                                     "train.epochs=1", "metrics.enabled=false", "checkpoint.every_epochs=0",
                                     "checkpoint.every_steps=0", f"run.storage={out}/runs", f"run.name={task}-{n}"])
            rt = FakeRuntime(rank, world)
            checkpointer = Checkpointer(LocalStorage(cfg.run.storage), cfg.run.name, rt.report, every_epochs=0,
                                        every_steps=0)
            trainer = Trainer(cfg, rt, build_parts(cfg, rt), checkpointer, RecordingMetrics())
            trainer.evaluate()  # first pass: one-time costs (kernels, the loader's machinery) are not the eval's
            growth, result = _peak_growth_mb(trainer.evaluate)
            results[(task, n)] = {"growth_mb": growth, "result": result}
            del trainer, checkpointer, rt
            gc.collect()
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    _finish()


@pytest.mark.timeout(120)
def test_reduced_eval_memory_does_not_grow_with_the_eval_set_and_its_means_equal_fsum(tmp_path, port_picker):
    """10^5 and 10^6 lazy eval samples over 2 ranks, through Trainer.evaluate: the reduced path's peak memory
    growth per rank is the same within SLACK_MB; the gather path (summarize_rows) grows with the rows, which
    shows the measurement sees O(N) memory; every mean equals math.fsum / N of one process, bit for bit."""
    _spawn(_memory_worker, 2, port_picker(), str(tmp_path))
    ranks = _load_ranks(tmp_path, 2)
    for rank, r in enumerate(ranks):
        g = {key: round(v["growth_mb"], 1) for key, v in r.items()}
        print(f"rank {rank} peak eval memory growth, MB: "
              + ", ".join(f"{'reduced' if t == 'ValueTask' else 'gathered'} {n:.0e}: {mb}" for (t, n), mb in g.items()))
    for n in SIZES:
        values = sample_values(torch.arange(n)).tolist()
        assert math.fsum(values) != sum(values)  # the order matters for these values
        expected = math.fsum(values) / n
        for r in ranks:
            for task in ("ValueTask", "RowsValueTask"):
                result = r[(task, n)]["result"]
                assert result["eval_value"] == expected, (task, n, result["eval_value"], expected)
                assert result["num_samples"] == n
            assert r[("RowsValueTask", n)]["result"]["eval_rows"] == n
    for r in ranks:
        small, large = (r[("ValueTask", n)]["growth_mb"] for n in SIZES)
        assert large <= small + SLACK_MB, f"reduced eval grew {small:.1f} MB at 10^5, {large:.1f} MB at 10^6"
        gathered = r[("RowsValueTask", SIZES[1])]["growth_mb"]
        assert gathered > large + GATHER_MARGIN_MB, f"gather path {gathered:.1f} MB vs reduced {large:.1f} MB"
