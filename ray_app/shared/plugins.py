"""Plug-ins: the data, model and task a run trains, named in the config.

Every plug-in point is a config value: a built-in name, or an import path
``package.module:attribute`` (a class or a function), with ``args``, a mapping
of keyword arguments, beside it::

    data.name: acme.data:build        data.args: {root: /data}     -> build(**args) = (train, eval[, info])
    model.name: acme.model:Net        model.args: {hidden: 128}    -> Net(**args, **matching info) = nn.Module
    task.name: acme.task:MyTask       task.args: {smoothing: 0.1}  -> MyTask(**args): .loss(), .evaluate()

The built-ins are plug-ins of the same kind: their names are shorthands for
import paths into ``ray_app.shared.data``, ``ray_app.shared.models`` and ``ray_app.shared.tasks``.

Checked on the driver before Ray starts (:func:`validate`): the module
imports, the attribute exists and is callable, every argument is one its
signature takes. The built-ins are checked from their sources, so the
driver does not import torch for them. What only a worker can find (what a
factory returns, a data set without ``__len__``, an ``evaluate`` of the wrong
length) raises :class:`PluginError` there: the run stops at once (it would
fail the same way on every restart) and the driver shows the one line.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import os
import sys
import threading
import traceback
from pathlib import Path

from ray_app.shared.config import Config
from ray_app.shared.errors import ConfigError, DataPipelineError, PluginError, ShardError, StorageError, StorageUnavailable, first_line

KINDS = ("data", "model", "task")

BUILTIN = {
    "data": {"digits": "ray_app.shared.data:digits", "synthetic": "ray_app.shared.data:synthetic",
             "cifar10": "ray_app.shared.data:cifar10", "imagefolder": "ray_app.shared.data:imagefolder",
             "shards": "ray_app.shared.shards:shard_data", "text": "ray_app.shared.text:text"},
    "model": {"hf": "ray_app.shared.hf:pretrained", "digits_cnn": "ray_app.shared.models:DigitsCNN", "mlp": "ray_app.shared.models:mlp",
              "wide_mlp": "ray_app.shared.models:wide_mlp"},
    "task": {"classification": "ray_app.shared.tasks:Classification", "regression": "ray_app.shared.tasks:Regression",
             "language_model": "ray_app.shared.tasks:LanguageModel", "causal_lm": "ray_app.shared.tasks:CausalLM"},
}
TORCHVISION_TARGET = "ray_app.shared.models:torchvision_classifier"  # any torchvision classifier name, e.g. resnet18
TEXT_TARGET = "ray_app.shared.text:text"  # text files and a tokenizer, packed into sequences
HF_TARGET = "ray_app.shared.hf:pretrained"  # a Hugging Face model from its config and safetensors (no hub)
SHARDS_TARGET = "ray_app.shared.shards:shard_data"  # streamed shards (ray-app data write); the kit passes its retry budget
SHARDS_KIT_ARGS = {"storage_retry_s"}  # what the kit passes the shards' factory (failure.storage_retry_s)

# what the built-in data sets' info holds, known without loading them (checked against the real ones in tests)
BUILTIN_DATA_CHANNELS = {"digits": 1, "synthetic": 3, "cifar10": 3, "imagefolder": 3}


def plugin_roots(cfg: Config) -> tuple[str, ...]:
    """Where the plug-ins' code lives: a user's whole top-level package, or a built-in's own file."""
    roots = []
    for kind in KINDS:
        module_name = target(kind, getattr(cfg, kind).name).partition(":")[0]
        module = sys.modules.get(module_name)
        if module is None or not getattr(module, "__file__", None):
            continue
        if _is_builtin(module_name + ":"):
            roots.append(os.path.abspath(module.__file__))
            continue
        top = sys.modules.get(module_name.split(".")[0], module)
        top_file = os.path.abspath(getattr(top, "__file__", None) or module.__file__)
        roots.append(os.path.dirname(top_file) if top_file.endswith("__init__.py") else top_file)
    return tuple(roots)


# ---------------------------------------------------------------- names -> import targets

