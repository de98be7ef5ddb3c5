"""Typed run configuration: dataclass sections, YAML files, ``--set`` overrides.

Every field has a docstring-style ``help`` and, where it matters, allowed
values. ``load_config`` validates the whole tree once, before anything starts;
any problem raises :class:`ConfigError` whose message names the key and the
fix (the CLI turns it into one line on stderr and exit code 2).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ray_app.shared.errors import ConfigError
from ray_app.shared.lora import lora_settings

PRECISIONS = ("fp32", "bf16-mixed", "bf16")
BF16_RESOLUTION = 2.0 ** -8  # bf16 keeps 8 significant bits: 1 - x rounds to 1 for most weights when x is below


def _f(default, help: str, choices=None, min=None, max=None, schema=None):
    """A config field with its help text and bounds kept in metadata; ``schema``: what the JSON Schema of a
    config file says of it beyond its type (a key that takes a word or a number: its types and pattern)."""
    meta = {"help": help, "choices": choices, "min": min, "max": max, "schema": schema or {}}
    return field(default=default, metadata=meta)


@dataclass
class RunSection:
    """The run: its name, seed and where its checkpoints live."""

    name: str = _f("digits-ddp", "Run name: checkpoints live under {storage}/{name}/; the same name resumes.")
    seed: int = _f(0, "Seed for model init, data order and every rank's RNG.", min=0)
    storage: str = _f("./runs", "Where runs live: a local folder or s3://bucket/prefix.")
    resume_from: str = _f("", "Warm-start from this checkpoint (or run) URI when the run has no checkpoint of its "
                          "own: its whole state if its config matches, else its model weights.")
    lease_stale_s: float = _f(60.0, "A training driver holds a lease on its run (one writer per run), renewed every "
                              "quarter of this; a lease not renewed for this many seconds is stale (its driver is "
                              "gone) and the next driver takes it over.", min=2.0)


def _args(help: str):
    return field(default_factory=dict, metadata={"help": help, "choices": None, "min": None, "max": None})


@dataclass
class DataSection:
    """The data set plug-in, its arguments and the loaders."""

    name: str = _f("digits", "Data set: digits, synthetic, cifar10, imagefolder, shards (streamed from what "
                   "`ray-app data write` wrote), or your own factory package.module:function returning "
                   "(train, eval) or (train, eval, info).")
    args: dict = _args("Keyword arguments of the data factory (synthetic: num_samples, image_size; "
                       "imagefolder: image_size; shards: prefetch, the shards fetched ahead, default 2).")
    path: str = _f("", "Data folder, passed as the factory's path argument (cifar10: cifar-10-batches-py inside; "
                   "imagefolder: train/ and val/ inside; shards: the folder or s3://bucket/prefix that "
                   "`ray-app data write` wrote); relative to where ray-app runs.")
    batch_size: int = _f(32, "Per-worker batch size (global batch = batch_size * num_workers * grad_accum).", min=1)
    loader_workers: int = _f(0, "DataLoader worker processes per training worker (not used by shards, which a "
                             "prefetch thread reads).", min=0, max=64)


@dataclass
class ModelSection:
    """The model plug-in and its arguments."""

    name: str = _f("digits_cnn", "Model: digits_cnn, mlp, wide_mlp, a torchvision classifier (resnet18, ...), "
                   "or your own package.module:Class (an nn.Module class or a function returning one).")
    args: dict = _args("Keyword arguments of the model; entries of the data's info (num_classes, ...) fill "
                       "parameters not given here.")
    lora: dict = _args("LoRA through peft (empty = off): r (rank, default 8), alpha (default 16), dropout (default "
                       "0.0), target_modules (names of Linear modules, e.g. [q_proj, v_proj]; default: peft's for "
                       "the architecture). Only the adapters train and sit in checkpoints; the base comes from "
                       "model.args.path at every start.")


@dataclass
class TaskSection:
    """The task plug-in (loss and eval metrics) and its arguments."""

    name: str = _f("classification", "Task (loss and eval metrics): classification, regression, language_model, causal_lm, "
                   "or your own package.module:Class with loss(model, batch) and evaluate(model, batch).")
    args: dict = _args("Keyword arguments of the task (classification: label_smoothing).")


@dataclass
class TrainSection:
    """Optimisation: epochs, optimizer, LR schedule, accumulation, clipping, precision."""

    epochs: int = _f(10, "Number of epochs.", min=1)
    lr: float = _f(0.05, "Peak learning rate (after warmup).", min=0.0)
    optimizer: str = _f("sgd", "Optimizer.", choices=["sgd", "adamw"])
    weight_decay: float = _f(0.0, "Weight decay.", min=0.0)
    momentum: float = _f(0.9, "SGD momentum.", min=0.0, max=1.0)
    warmup_epochs: float = _f(0.0, "Linear warmup length in epochs, then cosine decay to zero.", min=0.0)
    grad_accum: int = _f(1, "Micro-batches per optimizer step; DDP all-reduces only on the last one.", min=1)
    clip_grad_norm: float = _f(0.0, "Clip the global gradient norm to this value (0 = off).", min=0.0)
    precision: str = _f("fp32", "Numeric precision: fp32; bf16-mixed (fp32 weights and optimizer state, bf16 "
                        "compute: FSDP gathers parameters in bf16 and reduces gradients in fp32, DDP runs forward "
                        "and loss under bf16 autocast; checkpoints hold the fp32 weights); bf16 (weights, gradients "
                        "and optimizer state in bf16: half the memory, the optimizer's update rounded to bf16). CPU "
                        "and CUDA alike; a run resumes under another precision (its checkpoint cast on load).",
                        choices=list(PRECISIONS))
    amp: bool = _f(False, "Deprecated: true is train.precision=bf16-mixed (and given with a train.precision that "
                   "disagrees, an error).")
    activation_checkpointing: str = _f("none", "Activation checkpointing of the model's blocks (the units "
                                       "train.fsdp_units finds, under DDP too): none, full (every block keeps only its "
                                       "input for backward and recomputes the rest; losses unchanged, bit for bit) or "
                                       "selective (every train.ac_every-th block).",
                                       choices=["none", "full", "selective"])
    ac_every: int = _f(2, "selective activation checkpointing: every ac_every-th block is checkpointed.", min=1)
    compile: bool = _f(False, "torch.compile each block (fullgraph, after activation checkpointing, before FSDP/DDP); "
                       "the task's loss stays eager. The first steps compile (tens of seconds); the cache keeps "
                       "a restarted worker group's compiles short.")
    compile_cache_dir: str = _f("", "Where train.compile keeps its inductor and Triton caches: a folder on each node "
                                "(or a shared volume). Empty: TORCHINDUCTOR_CACHE_DIR if set, else "
                                "{temp dir}/ray_app-inductor-{uid}, the same for every run of the user on the node, "
                                "so it outlives a worker-group restart.")
    log_every_steps: int = _f(20, "Optimizer steps between progress lines and metric updates.", min=1)
    bucket_cap_mb: int = _f(25, "DDP gradient bucket size in MB.", min=1)
    find_unused_parameters: bool = _f(False, "Passed to DDP: a model with parameters its loss does not use in a step "
                                      "(branches, frozen heads) needs it; it costs a walk of the autograd graph per "
                                      "step.")
    static_graph: bool = _f(False, "Passed to DDP: the set of used parameters is the same every step; with unused "
                            "parameters it skips find_unused_parameters' per-step graph walk.")
    strategy: str = _f("ddp", "How the model is spread over the workers: ddp (every rank holds the whole model; "
                       "gradients all-reduced) or fsdp (FSDP2 fully_shard: parameters, gradients and optimizer "
                       "state sharded over the ranks, for models larger than one device).", choices=["ddp", "fsdp"])
    fsdp_units: str = _f("", "fsdp: the module classes sharded as units, comma-separated class names (e.g. Block); "
                         "empty: each block of the model's outermost ModuleLists and one-class ModuleDicts, else "
                         "each top-level child with parameters. Also the blocks train.activation_checkpointing and "
                         "train.compile apply to, under ddp too (without the fallback to top-level children).")
    reshard_after_forward: bool = _f(True, "fsdp: free gathered parameters after forward (less memory, one more "
                                     "all-gather in backward).")
    replicate: str = _f("1", "fsdp: HSDP's replica groups: 1 (plain FSDP: every rank a shard of one group), N (N "
                        "groups of scaling.num_workers/N ranks, each holding the whole model sharded over its ranks; "
                        "N must divide scaling.num_workers) or auto (one group per node: a node's ranks shard, the "
                        "nodes replicate; every node needs the same number of workers).",
                        schema={"type": ["string", "integer"], "pattern": "^(auto|[1-9][0-9]*)$", "minimum": 1})
    max_steps: int = _f(0, "Stop after this many optimizer steps in total (0 = run all epochs); the LR schedule still spans all epochs.", min=0)
    nonfinite: str = _f("stop", "A step whose loss or gradients are not finite (inf/NaN): stop (exit 1 at that step, "
                        "naming the newest good checkpoint), skip (drop that optimizer step on every rank, counted in "
                        "the summary) or ignore (step anyway). No checkpoint with non-finite parameters is ever "
                        "committed.", choices=["stop", "skip", "ignore"])
    peak_tflops: float = _f(0.0, "Peak TFLOP/s of one worker's device, what MFU divides by (0 = the GPU's dense bf16 "
                            "figure from the kit's table; none on a CPU or a GPU not in it, and then no MFU).",
                            min=0.0)


@dataclass
class CheckpointSection:
    """When checkpoints are written, how many are kept, how they are uploaded."""

    every_epochs: int = _f(1, "Checkpoint every N epochs (0 = never at epoch ends).", min=0)
    every_steps: int = _f(0, "Also checkpoint every N optimizer steps, mid-epoch included (0 = off).", min=0)
    keep: int = _f(3, "Newest committed checkpoints kept (older ones deleted).", min=1)
    upload: str = _f("sync", "sync blocks training while the checkpoint is written and uploaded; "
                     "async copies the state and writes + uploads it in the background.", choices=["sync", "async"])
    async_writer: str = _f("thread", "With upload: async, what writes a rank's share: a thread of the training "
                           "process, or process: DCP's checkpoint process (no GIL shared with training; it "
                           "starts at the first checkpoint, a few seconds).", choices=["thread", "process"])


@dataclass
class ScalingSection:
    """Training workers and the resources each one reserves."""

    num_workers: int = _f(2, "Training workers (one per GPU, or CPU slot).", min=1)
    min_workers: int = _f(0, "Elastic: the fewest workers training goes on with when workers are lost for good "
                          "(nodes that do not come back); it grows back to num_workers when they return. "
                          "0: num_workers, a fixed size.", min=0)
    resize_interval_s: float = _f(60.0, "Elastic: how often a running worker group below num_workers looks for "
                                  "room to grow; a grow restarts it from the newest checkpoint.", min=1.0)
    use_gpu: bool = _f(False, "Train on GPUs with NCCL (else CPU with Gloo).")
    cpus_per_worker: float = _f(1.0, "CPUs reserved per worker.", min=0.0)
    gpus_per_worker: float = _f(1.0, "GPUs reserved per worker when use_gpu is true.", min=0.0)


@dataclass
class FailureSection:
    """What happens when workers fail."""

    max_failures: int = _f(3, "Worker-group restarts after failures (-1 = unlimited); an exception in your own code "
                           "that recurs at the same step after a restart ends the run sooner.", min=-1)
    preemption_checkpoint: bool = _f(True, "On a SIGTERM to a worker (a drained or preempted node, a stopped "
                                     "container) or Ray's drain notice for its node, every rank agrees at the next "
                                     "step boundary, checkpoints there and the group restarts from it: no completed "
                                     "step is lost. A SIGTERM to the driver (`ray job stop`) checkpoints the same "
                                     "way and ends the run (exit 143); submitting it again resumes there. false: a "
                                     "SIGTERM ends the worker, or the driver, at once, as in Ray.")
    hang_timeout_s: float = _f(300.0, "Seconds a rank may make no progress (a stopped process, a deadlock, a "
                               "collective that never returns) before the worker group restarts from the newest "
                               "checkpoint; torch's own default would be 1800. The longest legitimate wait must fit: "
                               "rank 0's sync checkpoint upload, its storage retries included.", min=10.0)
    storage_retry_s: float = _f(120.0, "Seconds a storage operation (a checkpoint upload, a listing, a read, the "
                                "preflight) retries an unreachable, silent or throttling S3 store, with backoff, "
                                "before the worker group restarts from the newest committed checkpoint (a "
                                "command's own reads: one line, exit 2). Each request times out after a quarter of "
                                "it (at least 1 s, at most 3 s to connect and 30 s to answer), so a store that never "
                                "answers ends within it plus one attempt's timeouts.", min=0.0)


@dataclass
class MetricsSection:
    """Rank 0's Prometheus exporter."""

    enabled: bool = _f(True, "Rank 0 serves Prometheus metrics.")
    port: int = _f(9500, "Port of rank 0's /metrics endpoint.", min=1, max=65535)
    rank_pace: bool = _f(True, "Every rank's own step time and data wait reach rank 0 in one all_gather per "
                         "train.log_every_steps (per rank and host in Prometheus, and a progress line naming a rank "
                         "that stays behind); false: no timing marks and no all_gather.")


