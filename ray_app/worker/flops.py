"""Model FLOPs per optimizer step, the device's peak, and model FLOP utilization (MFU).

``StepFlops`` counts the FLOPs of one optimizer step once per worker-group start, with
``torch.utils.flop_counter.FlopCounterMode`` around the real forward, loss and backward of the first
micro-batch of the attempt's second step, on the rank's real module and batch, times the step's
micro-batches (``train.grad_accum``). It is the attempt's second step because the counted step runs eagerly
(``torch.compiler.set_stance("force_eager")``: compiled code cannot run under a dispatch mode, and a
``fullgraph`` compile, as ``train.compile``'s, refuses to be skipped): the first step, which compiles, stays as
it is, and the steps after the counted one run compiled again. The count
is of the whole model's FLOPs for this rank's batch: under FSDP the matmuls run on the gathered parameters,
and a collective has no FLOP formula, so nothing is halved by sharding nor doubled by the all-gathers. With
activation checkpointing the recomputed forward runs inside the counted backward and is counted too.

MFU = FLOPs per step x steps / seconds / the device's peak FLOP/s (every rank's batch, hence its FLOPs, is
the same size; so is its share of the wall time). The peak is ``train.peak_tflops`` when set, else the dense
bf16 tensor-core figure of the GPU's data sheet (``PEAK_BF16_DENSE_TFLOPS``); a CPU, or a GPU not in the
table, has none: no FLOPs are counted and MFU is absent (never 0).
"""

from __future__ import annotations

import contextlib

import torch

PEAK_BF16_DENSE_TFLOPS = {  # substring of torch.cuda.get_device_name() -> dense bf16 TFLOP/s (data sheets)
    "H200": 989.0, "H100": 989.0, "GH200": 989.0, "B200": 2250.0, "A100": 312.0, "L40S": 362.0,
    "L40": 181.0, "A10G": 70.0, "A10": 125.0, "L4": 121.0,
}


def table_peak(device_name: str | None) -> tuple[float | None, str]:
    """(peak FLOP/s, where the figure comes from) of a GPU by its name; (None, why) when not in the table."""
    for key in sorted(PEAK_BF16_DENSE_TFLOPS, key=len, reverse=True):  # GH200 before H200, L40S before L40
        if device_name and key in device_name:
            return PEAK_BF16_DENSE_TFLOPS[key] * 1e12, f"{key} data sheet, dense bf16"
    return None, f"GPU {device_name!r} is not in the table of peaks"


def device_peak(device: torch.device, peak_tflops: float = 0.0) -> tuple[float | None, str]:
    """(peak FLOP/s, where it comes from) of ``device``: ``train.peak_tflops`` when > 0, else the table's for a
    GPU; (None, why) on a CPU or for a GPU not in the table."""
    if peak_tflops > 0:
        return peak_tflops * 1e12, "train.peak_tflops"
    if device.type != "cuda":
        return None, f"no peak known for a {device.type} device"
    return table_peak(torch.cuda.get_device_name(device))


def utilization(flops_per_step: float | None, steps: float, seconds: float, peak: float | None) -> float | None:
    """MFU of ``steps`` optimizer steps in ``seconds`` (a ratio; None when a figure is missing)."""
    if not flops_per_step or not peak or steps <= 0 or seconds <= 0:
        return None
    return flops_per_step * steps / seconds / peak


class StepFlops:
    """One rank's FLOPs per optimizer step, counted once per worker-group start (see the module's text)."""

    def __init__(self, device: torch.device, peak_tflops: float = 0.0, say=print):
        self.peak, self.peak_source = device_peak(device, peak_tflops)
        self.device, self.say = device, say
        self.per_step: float | None = None
        self.count_step: int | None = None  # the global step whose first micro-batch is counted (the attempt's second)

    def counting(self, step: int, micro: int, micro_batches: int):
        """The context the loop runs micro-batch ``micro`` (0-based) of optimizer step ``step`` in (of
        ``micro_batches``); the first call is the attempt's first step's, and the step after it is counted."""
        if self.count_step is None:
            self.count_step = step + 1
            if self.peak is None and self.device.type == "cuda":  # said once, when training starts
                self.say(f"MFU is not shown: {self.peak_source}; set train.peak_tflops to the device's peak TFLOP/s")
        if self.peak is None or self.per_step is not None or step != self.count_step or micro != 0:
            return contextlib.nullcontext()
        return self._count(micro_batches)

    @contextlib.contextmanager
    def _count(self, micro_batches: int):
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
        with torch.compiler.set_stance("force_eager"), counter:  # compiled blocks run eagerly, counted
            yield
        self.per_step = float(counter.get_total_flops() * micro_batches)

    def mfu(self, steps: float, seconds: float) -> float | None:
        return utilization(self.per_step, steps, seconds, self.peak)
