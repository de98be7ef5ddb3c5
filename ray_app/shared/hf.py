"""Hugging Face models in: ``model.name: hf``, ``model.args: {path, dtype, trust_remote_code}``.

``path`` is a folder or an ``s3://`` prefix holding ``config.json`` and the weights as safetensors: one
``model.safetensors``, or shards named by ``model.safetensors.index.json`` (what ``save_pretrained`` writes).
No hub is ever contacted: the config is read through the kit's storage and the model is made from it.

The life of the weights, so that no rank ever holds the whole model under FSDP:

1. ``pretrained`` (the model plug-in, on every worker) builds the model from its config with every
   parameter on the meta device (no memory) and every buffer real, computed as transformers computes it
   (rotary tables, the non-persistent buffers a checkpoint does not hold). The model carries its
   ``PretrainedWeights``.
2. The strategy shards it (FSDP) or leaves it whole (DDP); ``ray_app.worker.pretrained`` then gives each rank
   storage for the parameters it holds and reads into it only those tensors, or rows of tensors, from the
   safetensors files: by byte range, from a local file or from S3 (a ranged GET), never a whole file copied,
   the bytes going straight into the parameter's storage (no copy of a tensor held beside it). Tied weights
   stay tied.

``check_pretrained`` runs before Ray starts (the driver): a path without ``config.json``, a shard the index
names that is missing, an unknown ``dtype`` and a config that needs remote code without
``trust_remote_code: true`` are each one line, exit 2. transformers is imported only by a run that uses it.
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
from dataclasses import dataclass, field

from ray_app.shared.errors import ConfigError

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = ("float32", "bfloat16", "float16")
KEY = "model.args.path"
READ_PIECE = 32 << 20  # bytes of a tensor one ranged read fetches (a GET on S3) at most


def _storage(path: str, retry_s: float):
    from ray_app.shared.storage import open_storage

    return open_storage(path.rstrip("/"), retry_s=retry_s)


def read_config(path: str, retry_s: float = 0.0) -> dict:
    """``config.json`` under ``path`` as a dict (ConfigError naming the key when there is none)."""
    storage = _storage(path, retry_s)
    if CONFIG not in storage.list_files(""):
        raise ConfigError(f"config key {KEY}: {path} has no {CONFIG}; point it at a folder (or s3:// prefix) "
                          "written by save_pretrained, holding config.json and *.safetensors")
    try:
        return json.loads(storage.read_bytes(CONFIG))
    except ValueError as exc:
        raise ConfigError(f"config key {KEY}: {path}/{CONFIG} is not JSON ({exc})") from None


def weight_files(path: str, retry_s: float = 0.0) -> dict[str, str]:
    """Each tensor's name -> the safetensors file that holds it (ConfigError for a missing file)."""
    storage = _storage(path, retry_s)
    files = storage.list_files("")
    if INDEX in files:
        try:
            weight_map = json.loads(storage.read_bytes(INDEX))["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ConfigError(f"config key {KEY}: {path}/{INDEX} has no readable weight_map ({exc})") from None
        missing = sorted({f for f in weight_map.values() if f not in files})
        if missing:
            raise ConfigError(f"config key {KEY}: {path}/{INDEX} names {missing[0]}, which is not in {path}"
                              f"{f' ({len(missing)} files missing)' if len(missing) > 1 else ''}; copy every "
                              "shard the index names beside it")
        return dict(weight_map)
    if SINGLE in files:
        return {name: SINGLE for name in read_header(storage, SINGLE)}
    raise ConfigError(f"config key {KEY}: {path} has neither {SINGLE} nor {INDEX}; save the model with "
                      "save_pretrained (safetensors), not as a .bin or .pt")


def check_pretrained(args: dict, retry_s: float = 0.0) -> dict:
    """What the driver checks before Ray starts; returns the config."""
    return inspect_pretrained(args, retry_s)[0]


def inspect_pretrained(args: dict, retry_s: float = 0.0) -> tuple[dict, dict[str, str]]:
    """The checks of ``check_pretrained``; returns the config and each tensor's file (read once)."""
    path = args.get("path")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"config key {KEY}: model.name hf needs the folder or s3:// prefix of a "
                          "save_pretrained model, e.g. --set model.args.path=s3://bucket/models/llama")
    dtype = args.get("dtype", "float32")
    if dtype not in DTYPES:
        raise ConfigError(f"config key model.args.dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    config = read_config(path, retry_s)
    if config.get("auto_map") and not args.get("trust_remote_code", False):
        raise ConfigError(f"config key model.args.trust_remote_code: {path}/{CONFIG} needs the model's own code "
                          f"({', '.join(sorted(config['auto_map']))}); the kit runs none unless "
                          "model.args.trust_remote_code=true, and only code inside that folder")
    return config, weight_files(path, retry_s)


# ---------------------------------------------------------------- safetensors read by range

def read_header(storage, rel: str) -> dict[str, dict]:
    """A safetensors file's header: each tensor's dtype, shape and byte offsets from the data's start
    (plus ``__data_start__``: where the data starts in the file). Two ranged reads."""
    (size,) = struct.unpack("<Q", storage.read_range(rel, 0, 8))
    header = json.loads(storage.read_range(rel, 8, size))
    header.pop("__metadata__", None)
    for entry in header.values():
        entry["__data_start__"] = 8 + size
    return header


@dataclass
class PretrainedWeights:
    """Where a model's weights are and how to read a piece of one: ``read_into(name, out, rows)`` fills ``out``
    with the tensor ``name`` (rows ``rows.start:rows.stop`` of its first dimension, or all of it)."""

    path: str
    retry_s: float = 0.0
    files: dict[str, str] = field(default_factory=dict)  # each tensor's file; empty: read from the index
    headers: dict[str, dict] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.storage = _storage(self.path, self.retry_s)
        if not self.files:
            self.files = weight_files(self.path, self.retry_s)

    def header(self, name: str) -> dict:
        rel = self.files[name]
        if rel not in self.headers:
            self.headers[rel] = read_header(self.storage, rel)
        return self.headers[rel][name]

    def shape(self, name: str) -> list[int]:
        return list(self.header(name)["shape"])

    def read_into(self, name: str, out, rows: slice | None = None) -> int:
        """Fill ``out`` with the tensor ``name`` (rows ``rows.start:rows.stop`` of its first dimension, or all of
        it), converted to ``out``'s dtype; returns the bytes read. The bytes go by ranged reads of at most
        ``READ_PIECE`` straight into ``out``'s storage: a rank holds no copy of what it reads (a 500 MB
        embedding's rows would otherwise be held twice); only one piece on the host when ``out`` is of another
        dtype than the file's or on a GPU."""
        import torch

        entry = self.header(name)
        shape, dtype = list(entry["shape"]), torch_dtype(entry["dtype"])
        itemsize = torch.empty((), dtype=dtype).element_size()
        start = entry["__data_start__"] + entry["data_offsets"][0]
        if rows is not None and shape:
            start += rows.start * itemsize * math.prod(shape[1:])
            shape[0] = rows.stop - rows.start
        if tuple(out.shape) != tuple(shape):
            raise ConfigError(f"config key {KEY}: a tensor of shape {tuple(shape)} where the model has "
                              f"{tuple(out.shape)}; the weights are not this config's")
        whole = out.detach()
        flat = whole.view(-1) if whole.is_contiguous() else torch.empty(shape, dtype=out.dtype, device=out.device).view(-1)
        per_piece = max(1, READ_PIECE // itemsize)
        direct = flat.dtype == dtype and flat.device.type == "cpu"  # else through a piece on the host
        staging = None if direct else torch.empty(min(per_piece, flat.numel()), dtype=dtype)
        for at in range(0, flat.numel(), per_piece):
            count = min(per_piece, flat.numel() - at)
            into = flat[at:at + count] if staging is None else staging[:count]
            got = self.storage.read_range_into(self.files[name], start + at * itemsize, into.view(torch.uint8).numpy())
            if got != count * itemsize:
                raise ConfigError(f"config key {KEY}: {self.path}/{self.files[name]} ends inside tensor {name!r}; "
                                  "the file is cut short: copy it again from where save_pretrained wrote it")
            if staging is not None:
                flat[at:at + count].copy_(into)
        if not whole.is_contiguous():  # read into a contiguous stand-in above
            whole.copy_(flat.view(shape))
        return flat.numel() * itemsize


def torch_dtype(name: str):
    """safetensors' name of a dtype (``F32``, ``BF16``, ...) -> torch's."""
    import torch

    return {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
            "BOOL": torch.bool}[name]


# ---------------------------------------------------------------- the model plug-in

def pretrained(path: str, dtype: str = "float32", trust_remote_code: bool = False, retry_s: float = 60.0):
    """``model.name: hf``: the model of ``path`` made from its config, parameters on the meta device and
    buffers real; ``ray_app.worker.pretrained`` fills the parameters each rank holds after sharding."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    args = {"path": path, "dtype": dtype, "trust_remote_code": trust_remote_code}
    hf_config, files = inspect_pretrained(args, retry_s)
    storage = _storage(path, retry_s)
    with tempfile.TemporaryDirectory(prefix="ray-app-hf-config-") as folder:
        with open(os.path.join(folder, CONFIG), "w") as f:
            json.dump(hf_config, f)
        for name in [f for f in storage.list_files("") if f.endswith(".py")] if trust_remote_code else []:
            with open(os.path.join(folder, name), "wb") as f:  # trusted: the model's own code, never weights
                f.write(storage.read_bytes(name))
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code, local_files_only=True)
        with parameters_on_meta():
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype),
                                                     trust_remote_code=trust_remote_code)
    model.ray_app_weights = PretrainedWeights(path, retry_s, files)
    return model


class parameters_on_meta:
    """Within it, every ``nn.Parameter`` a module registers is made on the meta device; buffers are made as
    the module makes them (accelerate's ``init_empty_weights(include_buffers=False)`` does the same)."""

    def __enter__(self):
        import torch

        self._register = torch.nn.Module.register_parameter
        register = self._register

        def on_meta(module, name, param):
            if param is not None and param.device.type != "meta":
                param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            register(module, name, param)

        torch.nn.Module.register_parameter = on_meta
        # the big ones (linear layers, embeddings) hold parameters only: made on meta at once, never
        # allocated and initialized on the CPU first
        self._inits = {cls: cls.__init__ for cls in (torch.nn.Linear, torch.nn.Embedding)}
        for cls, init in self._inits.items():
            def on_meta_init(module, *args, _init=init, **kwargs):
                with torch.device("meta"):
                    _init(module, *args, **kwargs)
            cls.__init__ = on_meta_init
        return self

    def __exit__(self, *exc):
        import torch

        torch.nn.Module.register_parameter = self._register
        for cls, init in self._inits.items():
            cls.__init__ = init
        return False