@dataclass
class TrackingSection:
    """Rank 0's experiment tracking: an MLflow run and TensorBoard event files (``ray_app.worker.tracking``)."""

    mlflow_uri: str = _f("", "MLflow tracking server (http(s)://host:port); empty: MLFLOW_TRACKING_URI from the "
                         "environment, and off when neither is set. The token comes from MLFLOW_TRACKING_TOKEN.")
    experiment: str = _f("ray-app", "MLflow experiment the run is logged in (made when missing).")
    tensorboard: bool = _f(False, "Rank 0 writes TensorBoard event files into the run's folder "
                           "({run.storage}/{run.name}/tensorboard; on S3, uploaded with each checkpoint).")
    buffer: int = _f(100_000, "Metric values held while the MLflow server is unreachable; beyond it the oldest "
                     "are dropped (and counted).", min=100)


@dataclass
class Config:
    """A whole run config: one section per part of the run."""

    run: RunSection = field(default_factory=RunSection)
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    task: TaskSection = field(default_factory=TaskSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    scaling: ScalingSection = field(default_factory=ScalingSection)
    failure: FailureSection = field(default_factory=FailureSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def _section_class(name: str):
    return {f.name: f.default_factory for f in dataclasses.fields(Config)}[name]


@functools.cache
def field_types(cls: type) -> dict[str, tuple[type, bool]]:
    """name -> (type, optional) of each field of a config section: annotations resolved with
    ``typing.get_type_hints`` (this module's are strings), generics to their origin (``dict[str, Any]``
    -> ``dict``), ``X | None`` / ``Optional[X]`` to ``(X, True)``."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        optional = False
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            optional = len(args) < len(typing.get_args(hint))
            if len(args) != 1:
                raise TypeError(f"{cls.__name__}.{name}: a config key has one type (and maybe None), not {hint}")
            hint = args[0]
        out[name] = (typing.get_origin(hint) or hint, optional)
    return out


def _type_name(t) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[t]


def _plain_args(key: str, value: Any) -> dict:
    """A plug-in's ``args``: a mapping with string keys (values: anything YAML gives)."""
    if not isinstance(value, dict):
        raise ConfigError(f"config key {key}: expected a mapping of keyword arguments, got {value!r}")
    for k in value:
        if not isinstance(k, str) or not k.isidentifier():
            raise ConfigError(f"config key {key}: {k!r} is not a valid argument name")
    return value


def _merge_args(current: dict, new: dict) -> dict:
    """``--set model.args.hidden=3`` adds to the args the file gave; nested mappings merge too."""
    merged = dict(current)
    for k, v in new.items():
        merged[k] = _merge_args(merged[k], v) if isinstance(v, dict) and isinstance(merged.get(k), dict) else v
    return merged


def _coerce(key: str, value: Any, fld: dataclasses.Field, typ: tuple[type, bool]) -> Any:
    """Check one value against its field's type (``field_types``) and bounds; return it typed."""
    t, optional = typ
    if value is None and optional:
        return None
    if t is dict:
        return _plain_args(key, value)
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


def _apply(cfg: Config, tree: dict, origin: str, merge_args: bool = False) -> set[str]:
    """Set the keys of ``tree``; a plug-in's ``args`` mapping is replaced, or merged into with ``merge_args``
    (``--set model.args.hidden=3`` adds one argument; ``--set model.args={}`` clears them). Returns the keys
    set (``section.key``)."""
    given: set[str] = set()
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
        types_ = field_types(type(obj))
        for key, value in values.items():
            if key not in fields and section == "data" and key in LEGACY_DATA_KEYS:
                raise ConfigError(f"{origin}: config key data.{key} is now data.args.{key} (an argument of the "
                                  "synthetic / imagefolder data sets); move it there")
            if key not in fields:
                raise ConfigError(
                    f"{origin}: unknown config key {section}.{key}; known keys in {section}: {', '.join(fields)}"
                )
            value = _coerce(f"{section}.{key}", value, fields[key], types_[key])
            if types_[key][0] is dict and merge_args:
                value = _merge_args(getattr(obj, key), value)
            setattr(obj, key, value)
            given.add(f"{section}.{key}")
    return given


def _field_type(section: str, key: str) -> type | None:
    """The type of config key ``section.key`` (``dict`` for a plug-in's args), None if there is no such key."""
    if section not in SECTIONS:
        return None
    found = field_types(_section_class(section)).get(key)
    return found[0] if found else None


def parse_override(text: str) -> dict:
    """``a.b=value`` -> ``{"a": {"b": value}}``, value parsed as a YAML scalar."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, for example --set train.epochs=5")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) > 2 and all(parts) and _field_type(parts[0], parts[1]) is dict:
        # section.args.name=value (or deeper): one keyword argument of a plug-in, a YAML scalar
        value: Any = _yaml_scalar(raw, text, key.strip())
        for name in reversed(parts[2:]):
            value = {name: value}
        return {parts[0]: {parts[1]: value}}
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set {text!r}: KEY must be section.key (or section.args.name), for example train.epochs")
    if _field_type(parts[0], parts[1]) is str:
        return {parts[0]: {parts[1]: raw.strip()}}  # taken as written: run.name=007 stays "007"
    return {parts[0]: {parts[1]: _yaml_scalar(raw, text, key.strip())}}


def _yaml_scalar(raw: str, text: str, key: str) -> Any:
    try:
        value = parse_yaml(raw, f"--set {text}", key) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return "" if value is None else value


def _check_cross_field(cfg: Config) -> None:
    lora_settings(cfg.model.lora)
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
    if cfg.scaling.min_workers > cfg.scaling.num_workers:
        raise ConfigError(f"config key scaling.min_workers={cfg.scaling.min_workers} must not exceed "
                          f"scaling.num_workers={cfg.scaling.num_workers}; lower it (0 = a fixed size)")
    if cfg.scaling.use_gpu and cfg.scaling.gpus_per_worker <= 0:
        raise ConfigError("config key scaling.gpus_per_worker: must be > 0 when scaling.use_gpu is true")
    _check_bf16_weight_decay(cfg.train)
    _check_replicate(cfg)
    f = cfg.failure
    if f.hang_timeout_s <= f.storage_retry_s:
        raise ConfigError(f"config key failure.hang_timeout_s={f.hang_timeout_s:g} must exceed failure.storage_retry_s="
                          f"{f.storage_retry_s:g} (the other ranks wait while rank 0 retries an upload); raise it "
                          "or lower failure.storage_retry_s")


def _check_bf16_weight_decay(t: TrainSection) -> None:
    """``train.precision=bf16`` keeps the weights in bf16, where the optimizer's decay step, a weight times
    ``1 - lr * weight_decay``, rounds back to the weight unless ``lr * weight_decay`` reaches bf16's resolution:
    below it weight decay silently does nothing (at the peak LR already; the schedule only lowers the LR)."""
    decay = t.lr * t.weight_decay
    if t.precision == "bf16" and 0 < decay < BF16_RESOLUTION:
        raise ConfigError(f"config key train.precision=bf16: train.lr x train.weight_decay = {decay:.3g} is below "
                          f"bf16's resolution (2^-8 = {BF16_RESOLUTION:.4f}), so each step's weight decay rounds away "
                          "in the bf16 weights and does nothing; use train.precision=bf16-mixed (fp32 master weights) "
                          "or train.weight_decay=0")


def _check_replicate(cfg: Config) -> None:
    """train.replicate: auto or a whole number >= 1; above 1 only under fsdp, dividing a fixed world size."""
    value, s = cfg.train.replicate, cfg.scaling
    if value != "auto" and not (value.isdigit() and int(value) >= 1):
        raise ConfigError(f"config key train.replicate: {value!r} is not allowed; use 1 (plain FSDP), a whole number "
                          "N (N replica groups) or auto (one per node)")
    if value != "auto":
        value = cfg.train.replicate = str(int(value))  # 02 is 2
    if value == "1":
        return
    if cfg.train.strategy != "fsdp":
        raise ConfigError(f"config key train.replicate={value} shapes FSDP's mesh (HSDP) and DDP already replicates "
                          "the whole model on every rank; set train.strategy=fsdp, or train.replicate=1")
    if value == "auto":
        return
    n = int(value)
    if s.num_workers % n:
        raise ConfigError(f"config key train.replicate={n} does not divide scaling.num_workers={s.num_workers}: the "
                          "replica groups must be of equal size; use a divisor of it, or auto (one group per node)")
    if s.min_workers and s.min_workers < s.num_workers:
        raise ConfigError(f"config key train.replicate={n} needs a fixed world size, and scaling.min_workers="
                          f"{s.min_workers} lets it change; use train.replicate=auto (one group per node) or set "
                          "scaling.min_workers=0")


def read_config_file(path: str | os.PathLike) -> Any:
    """The YAML tree of a config file: UTF-8, valid YAML, no key given twice."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file; pass an existing YAML file (see configs/)")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot be read ({exc.strerror}); check its permissions") from None
    try:
        return parse_yaml(_utf8_text(data, path), f"--config {path}") or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"--config {path}:{where} is not valid YAML; fix the syntax") from None


