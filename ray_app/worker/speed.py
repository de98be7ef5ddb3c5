"""The speed switches of training, applied to the user's module before it is spread over the workers, in the
order torchtitan's ``parallelize`` applies them (``apply_speed_switches``, then ``ray_app.worker.strategy``):

1. precision (``train.precision``): ``bf16`` casts the weights (and so the gradients and the optimizer's state)
   to bf16 here; ``bf16-mixed`` keeps them fp32 and computes in bf16: FSDP gathers them in bf16 and reduces
   gradients in fp32 (``MixedPrecisionPolicy``, ``Precision.gather_bf16``), DDP runs forward and loss under
   bf16 autocast (its parameters, and so the gradients it all-reduces, stay fp32). CPU and CUDA alike.
2. activation checkpointing of each block (``train.activation_checkpointing``): before compile, so the compiled
   graph holds the recomputation, and before FSDP, so a block's gather happens once around both.
3. ``torch.compile`` of each block (``train.compile``; a model without blocks as one graph), the task's loss
   outside: after AC, before FSDP, whose hooks stay outside the compiled graphs.
4. FSDP or DDP (``ray_app.worker.strategy.fully_shard_model``, ``Runtime.prepare_model``).

The blocks are those FSDP shards as units (``strategy.blocks``). AC and compile each replace a block's
``forward`` in place (an attribute of the instance), so no module is wrapped and no name changes: state-dict
keys, and with them checkpoints, are the same whatever the switches, and a checkpoint of a run with them loads
into one without them and back.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from ray_app.shared.config import TrainSection
from ray_app.shared.errors import ConfigError, first_line
from ray_app.worker.strategy import blocks


@dataclass(frozen=True)
class Precision:
    """``train.precision`` under a strategy: what the weights are held in, what FSDP gathers, where autocast
    runs."""

    name: str  # fp32 | bf16-mixed | bf16
    sharded: bool  # train.strategy=fsdp

    @property
    def held_dtype(self) -> torch.dtype:
        """The dtype of the weights, their gradients and the optimizer's state (what a checkpoint holds)."""
        return torch.bfloat16 if self.name == "bf16" else torch.float32

    @property
    def gather_bf16(self) -> bool:
        """FSDP gathers fp32 weights in bf16 and reduces gradients in fp32 (``MixedPrecisionPolicy``)."""
        return self.sharded and self.name == "bf16-mixed"

    @property
    def autocasts(self) -> bool:
        """Forward and loss (training and evaluation) run under bf16 autocast: DDP's bf16-mixed, and bf16
        (whose inputs arrive in fp32)."""
        return self.name == "bf16" or (self.name == "bf16-mixed" and not self.sharded)

    def autocast(self, device: torch.device):
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.autocasts)

    def cast(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module's floating-point weights and buffers in the held dtype (on the meta device too: pretrained
        weights are then cast as they are read)."""
        return module.to(self.held_dtype) if self.held_dtype != torch.float32 else module


def apply_speed_switches(module: torch.nn.Module, train: TrainSection, precision: Precision) -> torch.nn.Module:
    """Steps 1-3 above, on the user's module, in place; the strategy (step 4) comes after."""
    module = precision.cast(module)
    if train.activation_checkpointing != "none":
        found = blocks(module, train.fsdp_units, f"train.activation_checkpointing={train.activation_checkpointing}")
        every = train.ac_every if train.activation_checkpointing == "selective" else 1
        for block in found[every - 1::every]:  # torchtitan's layer-wise selective AC: every ac_every-th block
            block.forward = _checkpointed(block.forward, block, compiled=train.compile)
    if train.compile:
        use_compile_cache(train.compile_cache_dir)
        if train.activation_checkpointing != "none":
            replay_no_side_effects_in_recomputation()
        names = {id(m): n for n, m in module.named_modules()}
        for block in _compile_units(module, train.fsdp_units):
            where = f"the block {names[id(block)]}" if block is not module else "the model"
            block.forward = _compiled(block.forward, f"{where} ({type(block).__name__})")
    return module


def _compile_units(module: torch.nn.Module, names: str) -> list[torch.nn.Module]:
    """What ``train.compile`` compiles: each block (``strategy.blocks``), or the whole model as one graph when it
    has none and ``train.fsdp_units`` names none (a small CNN or MLP: accelerate's whole-model compile)."""
    try:
        return blocks(module, names, "train.compile=true")
    except ConfigError:
        if names.strip():  # the classes named are not in the model: say so
            raise
        return [module]


