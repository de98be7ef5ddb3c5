"""Model FLOPs per training sample and model FLOP utilization (MFU) for the GPU bench.

FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` on one
forward + backward of the kit's own model (on the CPU, batch 2, divided by 2);
bf16 autocast changes the precision, not the count. Peak figures are the kit's
own table (``ray_app.worker.flops``: dense bf16 tensor-core FLOP/s from the
vendors' data sheets, what a run's MFU divides by); set
``BENCH_GPU_PEAK_TFLOPS`` for a GPU not listed.
"""

from __future__ import annotations

import os

from ray_app.worker.flops import table_peak, utilization


def peak_flops(device_name: str | None) -> tuple[float | None, str]:
    """(peak FLOP/s, where the figure comes from) for a GPU name."""
    env = os.environ.get("BENCH_GPU_PEAK_TFLOPS")
    if env:
        return float(env) * 1e12, "BENCH_GPU_PEAK_TFLOPS"
    peak, where = table_peak(device_name)
    return (peak, where) if peak is not None else (None, f"{where}: set BENCH_GPU_PEAK_TFLOPS")


def flops_per_sample(overrides: tuple[str, ...], batch: int = 2) -> float:
    """Forward + backward FLOPs of one sample of the model and data that ``overrides`` name."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from ray_app.shared.config import load_config
    from ray_app.shared.plugins import build_model

    cfg = load_config(None, list(overrides))
    channels = 1 if cfg.data.name == "digits" else 3
    size = 8 if cfg.data.name == "digits" else (32 if cfg.data.name == "cifar10" else cfg.data.args.get("image_size", 32))
    model = build_model(cfg, {"num_classes": 10, "channels": channels, "image_size": size})
    x = torch.randn(batch, channels, size, size)
    y = torch.randint(0, 10, (batch,))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x), y).backward()
    return counter.get_total_flops() / batch


def mfu(flops_sample: float | None, samples_per_second: float | None, peak: float | None) -> float | None:
    """MFU of samples at ``samples_per_second`` (the kit's formula: one second's FLOPs over the peak)."""
    return utilization(flops_sample, samples_per_second or 0.0, 1.0, peak)