def _utf8_text(data: bytes, path) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"--config {path}: byte {exc.start} (line {line}, 0x{data[exc.start]:02x}) is not UTF-8; "
                          "save the file as UTF-8") from None


def parse_yaml(text: str, origin: str, key: str = "") -> Any:
    """``yaml.safe_load``, except that a mapping giving one key twice is a ConfigError (PyYAML keeps the last).
    Syntax errors raise ``yaml.YAMLError``."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _reject_duplicate_keys(node, origin, key, set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


_MERGE_TAG = "tag:yaml.org,2002:merge"  # `<<: *base` then a key of base: an override, not a duplicate


def _reject_duplicate_keys(node: yaml.Node, origin: str, path: str, seen_nodes: set) -> None:
    if id(node) in seen_nodes:  # an alias of a node already checked (possibly recursive)
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _reject_duplicate_keys(item, origin, f"{path}[{i}]", seen_nodes)
    if not isinstance(node, yaml.MappingNode):
        return
    lines: dict[str, int] = {}
    for key_node, value_node in node.value:
        named = isinstance(key_node, yaml.ScalarNode) and key_node.tag != _MERGE_TAG
        key = f"{path}.{key_node.value}" if path and named else (key_node.value if named else path)
        if named and key in lines:
            raise ConfigError(f"{origin}: key {key} is given twice ({_lines(lines[key], key_node.start_mark.line + 1)}); "
                              "keep one of them")
        if named:
            lines[key] = key_node.start_mark.line + 1
        _reject_duplicate_keys(value_node, origin, key, seen_nodes)


def _lines(first: int, second: int) -> str:
    return f"lines {first} and {second}" if first != second else f"line {first}"


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file <- ``--set`` overrides, validated once."""
    cfg = Config()
    given = _apply(cfg, read_config_file(path), str(path)) if path is not None else set()
    given |= _apply_overrides(cfg, overrides or [])
    _resolve_precision(cfg, given)
    _check_cross_field(cfg)
    _absolute_local_paths(cfg)
    return cfg