def target(kind: str, name: str) -> str:
    """``module:attribute`` for a built-in name or an import path; ConfigError naming ``{kind}.name``."""
    key = f"config key {kind}.name"
    if name in BUILTIN[kind]:
        return BUILTIN[kind][name]
    if ":" in name:
        module, _, attr = name.partition(":")
        if not all(p.isidentifier() for p in module.split(".")) or not all(p.isidentifier() for p in attr.split(".")):
            raise ConfigError(f"{key}: {name!r} is not an import path; write package.module:attribute")
        return name
    if kind == "model":
        from ray_app.shared.modelnames import is_torchvision_classifier

        if is_torchvision_classifier(name):
            return TORCHVISION_TARGET
    known = ", ".join(BUILTIN[kind]) + (" or a torchvision classifier such as resnet18" if kind == "model" else "")
    raise ConfigError(f"{key}: unknown {kind} {name!r}; use {known}, or your own as package.module:attribute")


def _is_builtin(tgt: str) -> bool:
    return tgt.startswith("ray_app.")


def add_project_to_path(folder: str) -> None:
    """Plug-ins are found like ``python -m``: the folder ray-app runs from comes first on sys.path."""
    if folder and os.path.isdir(folder) and folder not in sys.path:
        sys.path.insert(0, folder)


def resolve(kind: str, name: str):
    """Import the plug-in named by ``{kind}.name``; ConfigError with one line on any problem."""
    tgt = target(kind, name)
    module_name, _, attr = tgt.partition(":")
    key = f"config key {kind}.name"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name or module_name.startswith(f"{exc.name}."):
            raise ConfigError(f"{key}: cannot import {module_name!r} (no module named {exc.name!r}); run ray-app "
                              "from your project folder, install your package, or put it on PYTHONPATH") from None
        raise ConfigError(f"{key}: importing {module_name} failed: {_one_line(exc)}") from None
    except Exception as exc:  # the user's module itself raises while importing (SyntaxError, ...)
        raise ConfigError(f"{key}: importing {module_name} failed: {_one_line(exc)}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n, v in vars(module).items() if not n.startswith("_") and callable(v)
                            and getattr(v, "__module__", None) == module.__name__)
            has = f"; it has {', '.join(public[:12])}" if public else ""
            raise ConfigError(f"{key}: module {module_name} has no attribute {attr!r}{has}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{key}: {module_name}:{attr} is a {type(obj).__name__}, not a class or function")
    if tgt == TORCHVISION_TARGET:
        obj = functools.partial(obj, name)
    return obj


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} ({Path(exc.filename or '?').name}, line {exc.lineno})"
    first = first_line(exc)
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


# ---------------------------------------------------------------- signatures

class Params:
    """The keyword parameters a plug-in accepts: names, which are required, whether **kwargs is there."""

    def __init__(self, names: list[str], required: set[str], var_kw: bool):
        self.names, self.required, self.var_kw = names, required, var_kw

    def accepts(self, name: str) -> bool:
        return self.var_kw or name in self.names

    @classmethod
    def of(cls, fn) -> Params:
        if isinstance(fn, functools.partial):
            p = cls.of(fn.func)
            bound = len(fn.args)
            return cls(p.names[bound:], p.required - set(p.names[:bound]), p.var_kw)
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin without a signature: accept what it is given
            return cls([], set(), True)
        names, required, var_kw = [], set(), False
        for p in sig.parameters.values():
            if p.kind is p.VAR_KEYWORD:
                var_kw = True
            elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                names.append(p.name)
                if p.default is p.empty:
                    required.add(p.name)
        return cls(names, required, var_kw)


def _source_params(tgt: str) -> Params | None:
    """A built-in's parameters read from ray_app's own sources (no torch import); None if not found."""
    module_name, _, attr = tgt.partition(":")
    spec = importlib.util.find_spec(module_name)
    if spec is None or not spec.origin:
        return None
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == attr:
            inits = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
            return _ast_params(inits[0].args, skip=1) if inits else None  # inherited: ask the class itself
        if isinstance(node, ast.FunctionDef) and node.name == attr:
            return _ast_params(node.args, skip=0)
    return None


