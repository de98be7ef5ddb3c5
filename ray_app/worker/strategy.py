"""How the model is spread over the workers (``train.strategy``): DDP (the default: every rank holds the whole
model, gradients all-reduced) or FSDP2 (``fully_shard``: parameters, gradients and optimizer state sharded
over the ranks, gathered unit by unit for forward and backward), over one group of all ranks or, with
``train.replicate``, HSDP's replica groups (sharded within a group, replicated across: ``ray_app.worker.mesh``).

The loop and the checkpoints see one model either way; what differs lives here: wrapping, skipping the
gradient sync on non-final micro-steps, and moving state in and out. State goes through
``torch.distributed.checkpoint.state_dict`` (``get_state_dict``/``set_state_dict``): keyed by the user's
parameter names under both strategies (DDP's ``module.`` prefix gone), so a checkpoint of one loads into
the other, at any world size (``ray_app.worker.checkpoint``'s sharded format).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from ray_app.shared.errors import ConfigError
from ray_app.worker.lora import is_lora

FULL = StateDictOptions(full_state_dict=True)


def shard_units(module: torch.nn.Module, names: str) -> list[torch.nn.Module]:
    """The sub-modules FSDP shards as units, innermost first (``fully_shard`` must reach a unit before any
    unit around it): those of the classes named in ``train.fsdp_units``, else each block of the model's
    outermost ModuleLists and one-class ModuleDicts (a transformer's layers; a ModuleList inside a block, such
    as a mixture's experts, stays in its block's unit), else each top-level child with parameters.

    A parameter lives in one unit: a default unit whose parameter is tied to one outside it (an embedding
    and its head) is left in the unit around both; a named one is a ConfigError naming the two."""
    units = _of_classes(module, names)
    if units:
        tied_outside = _tie_finder(module)
        for unit in units:
            tie = tied_outside(unit)
            if tie:
                raise ConfigError(f"train.fsdp_units={names}: {tie[0]} is tied to {tie[1]}, outside its unit "
                                  f"({type(unit).__name__}); a parameter lives in one unit: name classes that hold "
                                  f"both, or leave {type(unit).__name__} out (it then stays in the unit around it)")
        return units[::-1]  # modules() lists a module before the modules inside it
    units = _outermost_blocks(module) or [c for c in module.children() if _has_parameters(c)]
    tied_outside = _tie_finder(module)
    return [u for u in units if not tied_outside(u)]


def blocks(module: torch.nn.Module, names: str, switch: str) -> list[torch.nn.Module]:
    """The model's blocks, for a switch applied block by block (``switch``, e.g. ``train.compile=true``): the
    modules of the classes named in ``train.fsdp_units`` (the outermost of them, where one holds another), else
    each block of the model's outermost ModuleLists and one-class ModuleDicts, as ``shard_units`` finds its
    units; a model with neither is a ConfigError naming what was searched."""
    named = _of_classes(module, names)  # outermost first
    if named:
        inside = {id(m) for unit in named for m in unit.modules() if m is not unit}
        return [u for u in named if id(u) not in inside]
    found = _outermost_blocks(module)
    if not found:
        raise ConfigError(f"{switch}: the model ({type(module).__name__}) has no blocks to apply it to: no "
                          "ModuleList or one-class ModuleDict of blocks in it; name its block classes in "
                          "train.fsdp_units (e.g. train.fsdp_units=Block)")
    return found


def _of_classes(module: torch.nn.Module, names: str) -> list[torch.nn.Module]:
    """The sub-modules of the classes named in ``train.fsdp_units`` (comma-separated), outermost first; none
    named: []; named and none found: a ConfigError listing the model's classes."""
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    if not wanted:
        return []
    found = [m for m in module.modules() if m is not module and type(m).__name__ in wanted]
    if not found:
        classes = sorted({type(m).__name__ for m in module.modules() if m is not module})
        raise ConfigError(f"train.fsdp_units={names}: no module of the model is of these classes; "
                          f"its classes: {', '.join(classes[:12])}")
    return found


