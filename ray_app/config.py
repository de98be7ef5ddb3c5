"""Typed run configuration: dataclass sections, YAML files, ``--set`` overrides.

Every field has a docstring-style ``help`` and, where it matters, allowed
values. ``load_config`` validates the whole tree once, before anything starts;
any problem raises :class:`ConfigError` whose message names the key and the
fix (the CLI turns it into one line on stderr and exit code 2).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """Bad input a user can fix: the message names the key and the fix."""


def _f(default, help: str, choices=None, min=None, max=None, nullable=False):
    """A config field with its help text and bounds kept in metadata."""
    meta = {"help": help, "choices": choices, "min": min, "max": max, "nullable": nullable}
    return field(default=default, metadata=meta)


@dataclass
class RunSection:
    name: str = _f("digits-ddp", "Run name: checkpoints live under {storage}/{name}/; the same name resumes.")
    seed: int = _f(0, "Seed for model init, data order and every rank's RNG.", min=0)
    storage: str = _f("./runs", "Where runs live: a local folder or s3://bucket/prefix.")
    resume_from: str = _f("", "Warm-start from this checkpoint URI when the run has no checkpoint of its own.")


@dataclass
class DataSection:
    name: str = _f("digits", "Data set.", choices=["digits", "synthetic", "cifar10", "imagefolder"])
    path: str = _f("", "Folder with the data for cifar10 (cifar-10-batches-py inside) or imagefolder (train/ and val/ inside).")
    batch_size: int = _f(32, "Per-worker batch size (global batch = batch_size * num_workers * grad_accum).", min=1)
    loader_workers: int = _f(0, "DataLoader worker processes per training worker.", min=0, max=64)
    num_samples: int = _f(2048, "synthetic only: number of training samples (eval gets a quarter).", min=1)
    image_size: int = _f(32, "synthetic and imagefolder: image side in pixels.", min=4, max=1024)


@dataclass
class ModelSection:
    name: str = _f("digits_cnn", "Model: digits_cnn, mlp, wide_mlp, or a torchvision classifier (resnet18, ...), random init.")


@dataclass
class TrainSection:
    epochs: int = _f(10, "Number of epochs.", min=1)
    lr: float = _f(0.05, "Peak learning rate (after warmup).", min=0.0)
    optimizer: str = _f("sgd", "Optimizer.", choices=["sgd", "adamw"])
    weight_decay: float = _f(0.0, "Weight decay.", min=0.0)
    momentum: float = _f(0.9, "SGD momentum.", min=0.0, max=1.0)
    warmup_epochs: float = _f(0.0, "Linear warmup length in epochs, then cosine decay to zero.", min=0.0)
    grad_accum: int = _f(1, "Micro-batches per optimizer step; DDP all-reduces only on the last one.", min=1)
    clip_grad_norm: float = _f(0.0, "Clip the global gradient norm to this value (0 = off).", min=0.0)
    amp: bool = _f(False, "bf16 autocast on CUDA (ignored on CPU).")
    log_every_steps: int = _f(20, "Optimizer steps between progress lines and metric updates.", min=1)
    bucket_cap_mb: int = _f(25, "DDP gradient bucket size in MB.", min=1)
    max_steps: int = _f(0, "Stop after this many optimizer steps in total (0 = run all epochs); the LR schedule still spans all epochs.", min=0)


@dataclass
class CheckpointSection:
    every_epochs: int = _f(1, "Checkpoint every N epochs (0 = never at epoch ends).", min=0)
    every_steps: int = _f(0, "Also checkpoint every N optimizer steps, mid-epoch included (0 = off).", min=0)
    keep: int = _f(3, "Newest committed checkpoints kept (older ones deleted).", min=1)
    upload: str = _f("sync", "sync blocks training while the checkpoint is written and uploaded; "
                     "async copies the state and writes + uploads it in the background.", choices=["sync", "async"])


@dataclass
class ScalingSection:
    num_workers: int = _f(2, "Training workers (one per GPU, or CPU slot).", min=1)
    use_gpu: bool = _f(False, "Train on GPUs with NCCL (else CPU with Gloo).")
    cpus_per_worker: float = _f(1.0, "CPUs reserved per worker.", min=0.0)
    gpus_per_worker: float = _f(1.0, "GPUs reserved per worker when use_gpu is true.", min=0.0)


@dataclass
class FailureSection:
    max_failures: int = _f(3, "Worker-group restarts after failures (-1 = unlimited).", min=-1)


@dataclass
class MetricsSection:
    enabled: bool = _f(True, "Rank 0 serves Prometheus metrics.")
    port: int = _f(9500, "Port of rank 0's /metrics endpoint.", min=1, max=65535)


@dataclass
class Config:
    run: RunSection = field(default_factory=RunSection)
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    scaling: ScalingSection = field(default_factory=ScalingSection)
    failure: FailureSection = field(default_factory=FailureSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def _section_class(name: str):
    return {f.name: f.default_factory for f in dataclasses.fields(Config)}[name]


def _type_name(t) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[t]


def _coerce(key: str, value: Any, fld: dataclasses.Field) -> Any:
    """Check one value against its field's type and bounds; return it typed."""
    t = {"int": int, "float": float, "bool": bool, "str": str}.get(fld.type, fld.type)
    meta = fld.metadata
    ok = (
        (t is bool and isinstance(value, bool))
        or (t is int and isinstance(value, int) and not isinstance(value, bool))
        or (t is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (t is str and isinstance(value, str))
    )
    if t is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        value, ok = str(value), True
    if t is float and isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
        try:
            value, ok = float(value), True
        except ValueError:
            pass
    if t is float and ok and not math.isfinite(value):
        raise ConfigError(f"config key {key}: expected a finite number, got {value!r}")
    if not ok:
        raise ConfigError(f"config key {key}: expected {_type_name(t)}, got {value!r}")
    if t is float:
        value = float(value)
    if meta.get("choices") and value not in meta["choices"]:
        raise ConfigError(f"config key {key}: {value!r} is not allowed; use one of {', '.join(meta['choices'])}")
    if meta.get("min") is not None and value < meta["min"]:
        raise ConfigError(f"config key {key}: {value!r} is below the minimum {meta['min']}")
    if meta.get("max") is not None and value > meta["max"]:
        raise ConfigError(f"config key {key}: {value!r} is above the maximum {meta['max']}")
    return value


def _apply(cfg: Config, tree: dict, origin: str) -> None:
    if not isinstance(tree, dict):
        raise ConfigError(f"{origin}: expected a mapping of sections ({', '.join(SECTIONS)})")
    for section, values in tree.items():
        if section not in SECTIONS:
            raise ConfigError(f"{origin}: unknown config section {section!r}; known: {', '.join(SECTIONS)}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{origin}: section {section} must be a mapping of keys")
        obj = getattr(cfg, section)
        fields = {f.name: f for f in dataclasses.fields(obj)}
        for key, value in values.items():
            if key not in fields:
                raise ConfigError(
                    f"{origin}: unknown config key {section}.{key}; known keys in {section}: {', '.join(fields)}"
                )
            setattr(obj, key, _coerce(f"{section}.{key}", value, fields[key]))


def _field(section: str, key: str) -> dataclasses.Field | None:
    if section not in SECTIONS:
        return None
    return {f.name: f for f in dataclasses.fields(_section_class(section)())}.get(key)


def parse_override(text: str) -> dict:
    """``a.b=value`` -> ``{"a": {"b": value}}``, value parsed as a YAML scalar."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, for example --set train.epochs=5")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set {text!r}: KEY must be section.key, for example train.epochs")
    fld = _field(parts[0], parts[1])
    if fld is not None and fld.type == "str":
        return {parts[0]: {parts[1]: raw.strip()}}  # taken as written: run.name=007 stays "007"
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if value is None:
        value = ""
    return {parts[0]: {parts[1]: value}}


def _check_cross_field(cfg: Config) -> None:
    if not _RUN_NAME.match(cfg.run.name):
        raise ConfigError(
            f"config key run.name: {cfg.run.name!r} is not a valid run name; use letters, digits, '.', '_' or '-'"
        )
    storage = cfg.run.storage
    if storage.startswith("s3://"):
        if not storage[len("s3://"):].split("/")[0]:
            raise ConfigError("config key run.storage: s3:// URI has no bucket; use s3://bucket/prefix")
    elif "://" in storage:
        raise ConfigError(f"config key run.storage: {storage!r} is not supported; use a local folder or s3://bucket/prefix")
    if cfg.data.name in ("cifar10", "imagefolder") and not cfg.data.path:
        raise ConfigError(f"config key data.path: data.name={cfg.data.name} needs data.path set to the data folder")
    if cfg.checkpoint.every_epochs == 0 and cfg.checkpoint.every_steps == 0:
        pass  # allowed: no checkpoints, the summary says so
    if cfg.scaling.use_gpu and cfg.scaling.gpus_per_worker <= 0:
        raise ConfigError("config key scaling.gpus_per_worker: must be > 0 when scaling.use_gpu is true")


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file <- ``--set`` overrides, validated once."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config {path}: no such file; pass an existing YAML file (see configs/)")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            raise ConfigError(f"--config {path}:{where} is not valid YAML; fix the syntax") from None
        _apply(cfg, tree, str(path))
    for text in overrides or []:
        _apply(cfg, parse_override(text), f"--set {text}")
    _check_cross_field(cfg)
    _absolute_local_paths(cfg)
    return cfg


def _is_local(path: str) -> bool:
    return bool(path) and "://" not in path


def _absolute_local_paths(cfg: Config) -> None:
    """Local paths are relative to where the user ran the command, not to a Ray worker's cwd."""
    for section, key in (("run", "storage"), ("run", "resume_from"), ("data", "path")):
        obj = getattr(cfg, section)
        value = getattr(obj, key)
        if _is_local(value):
            setattr(obj, key, str(Path(value).expanduser().absolute()))


def config_from_dict(tree: dict) -> Config:
    """Rebuild a validated Config from ``Config.to_dict()`` output."""
    cfg = Config()
    _apply(cfg, tree, "config")
    _check_cross_field(cfg)
    return cfg


def describe_keys() -> list[tuple[str, str, Any, str]]:
    """(key, type, default, help) for every key, for the README and ``--help``."""
    rows = []
    for sec in dataclasses.fields(Config):
        for f in dataclasses.fields(_section_class(sec.name)()):
            help_text = f.metadata["help"]
            if f.metadata.get("choices"):
                help_text += f" One of: {', '.join(f.metadata['choices'])}."
            rows.append((f"{sec.name}.{f.name}", str(f.type), f.default, help_text))
    return rows