def _apply_overrides(cfg: Config, overrides) -> set[str]:
    given: set[str] = set()
    for text in overrides:
        one_argument = text.split("=", 1)[0].count(".") > 1  # section.args.name=value
        given |= _apply(cfg, parse_override(text), f"--set {text}", merge_args=one_argument)
    return given


def _amp_precision(amp: bool) -> str:
    return "bf16-mixed" if amp else "fp32"


def _resolve_precision(cfg: Config, given: set[str]) -> None:
    """The deprecated ``train.amp``, where given, sets ``train.precision`` (true: bf16-mixed, false: fp32); both
    given and disagreeing is a ConfigError. ``given``: the keys the user's file and ``--set`` gave."""
    t = cfg.train
    if "train.amp" not in given:
        return
    implied = _amp_precision(t.amp)
    if "train.precision" in given and t.precision != implied:
        raise ConfigError(f"config keys train.amp={str(t.amp).lower()} and train.precision={t.precision} disagree "
                          f"(train.amp={str(t.amp).lower()} means train.precision={implied}); train.amp is "
                          "deprecated: remove it and keep train.precision")
    t.precision = implied


def deprecated_keys_note(cfg: Config) -> str | None:
    """The one warning line for a deprecated key the config sets (train.amp=false is the default, fp32)."""
    if not cfg.train.amp:
        return None
    return (f"ray-app: train.amp is deprecated: train.amp={str(cfg.train.amp).lower()} is read as "
            f"train.precision={_amp_precision(cfg.train.amp)}; set that instead")


