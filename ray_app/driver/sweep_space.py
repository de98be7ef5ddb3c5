"""The space file of ``ray-app sweep``: config keys and their search domains, checked and drawn.

Pure: no Ray, no torch, so a bad space exits 2 well before a second. ``load_space`` reads a space file and
checks it against the config's own keys and types (``ray_app.shared.config``); ``draw_trials`` draws every trial's
values from ``run.seed`` alone (the grid's points in turn, the other domains at random); ``check_trials``
validates each trial's whole config as ``ray-app train`` validates one, plug-ins and metric included.
The sweep itself (Ray Tune, the record, resume) is ``ray_app.driver.sweep``.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import random
from dataclasses import dataclass, field
from typing import Any

from ray_app.shared.config import Config, config_from_dict, field_types
from ray_app.shared.errors import ConfigError

SPACE_KEYS = ("metric", "mode", "trials", "concurrent", "scheduler", "space")
SCHEDULERS = ("asha", "fifo")
DOMAINS = ("uniform", "loguniform", "randint", "choice", "grid")
SWEPT_BY_THE_SWEEP = ("run.name", "run.storage")  # the sweep names and places its trials itself
# the eval metrics of the built-in tasks (``ray_app.shared.tasks``, which imports torch; a unit test holds this to them)
BUILTIN_TASK_METRICS = {"classification": ("loss", "accuracy"), "regression": ("mse", "mae"),
                        "language_model": ("loss", "perplexity"),
                        "causal_lm": ("token_loss_sum", "target_tokens", "loss", "perplexity")}


@dataclass
class Domain:
    """One key's search domain: ``kind`` (uniform, loguniform, randint, choice, grid) and its values."""

    key: str
    kind: str
    values: list

    def draw(self, rng: random.Random):
        if self.kind == "uniform":
            return rng.uniform(*self.values)
        if self.kind == "loguniform":
            lo, hi = self.values
            return math.exp(rng.uniform(math.log(lo), math.log(hi)))
        if self.kind == "randint":
            return rng.randint(*self.values)  # both ends included
        return copy.deepcopy(rng.choice(self.values))


@dataclass
class Space:
    """A parsed space file."""

    metric: str
    mode: str
    trials: int
    concurrent: int
    scheduler: str
    grace_period: int = 1
    reduction_factor: float = 2.0
    domains: list[Domain] = field(default_factory=list)
    text: dict = field(default_factory=dict)  # the file as read: a resumed sweep must have the same

    @property
    def keys(self) -> list[str]:
        return [d.key for d in self.domains]

    @property
    def grid(self) -> list[dict]:
        """Every combination of the grid domains' values (one empty point when there are none)."""
        grids = [d for d in self.domains if d.kind == "grid"]
        return [dict(zip([d.key for d in grids], combo)) for combo in itertools.product(*[d.values for d in grids])]


def _where(path: str, key: str = "") -> str:
    return f"--space {path}" + (f": {key}" if key else "")


def load_space(path: str, cfg: Config) -> Space:
    """Read and check a space file against ``cfg`` (the sweep's base config); ConfigError, one line."""
    from ray_app.shared.config import read_config_file

    try:
        tree = read_config_file(path)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("--config", "--space", 1)) from None
    return parse_space(tree, cfg, path)


def parse_space(tree: Any, cfg: Config, path: str = "space") -> Space:
    if not isinstance(tree, dict):
        raise ConfigError(f"{_where(path)}: expected a mapping with {', '.join(SPACE_KEYS)}")
    unknown = [k for k in tree if k not in SPACE_KEYS]
    if unknown:
        raise ConfigError(f"{_where(path, str(unknown[0]))}: unknown key; a space file has {', '.join(SPACE_KEYS)}")
    for key in ("metric", "space"):
        if key not in tree:
            raise ConfigError(f"{_where(path, key)}: missing; see docs/sweeps.md for the file's shape")
    metric, mode = tree["metric"], tree.get("mode", "max")
    if not isinstance(metric, str) or not metric.startswith("eval_") or metric == "eval_":
        raise ConfigError(f"{_where(path, 'metric')}: {metric!r} is not an eval metric; name one the task reports, "
                          "e.g. eval_accuracy or eval_loss")
    if mode not in ("max", "min"):
        raise ConfigError(f"{_where(path, 'mode')}: {mode!r}; use max or min")
    trials = _count(tree.get("trials", 1), path, "trials")
    concurrent = _count(tree.get("concurrent", 1), path, "concurrent")
    scheduler, grace, factor = _scheduler(tree.get("scheduler", "fifo"), path)
    space_tree = tree["space"]
    if not isinstance(space_tree, dict) or not space_tree:
        raise ConfigError(f"{_where(path, 'space')}: expected a mapping of config keys to domains, e.g. "
                          "train.lr: {loguniform: [1.0e-4, 0.1]}")
    domains = [_domain(str(key), value, cfg, path) for key, value in space_tree.items()]
    space = Space(metric, mode, trials, concurrent, scheduler, grace, factor, domains, tree)
    points = len(space.grid)
    if trials < points:
        raise ConfigError(f"{_where(path, 'trials')}: {trials} is fewer than the {points} grid points of the space; "
                          f"set trials to at least {points} (a multiple of {points} covers each point as often)")
    return space


