"""A pretrained model's weights, each rank reading only what it holds (``model.name: hf``, see
``ray_app.shared.hf``).

The model arrives with its parameters on the meta device. After the strategy has sharded it (FSDP: each
parameter a DTensor whose local piece is a run of rows of the whole) or left it whole (DDP), ``load_pretrained``
gives every parameter real storage on the device (``to_empty``), puts back the buffers the model computed when
it was made (``to_empty`` would leave them empty), ties the tied weights again, and fills each local piece
with those rows of the tensor, read by byte range from the safetensors file straight into it. Under FSDP at N
ranks a rank reads about 1/N of the weights and never holds the rest; under DDP every rank reads them all (it
holds them all).
A LoRA model (``ray_app.worker.lora``): its base tensors are read under the files' names, its adapters filled
with the initial values made before sharding.
"""

from __future__ import annotations

import torch

from ray_app.shared.errors import ConfigError
from ray_app.worker.lora import file_name


def pending_weights(module: torch.nn.Module):
    """The ``PretrainedWeights`` a model plug-in attached, or None for a model made with its weights."""
    return getattr(module, "ray_app_weights", None)


def local_rows(param: torch.Tensor) -> slice | None:
    """The rows of the whole tensor that this rank's piece of ``param`` holds (None: the whole tensor). FSDP2
    shards dimension 0 as ``torch.chunk`` does, over each mesh dimension placed ``Shard(0)``."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        return None
    start, stop = 0, param.shape[0]
    for dim, placement in enumerate(param.placements):
        if isinstance(placement, Replicate):
            continue
        if not (isinstance(placement, Shard) and placement.dim == 0):
            raise ConfigError(f"model.name hf: a parameter placed {placement} cannot be read by rows; "
                              "the kit reads FSDP's Shard(0) and replicated parameters")
        size, coord = param.device_mesh.size(dim), param.device_mesh.get_local_rank(dim)
        chunk = -(-(stop - start) // size)
        start, stop = min(start + coord * chunk, stop), min(start + (coord + 1) * chunk, stop)
    return slice(start, stop)


def _source_name(weights, names: list[str]) -> str:
    """The name a parameter has in the files: its own, or (a tied weight) one of its aliases', as the unwrapped
    model names it (a LoRA model's base: ``ray_app.worker.lora.file_name``)."""
    for name in map(file_name, names):
        if name in weights.files:
            return name
    raise ConfigError(f"config key model.args.path: {weights.path} holds no tensor {names[0]!r} "
                      f"({len(weights.files)} tensors there); the folder is not this model's weights")


def load_pretrained(module: torch.nn.Module, device: torch.device) -> int:
    """Fill ``module``'s parameters (and the persistent buffers the files hold) from its pending weights.
    Returns the bytes this rank read."""
    weights = pending_weights(module)
    if weights is None:
        return 0
    buffers = {name: b for name, b in module.named_buffers()}
    aliases: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    module.to_empty(device=device)
    for name, b in buffers.items():  # as the model computed them when it was made
        owner, _, leaf = name.rpartition(".")
        module.get_submodule(owner)._buffers[leaf] = b.to(device)
    read = 0
    names_of = {name: names for names in aliases.values() for name in names}
    adapters = getattr(module, "ray_app_adapters", {})  # LoRA's initial values (ray_app.worker.lora)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name in adapters:
                rows = local_rows(p)
                _fill(p, adapters[name] if rows is None else adapters[name][rows])
                continue
            src = _source_name(weights, names_of[name])
            read += weights.read_into(src, _local(p), local_rows(p))
        for name, b in module.named_buffers():
            if file_name(name) in weights.files:
                read += weights.read_into(file_name(name), b)
    _tie_again(module, aliases)
    del module.ray_app_weights
    if adapters:
        del module.ray_app_adapters
    return read


def _local(target: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``target`` (a DTensor's local tensor, which shares its storage), or ``target``."""
    return target.to_local() if hasattr(target, "to_local") else target


def _fill(target: torch.Tensor, value: torch.Tensor) -> None:
    _local(target).copy_(value)


def _tie_again(module: torch.nn.Module, aliases: dict[int, list[str]]) -> None:
    """``to_empty`` makes a new parameter for each module that held a shared one: share the first again."""
    for names in aliases.values():
        if len(names) < 2:
            continue
        first = module.get_parameter(names[0])
        for name in names[1:]:
            owner, _, leaf = name.rpartition(".")
            sub = module.get_submodule(owner)
            if sub._parameters[leaf] is not first:
                sub._parameters[leaf] = first