def _checkpointed(forward, block: torch.nn.Module, compiled: bool):
    """``forward`` keeping only its inputs for backward and running again in backward for the rest
    (non-reentrant: keyword arguments and outputs of any structure pass; the RNG state is restored, so dropout
    draws the same mask again and the gradients are those without it, bit for bit). A BatchNorm's running
    statistics, which the second run would move again, are put back after it, so they move once a step, as
    without it; ``compiled`` (the block is compiled next): the compiled recomputation only recomputes what the
    gradients need, never a buffer's update, and dynamo takes no ``context_fn`` of this kind."""
    statistics = [m for m in block.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                  and m.track_running_stats]

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing is kept for a backward
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    @functools.wraps(forward)
    def run_keeping_statistics(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False,
                          context_fn=functools.partial(_running_statistics_kept, statistics), **kwargs)

    return run_keeping_statistics if statistics and not compiled else run


def replay_no_side_effects_in_recomputation() -> None:
    """Compile over activation checkpointing: a checkpointed block whose forward sets a Python attribute is
    compiled, that assignment not done again in the compiled recomputation. Without it dynamo refuses such a
    block ("HOP: Unsafe side effect"): every Hugging Face decoder layer of transformers 5, whose attention the
    ``kernels`` package wraps in a forward that sets a context variable (its hub kernels' selection). The
    compiled recomputation runs the graph traced once, so an attribute's value during the recomputation changes
    nothing; it is what torch's flag ``skip_fwd_side_effects_in_bwd_under_checkpoint`` allows (process-wide: a
    worker compiles only the model's blocks)."""
    import torch._dynamo

    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def _running_statistics_kept(modules: list[torch.nn.Module]):
    """``checkpoint``'s (forward, recomputation) contexts: the recomputation leaves ``modules``' buffers as
    they were."""
    return contextlib.nullcontext(), _buffers_restored(modules)


@contextlib.contextmanager
def _buffers_restored(modules: list[torch.nn.Module]):
    saved = [(b, b.clone()) for m in modules for b in m.buffers(recurse=False)]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def _compile_errors() -> tuple[type[BaseException], ...]:
    """What torch.compile raises when it cannot compile (torch's private exception modules: dynamo's base
    class, and inductor's own where it is not one)."""
    from torch._dynamo.exc import TorchDynamoException

    try:
        from torch._inductor.exc import InductorError
    except ImportError:
        return (TorchDynamoException,)
    return (TorchDynamoException, InductorError)


def _compiled(forward, where: str):
    """``forward`` compiled as one graph (fullgraph: a block that would break into pieces is an error, as in
    torchtitan); a compile error, raised at the call that compiles (the first step, or a new input shape), is
    a ConfigError naming torch's first line, the block and the fix."""
    compiled = torch.compile(forward, fullgraph=True)
    errors = _compile_errors()

    @functools.wraps(forward)
    def run(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except errors as exc:
            raise ConfigError(f"train.compile=true: torch.compile failed in {where}: {first_line(exc)}; "
                              "set train.compile=false to run the model eagerly") from None

    return run


def use_compile_cache(cache_dir: str) -> str:
    """Point inductor's and Triton's caches at ``train.compile_cache_dir``, else ``TORCHINDUCTOR_CACHE_DIR`` as
    set, else a folder of this user under the node's temp dir named by nothing of the run, so that a worker
    group restarted on the node finds what the last one compiled. Before the first compile (inductor reads it
    at each compile). The default folder must be this user's own (the cache holds code that is loaded)."""
    folder = cache_dir or os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
    if not folder:
        folder = default_compile_cache()
        os.makedirs(folder, mode=0o700, exist_ok=True)
        if os.stat(folder).st_uid != os.getuid():
            raise ConfigError(f"train.compile_cache_dir: {folder} belongs to another user; set "
                              "train.compile_cache_dir to a folder of yours")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    if cache_dir or not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = os.path.join(folder, "triton")
    return folder


def default_compile_cache() -> str:
    return os.path.join(tempfile.gettempdir(), f"ray_app-inductor-{os.getuid()}")