def _count(value: Any, path: str, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{_where(path, key)}: expected a whole number >= 1, got {value!r}")
    return value


def _scheduler(value: Any, path: str) -> tuple[str, int, float]:
    """``asha`` | ``fifo`` | ``{name: asha, grace_period: 1, reduction_factor: 2}``."""
    options = {}
    if isinstance(value, dict):
        options = dict(value)
        value = options.pop("name", None)
    if value not in SCHEDULERS:
        raise ConfigError(f"{_where(path, 'scheduler')}: {value!r}; use asha (early stopping) or fifo (every trial "
                          "to the end)")
    grace = options.pop("grace_period", 1)
    factor = options.pop("reduction_factor", 2)
    if options:
        raise ConfigError(f"{_where(path, 'scheduler.' + next(iter(options)))}: unknown; the scheduler takes name, "
                          "grace_period and reduction_factor")
    if value == "fifo" and (grace != 1 or factor != 2):
        raise ConfigError(f"{_where(path, 'scheduler')}: grace_period and reduction_factor are asha's; fifo stops "
                          "no trial")
    if isinstance(grace, bool) or not isinstance(grace, int) or grace < 1:
        raise ConfigError(f"{_where(path, 'scheduler.grace_period')}: expected epochs >= 1, got {grace!r}")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
        raise ConfigError(f"{_where(path, 'scheduler.reduction_factor')}: expected a number > 1, got {factor!r}")
    return value, grace, float(factor)


def key_type(key: str, cfg: Config) -> type | None:
    """The type of a config key (``dict`` for a whole ``args``), None for an entry of a plug-in's args
    (``model.args.hidden``: any value its signature takes). ConfigError for a key the config lacks."""
    parts = key.split(".")
    sections = list(cfg.to_dict())
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"space key {key}: expected section.key (or section.args.name), e.g. train.lr")
    section, name = parts[0], parts[1]
    if section not in sections:
        raise ConfigError(f"space key {key}: unknown config section {section!r}; known: {', '.join(sections)}")
    types = field_types(type(getattr(cfg, section)))
    if name not in types:
        raise ConfigError(f"space key {key}: unknown config key {section}.{name}; known keys in {section}: "
                          f"{', '.join(types)}")
    typ = types[name][0]
    if len(parts) > 2:
        if typ is not dict:
            raise ConfigError(f"space key {key}: {section}.{name} is not a mapping of arguments; use {section}.{name}")
        return None
    if key in SWEPT_BY_THE_SWEEP:
        raise ConfigError(f"space key {key}: the sweep sets it for each trial ({{run.storage}}/{{run.name}}/trial-NNN); "
                          "remove it from the space")
    return typ


_KIND_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping"}


def _domain(key: str, value: Any, cfg: Config, path: str) -> Domain:
    typ = key_type(key, cfg)
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in DOMAINS:
        raise ConfigError(f"space key {key}: expected one domain, {{kind: values}} with kind one of "
                          f"{', '.join(DOMAINS)}; got {value!r}")
    kind, values = next(iter(value.items()))
    if not isinstance(values, list) or not values:
        raise ConfigError(f"space key {key}: {kind} takes a list, e.g. {kind}: [1, 2]; got {values!r}")
    if kind in ("uniform", "loguniform", "randint"):
        _check_range(key, kind, values, typ)
    elif len(values) != len({json.dumps(v, sort_keys=True) for v in values}):
        raise ConfigError(f"space key {key}: {kind} lists a value twice; list each once")
    for v in values:
        _check_value(key, kind, v, typ, cfg)
    return Domain(key, kind, list(values))