def _ast_params(a: ast.arguments, skip: int) -> Params:
    positional = [p.arg for p in a.posonlyargs + a.args][skip:]
    first_default = len(positional) - len(a.defaults)
    required = {n for i, n in enumerate(positional) if i < first_default}
    required |= {p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is None}
    return Params(positional + [p.arg for p in a.kwonlyargs], required, a.kwarg is not None)


def params(kind: str, name: str) -> Params:
    tgt = target(kind, name)
    if tgt == TORCHVISION_TARGET:
        return Params(["num_classes", "channels"], {"num_classes"}, True)  # other args go to torchvision
    if _is_builtin(tgt):
        found = _source_params(tgt)
        if found is not None:
            return found
    return Params.of(resolve(kind, name))


# ---------------------------------------------------------------- checks on the driver

def _check_args(kind: str, name: str, p: Params, args: dict, kit_supplies: set[str]) -> None:
    for arg in args:
        if not p.accepts(arg) or arg in kit_supplies:
            takes = ", ".join(n for n in p.names if n not in kit_supplies) or "no arguments"
            raise ConfigError(f"config key {kind}.args.{arg}: {name} takes no argument {arg!r}; it takes {takes}")


def validate(cfg: Config) -> None:
    """Everything about the plug-ins that can be checked before Ray starts (ConfigError, exit 2)."""
    data_p = params("data", cfg.data.name)
    kit_args = SHARDS_KIT_ARGS if target("data", cfg.data.name) == SHARDS_TARGET else set()
    _check_args("data", cfg.data.name, data_p, cfg.data.args, kit_args)
    if cfg.data.path and "path" not in cfg.data.args and not data_p.accepts("path"):
        raise ConfigError(f"config key data.path: {cfg.data.name} takes no path argument; "
                          "unset data.path or pass what the factory takes in data.args")
    given = set(cfg.data.args) | ({"path"} if cfg.data.path else set()) | kit_args
    if kit_args:
        from ray_app.shared.shards import DEFAULT_PREFETCH, prefetch_problem

        problem = prefetch_problem(cfg.data.args.get("prefetch", DEFAULT_PREFETCH))
        if problem:
            raise ConfigError(problem)
    missing = sorted(data_p.required - given)
    if missing:
        where = "data.path" if missing == ["path"] else f"data.args.{missing[0]}"
        raise ConfigError(f"config key {where}: {cfg.data.name} needs {', '.join(missing)}; set {where}")
    model_p = params("model", cfg.model.name)
    _check_args("model", cfg.model.name, model_p, cfg.model.args, set())
    if target("model", cfg.model.name) == TORCHVISION_TARGET and BUILTIN_DATA_CHANNELS.get(cfg.data.name, 3) != 3:
        raise ConfigError(f"config key model.name: {cfg.model.name} needs 3-channel images and data.name="
                          f"{cfg.data.name} has {BUILTIN_DATA_CHANNELS[cfg.data.name]}; use model.name=digits_cnn "
                          "or mlp, or data.name=synthetic/cifar10/imagefolder")
    _check_args("task", cfg.task.name, params("task", cfg.task.name), cfg.task.args, set())
    if not _is_builtin(target("task", cfg.task.name)):
        task = resolve("task", cfg.task.name)
        if inspect.isclass(task):
            for method in ("loss", "evaluate"):
                if not callable(getattr(task, method, None)):
                    raise ConfigError(f"config key task.name: {cfg.task.name} has no {method}(model, batch) "
                                      "method; a task needs loss() and evaluate()")