def _tie_finder(module: torch.nn.Module):
    """``tied_outside(unit)``: (a parameter's name in ``unit``, the name of the same tensor outside ``unit``), or
    None. The model's names are read once."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    prefixes = {id(m): name + "." for name, m in module.named_modules(remove_duplicate=False)}

    def tied_outside(unit: torch.nn.Module) -> tuple[str, str] | None:
        prefix = prefixes[id(unit)]
        for p in unit.parameters():
            inside = [n for n in names[id(p)] if n.startswith(prefix)]
            outside = [n for n in names[id(p)] if not n.startswith(prefix)]
            if outside:
                return inside[0], outside[0]
        return None

    return tied_outside


def _has_parameters(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters())


_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)


def _outermost_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    blocks = []
    for child in module.children():
        blocks += _blocks_in(child) if _is_stack(child) else _outermost_blocks(child)
    return blocks


def _is_stack(module: torch.nn.Module) -> bool:
    """A ModuleList, or a ModuleDict of one class of blocks (torchtitan's ``layers``). A ModuleDict of several
    classes is a namespace (nanoGPT's ``transformer``: embeddings, a ModuleList of blocks, a norm), searched
    further: its embedding may be tied to a head outside it, and must stay in the unit around both."""
    if isinstance(module, torch.nn.ModuleDict):
        return len({type(b) for b in module.values() if _has_parameters(b)}) == 1
    return isinstance(module, torch.nn.ModuleList)


def _blocks_in(container: torch.nn.Module) -> list[torch.nn.Module]:
    """A container's items with parameters; an item that is itself a container (a list of lists) is
    opened, since a container has no forward for FSDP to gather around."""
    blocks = []
    for item in container.children():
        if isinstance(item, _CONTAINERS):
            blocks += _blocks_in(item)
        elif _has_parameters(item):
            blocks.append(item)
    return blocks


def fully_shard_model(module: torch.nn.Module, device: torch.device, world_size: int, *, units: str = "",
                      reshard_after_forward: bool = True, bf16: bool = False, mesh=None) -> torch.nn.Module:
    """FSDP2 over ``mesh`` (``ray_app.worker.mesh.device_mesh``: 1-D, every rank a shard; 2-D, HSDP), by default
    all ranks on one dimension: each unit sharded, then the root. ``bf16`` (``train.precision=bf16-mixed``): fp32
    parameters gathered in bf16, gradients reduced in fp32, and the root's outputs cast to fp32, so that the task's
    loss, outside the model, computes in fp32 whatever it does (an MSE against fp32 targets, a cross-entropy of the
    logits)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    shards = shard_units(module, units)
    check_shardable(module, shards, units)
    mesh = mesh if mesh is not None else init_device_mesh(device.type, (world_size,))
    kwargs = root_kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if bf16:
        kwargs = dict(kwargs, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        root_kwargs = dict(kwargs, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                  reduce_dtype=torch.float32,
                                                                  output_dtype=torch.float32))
    scalars = {p for p in module.parameters() if p.dim() == 0}
    for unit in [*shards, module]:
        ignored = {p for p in unit.parameters() if p in scalars}
        fully_shard(unit, **(root_kwargs if unit is module else kwargs), **({"ignored_params": ignored} if ignored else {}))
    if world_size > 1:
        RankZeroBuffers.attach(module)
        ReplicatedScalars.attach(module, scalars)
    return module


class ReplicatedScalars:
    """Scalar (0-d) parameters, such as a learned temperature, under FSDP, which shards every parameter along
    its first dimension and so cannot take them: every rank holds them whole, as DDP does, and their gradients
    are averaged over the ranks when FSDP reduces the others' (a backward outside ``no_sync``), each as it is
    accumulated. Their norm counts once in the global one (``grad_norm``); a checkpoint writes them once. Under
    HSDP too the average is over every rank: each rank's batch is its own, whatever group it shards in."""

    def __init__(self):
        self.sync = True  # False inside no_sync (a non-final accumulation micro-step)
        self.world = dist.get_world_size()

    @classmethod
    def attach(cls, module: torch.nn.Module, scalars: set) -> None:
        if not scalars:
            return
        state = module._ray_app_scalars = cls()
        for p in scalars:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(state._average)

    @torch.no_grad()
    def _average(self, p: torch.Tensor) -> None:
        if self.sync:
            dist.all_reduce(p.grad)  # every rank, in the same order: autograd's, the same graph on each
            p.grad.div_(self.world)


class RankZeroBuffers:
    """DDP's ``broadcast_buffers`` under FSDP, which syncs no buffer: before a forward that follows a forward in
    training mode (BatchNorm's running statistics moved on every rank, each by its own batch), rank 0's
    persistent buffers (those a checkpoint holds) are broadcast to every rank. Rank 0's buffers are then the
    only ones that carry over, as under DDP: a checkpoint holds them whichever rank writes them
    (``sync``, before a save), a resume continues them exactly, and every rank evaluates with them."""

    def __init__(self, module: torch.nn.Module):
        names = set(module.state_dict(keep_vars=True))  # what a checkpoint holds (buffers stay plain tensors)
        self.buffers = [b for n, b in module.named_buffers() if n in names]
        self.groups: dict[tuple, list[torch.Tensor]] = {}  # one broadcast per (dtype, device)
        for b in self.buffers:
            self.groups.setdefault((b.dtype, b.device), []).append(b)
        self.pending = True  # the first forward syncs (a resume loads the same copy everywhere: a no-op then)

    @classmethod
    def attach(cls, module: torch.nn.Module) -> None:
        sync = cls(module)
        if sync.buffers:
            module._ray_app_buffers = sync
            module.register_forward_pre_hook(sync._before_forward)

    def _before_forward(self, module, args) -> None:
        if self.pending:
            self.sync()
        self.pending = module.training

    @torch.no_grad()
    def sync(self) -> None:
        """Every rank at the same point (one broadcast per dtype): rank 0's buffers everywhere."""
        for group in self.groups.values():
            flat = torch.cat([b.reshape(-1) for b in group])
            dist.broadcast(flat, src=0)
            for b, value in zip(group, flat.split([b.numel() for b in group])):
                b.copy_(value.view_as(b))


def sync_buffers(model: torch.nn.Module) -> None:
    """Before a checkpoint (every rank): rank 0's buffers everywhere. A checkpoint deals the tensors every rank
    holds to the ranks to write (``sharded.own_share``); each rank's BatchNorm statistics moved by its own batch
    since the last forward's broadcast (DDP's, or RankZeroBuffers' under FSDP), and only rank 0's carry on."""
    sync = getattr(model, "_ray_app_buffers", None)
    if sync is None and isinstance(model, torch.nn.parallel.DistributedDataParallel) and dist.get_world_size() > 1:
        sync = RankZeroBuffers(model.module)
    if sync is not None and sync.buffers:
        sync.sync()


def check_shardable(module: torch.nn.Module, units: list[torch.nn.Module], names: str = "") -> None:
    """What ``fully_shard`` refuses in a model, as a ConfigError naming the parameter and the fix, before any
    module is changed: a unit whose parameters are not all of one dtype (a unit is gathered as one flat
    buffer). ``units`` innermost first, as ``shard_units`` gives them; the root's unit holds the rest. Scalar
    parameters, which FSDP cannot shard, are left out of every unit (ReplicatedScalars)."""
    pname = {id(p): n for n, p in module.named_parameters()}
    mname = {id(m): n for n, m in module.named_modules()}
    claimed: set[int] = {id(p) for p in module.parameters() if p.dim() == 0}  # replicated (ReplicatedScalars)
    for unit in [*units, module]:
        mine = [p for p in unit.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in mine)
        dtypes = {p.dtype for p in mine}
        if len(dtypes) > 1:
            where = f"the unit {mname[id(unit)]} ({type(unit).__name__})" if unit is not module \
                else f"the root's unit ({type(unit).__name__}: what no unit holds)"
            first = {}
            for p in mine:
                first.setdefault(p.dtype, pname[id(p)])
            kinds = ", ".join(f"{first[d]} is {str(d).replace('torch.', '')}" for d in sorted(first, key=str))
            raise ConfigError(f"train.strategy=fsdp: {where} holds parameters of {len(dtypes)} dtypes ({kinds}) "
                              f"and FSDP gathers a unit in one: give them one dtype, or make the module holding "
                              f"the other dtype a unit of its own (train.fsdp_units={names + ',' if names else ''}"
                              f"<its class>)")


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` is an FSDP2 model (its parameters are DTensors)."""
    return hasattr(model, "set_requires_gradient_sync")


def no_sync(model: torch.nn.Module):
    """A context in which backward accumulates gradients locally (non-final gradient-accumulation micro-steps):
    DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``; a plain module has nothing to skip."""
    if hasattr(model, "no_sync"):
        return model.no_sync()
    if is_sharded(model):
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    scalars = getattr(model, "_ray_app_scalars", None)
    if scalars is not None:
        scalars.sync = False
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        if scalars is not None:
            scalars.sync = True


def grad_norm(model: torch.nn.Module, max_norm: float = 0.0) -> torch.Tensor:
    """The global L2 norm of the model's gradients as a plain tensor, the same on every rank; with ``max_norm``
    the gradients are scaled down to it first (``clip_grad_norm_``'s rule). DDP: every rank holds the whole,
    all-reduced gradients, so the norm is local. FSDP: each rank sums the squares of its own shards and one
    ``all_reduce`` of one number over the shard group adds them (the DTensor route of ``clip_grad_norm_``
    redistributes every parameter's norm on its own: a collective per parameter, every step). Under HSDP each
    replica group holds the same reduced gradients, so the sum over its own shards is the whole norm."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    sharded = [g for g in grads if _shard_dim(g) is not None]
    whole = [g for g in grads if not hasattr(g, "to_local")]  # ReplicatedScalars': the same on every rank
    groups = {(id(g.device_mesh), _shard_dim(g)) for g in sharded}
    if not is_sharded(model) or len(sharded) + len(whole) != len(grads) or len(groups) > 1:
        if max_norm:
            return full_value(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        return full_value(torch.nn.utils.get_total_norm(grads))
    local = [g.to_local() for g in sharded]
    square = torch.nn.utils.get_total_norm(local).to(torch.float32) ** 2 if local else torch.zeros(())
    group = sharded[0].device_mesh.get_group(_shard_dim(sharded[0])) if sharded else None
    dist.all_reduce(square, group=group)  # sync point: all ranks (each in its shard group)
    if whole:  # counted once, after the sum over the ranks' shards
        square = square + torch.nn.utils.get_total_norm(whole).to(torch.float32) ** 2
    norm = square.sqrt()
    if max_norm and (local or whole):  # clip_grad_norm_'s rule, on each rank's shards (views of the gradients)
        torch._foreach_mul_(local + whole, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def _shard_dim(t) -> int | None:
    """The one mesh dimension a DTensor is sharded over, replicated over any other (FSDP's: ``Shard`` on its
    1-D mesh, ``(Replicate, Shard)`` on HSDP's 2-D one): each element on one rank of that dimension's group,
    its square counted once there. None for anything else."""
    if not hasattr(t, "to_local"):
        return None
    dims = [i for i, p in enumerate(t.placements) if p.is_shard()]
    rest = all(p.is_shard() or p.is_replicate() for p in t.placements)
    return dims[0] if len(dims) == 1 and rest else None


def full_value(t):
    """A DTensor (a sharded model's norm, a shard) as a plain tensor; a tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _options(model: torch.nn.Module, full: bool = False) -> StateDictOptions:
    """A LoRA model's state is its adapters only (the frozen base comes from its files at every start)."""
    lora = is_lora(model)
    return StateDictOptions(full_state_dict=full, ignore_frozen_params=lora, strict=not lora)


def train_state(model: torch.nn.Module, optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state keyed by parameter name: each rank's shards (DTensors) under FSDP, the whole
    (replicated) state under DDP. What the sharded checkpoint writes, and the template it loads into. With
    ``model.lora``, the adapters only."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
    return _trainable_only(model, model_sd), optim_sd


def model_state(model: torch.nn.Module) -> dict:
    return _trainable_only(model, get_model_state_dict(model, options=_options(model)))


def _trainable_only(model: torch.nn.Module, model_sd: dict) -> dict:
    """A LoRA model's state without a frozen tensor ``ignore_frozen_params`` keeps (a tied head's alias)."""
    if not is_lora(model):
        return model_sd
    module = getattr(model, "module", model)
    trainable = {n for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {k: v for k, v in model_sd.items() if k in trainable}


def load_train_state(model: torch.nn.Module, optimizer, model_sd: dict, optim_sd: dict) -> None:
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=_options(model))


def load_model_state(model: torch.nn.Module, model_sd: dict, *, full: bool = False) -> None:
    """``model_sd``: this rank's shards (as ``model_state`` gives), or with ``full`` the whole unsharded state
    (a single-file checkpoint, an export) that each rank cuts its shard from."""
    set_model_state_dict(model, model_sd, options=_options(model, full))


def load_full_optimizer_state(model: torch.nn.Module, optimizer, optim_sd: dict) -> None:
    """A single-file checkpoint's optimizer state (``optimizer.state_dict()``: keyed by parameter index) into
    a sharded model's optimizer: re-keyed by parameter name, each rank cutting its shard."""
    names = [n for n, p in model.named_parameters() if p.requires_grad or not is_lora(model)]  # the optimizer's
    live = [set(g) for g in optimizer.param_groups]  # a group's keys the live optimizer lacks (a scheduler's) stay out

    def group(i: int, g: dict) -> dict:
        return {k: v for k, v in g.items() if k in live[i]} | {"params": [names[p] for p in g["params"]]}

    by_name = {"state": {names[i]: s for i, s in optim_sd["state"].items()},
               "param_groups": [group(i, g) for i, g in enumerate(optim_sd["param_groups"])]}
    set_optimizer_state_dict(model, optimizer, by_name, options=FULL)