def _check_range(key: str, kind: str, values: list, typ: type | None) -> None:
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)
    if len(values) != 2 or not numbers or not values[0] < values[1]:
        raise ConfigError(f"space key {key}: {kind} takes [low, high], two numbers with low < high; got {values!r}")
    if kind == "loguniform" and values[0] <= 0:
        raise ConfigError(f"space key {key}: loguniform needs low > 0; got {values[0]!r}")
    if kind == "randint" and not all(isinstance(v, int) for v in values):
        raise ConfigError(f"space key {key}: randint takes two integers [low, high] (both included); got {values!r}")
    if typ is not None and typ is not float and not (typ is int and kind == "randint"):
        what = "whole numbers" if kind == "randint" else "numbers with fractions"
        fix = "use randint or choice" if typ is int else "use choice or grid"
        raise ConfigError(f"space key {key}: {kind} draws {what}, but {key} is {_KIND_WORDS[typ]}; {fix}")


def _check_value(key: str, kind: str, value: Any, typ: type | None, cfg: Config) -> None:
    """One value (a choice, a grid point, a range's end) as the config would take it: its type and bounds."""
    tree = _with(cfg.to_dict(), key, value)
    try:
        config_from_dict(tree)
    except ConfigError as exc:
        text = str(exc).removeprefix("config: ")
        raise ConfigError(f"space key {key}: {kind} value {value!r}: {text}") from None


def _with(tree: dict, key: str, value: Any) -> dict:
    """A copy of a config tree with ``key`` (``section.key`` or ``section.args.name...``) set to ``value``."""
    out = copy.deepcopy(tree)
    node = out
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"space key {key}: {part} is not a mapping")
    node[parts[-1]] = copy.deepcopy(value)
    return out


def draw_trials(space: Space, seed: int) -> list[dict]:
    """Every trial's values, from ``seed`` alone: trial i takes grid point i mod (grid size) and a fresh draw
    of each other domain, keys in the space file's order."""
    rng = random.Random(seed)
    points = space.grid
    trials = []
    for i in range(space.trials):
        values = dict(points[i % len(points)])
        for d in space.domains:
            if d.kind != "grid":
                values[d.key] = d.draw(rng)
        trials.append({k: values[k] for k in space.keys})
    return trials


def trial_name(index: int) -> str:
    return f"trial-{index:03d}"


def trial_config(base: Config, values: dict, sweep_uri: str, index: int) -> Config:
    """Trial ``index``'s whole config: the base with the trial's values, its run under the sweep's folder, and
    its own Prometheus port (``metrics.port`` + index: trials that run at once on one node do not collide)."""
    tree = base.to_dict()
    for key, value in values.items():
        tree = _with(tree, key, value)
    tree["run"]["name"] = trial_name(index)
    tree["run"]["storage"] = sweep_uri
    tree["metrics"]["port"] = base.metrics.port + index if "metrics.port" not in values else values["metrics.port"]
    try:
        return config_from_dict(tree)
    except ConfigError as exc:
        shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
        raise ConfigError(f"{trial_name(index)} ({shown}): {str(exc).removeprefix('config: ')}") from None


def check_metric(space: Space, cfg: Config) -> None:
    """The metric against what a built-in task reports; a task of the user's own is checked at the trial's end."""
    task = cfg.task.name
    if task not in BUILTIN_TASK_METRICS:
        return
    names = [f"eval_{n}" for n in BUILTIN_TASK_METRICS[task]]
    if space.metric not in names:
        raise ConfigError(f"space key metric: task {task} reports {', '.join(names)}, not {space.metric}; "
                          "set metric to one of them")


def check_trials(space: Space, base: Config, sweep_uri: str) -> list[Config]:
    """Every trial's config validated as ``ray-app train`` validates one (keys, types, bounds, plug-ins, metric)."""
    from ray_app.shared.plugins import add_project_to_path, validate

    add_project_to_path(os.getcwd())
    configs, checked = [], set()
    for index, values in enumerate(draw_trials(space, base.run.seed)):
        cfg = trial_config(base, values, sweep_uri, index)
        plugins = json.dumps([getattr(cfg, k).name for k in ("data", "model", "task")] +
                             [getattr(cfg, k).args for k in ("data", "model", "task")], sort_keys=True, default=str)
        if plugins not in checked:
            try:
                validate(cfg)
            except ConfigError as exc:
                raise ConfigError(f"{trial_name(index)}: {exc}") from None
            checked.add(plugins)
        check_metric(space, cfg)
        configs.append(cfg)
    return configs