def check_builtin_data_folder(name: str, path: str) -> None:
    """The built-in data sets that read a folder: is it laid out as they need? (ConfigError naming data.path)"""
    root = Path(path)
    if name == "cifar10":
        folder = root / "cifar-10-batches-py"
        if not folder.is_dir():
            raise ConfigError(f"config key data.path: {path} has no cifar-10-batches-py/ folder; "
                              "download CIFAR-10 (python version) and extract it there")
        missing = [f for f in (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch") if not (folder / f).is_file()]
        if missing:
            raise ConfigError(f"config key data.path: {folder / missing[0]} is missing; extract the complete "
                              "CIFAR-10 python version (data_batch_1..5, test_batch) there")
    elif name == "imagefolder":
        for split in ("train", "val"):
            if not (root / split).is_dir():
                raise ConfigError(f"config key data.path: {path} has no {split}/ folder; "
                                  "lay the images out as train/<class>/*.png and val/<class>/*.png")


def validate_local_data(cfg: Config) -> None:
    """Checks of data.path that need the workers' file system: run where the driver shares it (local Ray)."""
    if cfg.data.name in ("cifar10", "imagefolder") and cfg.data.path:
        check_builtin_data_folder(cfg.data.name, cfg.data.path)
    if target("data", cfg.data.name) == SHARDS_TARGET:
        check_shard_set(cfg)


def check_shard_set(cfg: Config) -> None:
    """data.name=shards: the manifest at data.path read as the workers will (no manifest, another format,
    a split without shards: ShardError, one line, exit 2). Run on the driver before Ray starts, for an
    ``s3://`` set always, for a folder where the driver shares the workers' files (local Ray)."""
    from ray_app.shared.shards import open_dest, read_manifest

    read_manifest(open_dest(str(cfg.data.args.get("path", cfg.data.path))))


def loader_workers_note(cfg: Config) -> str | None:
    """The one line said when data.loader_workers is set for streamed shards, which are read without them."""
    if target("data", cfg.data.name) != SHARDS_TARGET or cfg.data.loader_workers == 0:
        return None
    return (f"ray-app: data.name=shards reads its shards in each training worker (a prefetch thread), so "
            f"data.loader_workers={cfg.data.loader_workers} is not used (README 'Shards': loader workers)")


# ---------------------------------------------------------------- building (on the workers)

def build_data(cfg: Config):
    """``(train, eval, info)`` from the data plug-in, each checked against the contract."""
    factory = resolve("data", cfg.data.name)
    kwargs = dict(cfg.data.args)
    if cfg.data.path and "path" not in kwargs:
        kwargs["path"] = cfg.data.path
    if target("data", cfg.data.name) == SHARDS_TARGET:
        kwargs["storage_retry_s"] = cfg.failure.storage_retry_s  # shards are read as checkpoints are written
    out = factory(**kwargs)
    name = cfg.data.name
    if not isinstance(out, (tuple, list)) or len(out) not in (2, 3):
        raise PluginError(f"config key data.name: {name} returned {_kind(out)}; it must return (train, eval) "
                          "or (train, eval, info)")
    train, evaluation, info = out[0], out[1], (out[2] if len(out) == 3 else None)
    for which, ds in (("train", train), ("eval", evaluation)):
        _check_dataset(name, which, ds)
    if info is None:
        info = {}
    if not isinstance(info, dict):
        raise PluginError(f"config key data.name: {name} returned info of type {type(info).__name__}; "
                          "the third item must be a dict (e.g. {'num_classes': 10})")
    return guarded_data(train, evaluation, info)


def guarded_data(train, evaluation, info: dict):
    """The data sets and the collate function, each raising ``DataPipelineError`` for an exception of
    the user's data pipeline (``__getitem__``, collate), with the user's frames or the samples' indices
    and shapes."""
    from torch.utils.data import default_collate

    info = dict(info)
    info["collate_fn"] = GuardedCollate(info.get("collate_fn") or default_collate)
    return GuardedDataset(train), GuardedDataset(evaluation), info


_FETCHED = threading.local()  # the indices of the batch this thread fetched last, for the collate's report


class GuardedDataset:
    """A map-style data set as given, whose exceptions say which sample and where in the user's code."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name):  # the data set's own attributes (targets, classes, ...)
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, index):
        try:
            return self.dataset[index]
        except (ShardError, StorageError, StorageUnavailable):  # the kit's own reading of shards: not the user's
            raise
        except Exception as exc:
            raise DataPipelineError(DataPipelineError.MARKER + _item_report(exc, index)) from None

    def __getitems__(self, indices):
        _FETCHED.indices = list(indices)
        return [self[i] for i in indices]


class GuardedCollate:
    """The collate function as given; a failure names the batch's sample indices and shapes."""

    def __init__(self, collate):
        self.collate = collate
        functools.update_wrapper(self, collate)  # its name and doc, as the DataLoader's collate_fn shows them

    def __call__(self, samples):
        try:
            return self.collate(samples)
        except Exception as exc:
            indices = getattr(_FETCHED, "indices", None) or list(range(len(samples)))
            shapes = ", ".join(f"sample {i}: {_shape(s)}" for i, s in list(zip(indices, samples))[:16])
            more = f" (+{len(samples) - 16} more)" if len(samples) > 16 else ""
            summary = f"{type(exc).__name__}: {first_line(exc)}" if str(exc).strip() else type(exc).__name__
            report = (f"collating samples {_span(indices)} into a batch failed: {shapes}{more}\n"
                      f"{type(exc).__name__}: the samples of a batch must have equal shapes "
                      f"(or give data.name's info a collate_fn); {summary}")
            raise DataPipelineError(DataPipelineError.MARKER + report) from None


def _item_report(exc: BaseException, index) -> str:
    """The traceback of an exception in ``dataset[index]``, from the data set's own frame down."""
    frames = traceback.extract_tb(exc.__traceback__)[1:]  # [0] is GuardedDataset.__getitem__
    return (f"sample {index}: Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
            + "".join(traceback.format_exception_only(type(exc), exc))).rstrip("\n")


def _span(indices: list) -> str:
    return f"[{', '.join(map(str, indices[:16]))}{', ...' if len(indices) > 16 else ''}]"


def _shape(sample) -> str:
    if hasattr(sample, "shape"):
        return str(tuple(sample.shape))
    if isinstance(sample, dict):
        return "{" + ", ".join(f"{k}: {_shape(v)}" for k, v in sample.items()) + "}"
    if isinstance(sample, (tuple, list)):
        return "(" + ", ".join(_shape(v) for v in sample) + ")"
    return type(sample).__name__


def _kind(obj) -> str:
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of {len(obj)} items"
    return f"a {type(obj).__name__}"


def _check_dataset(name: str, which: str, ds) -> None:
    try:
        n = len(ds)
    except TypeError:
        raise PluginError(f"config key data.name: the {which} set of {name} ({type(ds).__name__}) has no __len__; "
                          "return a map-style torch.utils.data.Dataset (items by index, a length)") from None
    if not callable(getattr(ds, "__getitem__", None)):
        raise PluginError(f"config key data.name: the {which} set of {name} ({type(ds).__name__}) has no "
                          "__getitem__; return a map-style torch.utils.data.Dataset")
    if n == 0:
        raise PluginError(f"config key data.name: the {which} set of {name} is empty")


def build_model(cfg: Config, info: dict):
    """The model plug-in called with model.args plus the info entries its signature names."""
    import torch

    fn = resolve("model", cfg.model.name)
    p = params("model", cfg.model.name)
    kwargs = dict(cfg.model.args)
    for k, v in info.items():
        if k in p.names and k not in kwargs:
            kwargs[k] = v
    missing = sorted(p.required - set(kwargs))
    if missing:
        raise PluginError(f"config key model.args.{missing[0]}: {cfg.model.name} needs {', '.join(missing)}, "
                          f"which neither model.args nor the data's info ({', '.join(info) or 'empty'}) gives")
    model = fn(**kwargs)
    if not isinstance(model, torch.nn.Module):
        raise PluginError(f"config key model.name: {cfg.model.name} returned {_kind(model)}, not a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):  # DDP's own error came from the kit, retried
        raise PluginError(f"config key model.name: {cfg.model.name} returned a module with no parameter that "
                          f"requires a gradient, so there is nothing to train (every parameter frozen, or none "
                          f"registered as an nn.Parameter)")
    return model


def build_task(cfg: Config):
    task = resolve("task", cfg.task.name)(**cfg.task.args)
    for method in ("loss", "evaluate"):
        if not callable(getattr(task, method, None)):
            raise PluginError(f"config key task.name: {cfg.task.name} has no {method}(model, batch) method; "
                              "a task needs loss() and evaluate()")
    return task