def _is_local(path: str) -> bool:
    return bool(path) and "://" not in path


def _absolute_local_paths(cfg: Config) -> None:
    """Local paths are relative to where the user ran the command, not to a Ray worker's cwd."""
    for section, key in (("run", "storage"), ("run", "resume_from"), ("data", "path")):
        obj = getattr(cfg, section)
        value = getattr(obj, key)
        if _is_local(value):
            setattr(obj, key, str(Path(value).expanduser().absolute()))


def config_from_dict(tree: dict, overrides: list[str] | tuple = ()) -> Config:
    """Rebuild a validated Config from ``Config.to_dict()`` output (a checkpoint's config.json),
    then apply ``--set`` overrides."""
    cfg = Config()
    _apply(cfg, _migrated(tree), "config")
    _resolve_precision(cfg, _apply_overrides(cfg, overrides))  # the tree's keys are defaults the overrides change
    _check_cross_field(cfg)
    return cfg


LEGACY_DATA_KEYS = ("num_samples", "image_size")  # once data.*, now data.args.* of synthetic/imagefolder


def _migrated(tree: dict) -> dict:
    """Configs saved in older checkpoints: their data.num_samples / data.image_size become data.args; a
    train.amp becomes the train.precision it means (a saved config that has both keeps precision, which the
    driver resolved)."""
    tree = _migrated_amp(tree)
    data = tree.get("data") if isinstance(tree, dict) else None
    if not isinstance(data, dict) or not any(k in data for k in LEGACY_DATA_KEYS):
        return tree
    data = dict(data)
    legacy = {k: data.pop(k) for k in LEGACY_DATA_KEYS if k in data}
    wanted = {"synthetic": LEGACY_DATA_KEYS, "imagefolder": ("image_size",)}.get(data.get("name"), ())
    data["args"] = {**{k: v for k, v in legacy.items() if k in wanted}, **data.get("args", {})}
    return {**tree, "data": data}


def _migrated_amp(tree: dict) -> dict:
    train = tree.get("train") if isinstance(tree, dict) else None
    if not isinstance(train, dict) or "amp" not in train:
        return tree
    train = dict(train)
    amp = train.pop("amp")
    if "precision" not in train and isinstance(amp, bool):
        train["precision"] = _amp_precision(amp)
    return {**tree, "train": train}


# What a checkpoint's state depends on: a run resumes only with these unchanged. Everything
# else may change on resume (more epochs or max_steps, a new lr, weight decay, momentum or warmup:
# the LR schedule is re-planned over the new total; clipping, logging, checkpoint cadence, failure and
# metrics settings, data.path and data.loader_workers, the resources per worker, and the number of
# workers: the loop re-shards the rest of an epoch over another world size).
RESUME_MUST_MATCH = (
    "model.name", "model.args", "model.lora", "data.name", "data.args", "task.name", "task.args", "run.seed",
    "data.batch_size", "train.grad_accum", "train.optimizer",
)


def resume_conflicts(saved: dict, cfg: Config) -> list[str]:
    """The keys in RESUME_MUST_MATCH whose value differs between a checkpoint's config and ``cfg``."""
    saved, now, default = _migrated(saved), cfg.to_dict(), Config().to_dict()
    out = []
    for key in RESUME_MUST_MATCH:
        section, name = key.split(".")
        old = (saved.get(section) or {}).get(name, default[section][name])
        new = now[section][name]
        if old != new:
            out.append(f"{key} ({_short(old)} -> {_short(new)})")
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# train keys that one strategy reads and the other does not
STRATEGY_KEYS = {"bucket_cap_mb": "ddp", "find_unused_parameters": "ddp", "static_graph": "ddp",
                 "fsdp_units": "fsdp", "reshard_after_forward": "fsdp"}


def strategy_keys_note(cfg: Config) -> str | None:
    """The one line said when a train key only the other strategy reads is set away from its default."""
    default = TrainSection()
    per_block = cfg.train.activation_checkpointing != "none" or cfg.train.compile  # read fsdp_units's blocks
    unused = [k for k, reader in STRATEGY_KEYS.items()
              if reader != cfg.train.strategy and getattr(cfg.train, k) != getattr(default, k)
              and not (k == "fsdp_units" and per_block)]
    if not unused:
        return None
    other = STRATEGY_KEYS[unused[0]]
    keys = ", ".join(f"train.{k}={json.dumps(getattr(cfg.train, k))}" for k in unused)
    return (f"ray-app: {keys} {'is' if len(unused) == 1 else 'are'} read under train.strategy={other} only, so "
            f"not used by this train.strategy={cfg.train.strategy} run (docs/fsdp.md)")
