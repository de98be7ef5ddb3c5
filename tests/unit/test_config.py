"""Config: defaults, shipped YAML files, --set parsing, and one-line errors that name the key."""

from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path
from typing import Any, Optional

import pytest
import yaml

from ray_app.driver.config_reference import describe_keys, format_default, keys_markdown, sections
from ray_app.shared.config import Config, config_from_dict, load_config, parse_override
from ray_app.shared.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_every_default_is_a_value_its_key_accepts():
    """A run without a config file uses the defaults as they are (load_config checks only what a file or --set
    gives), so each must pass its own key's checks (type, bounds, choices), as if a file had given it."""
    from ray_app.shared.config import config_from_dict

    defaults = Config()
    assert config_from_dict(defaults.to_dict()) == defaults  # every key through the checks a file's values get


def test_every_key_has_help_text_and_the_help_names_its_choices():
    rows = describe_keys()
    assert len(rows) >= 30
    for key, _typ, _default, help_text in rows:
        assert help_text.strip(), key
    for section, cls in sections():
        for f in dataclasses.fields(cls):
            if f.metadata.get("choices"):
                (help_text,) = [h for k, *_, h in rows if k == f"{section}.{f.name}"]
                assert help_text.endswith(f"One of: {', '.join(f.metadata['choices'])}."), f"{section}.{f.name}"


def test_local_yaml_is_shipped():
    assert (REPO / "configs" / "local.yaml").is_file()


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads(path):
    cfg = load_config(path, [])
    assert cfg.run.name and cfg.scaling.num_workers >= 1


def test_local_yaml_is_the_default_run():
    cfg = load_config(REPO / "configs" / "local.yaml", [])
    assert cfg.data.name == "digits" and cfg.scaling.num_workers == 2 and not cfg.scaling.use_gpu
    assert cfg.run.storage == str(Path.cwd() / "runs") and cfg.train.epochs == 10


def test_relative_local_paths_resolve_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["run.storage=out/runs", "data.name=imagefolder", "data.path=data",
                             "run.resume_from=old/run"])
    assert cfg.run.storage == str(tmp_path / "out" / "runs")
    assert cfg.data.path == str(tmp_path / "data") and cfg.run.resume_from == str(tmp_path / "old" / "run")
    s3 = load_config(None, ["run.storage=s3://bucket/prefix"])
    assert s3.run.storage == "s3://bucket/prefix"  # URIs are left alone


@pytest.mark.parametrize("override, key", [
    ("trian.epochs=3", "trian"),                   # unknown section
    ("train.epoch=3", "train.epoch"),              # unknown key
    ("train.epochs=abc", "train.epochs"),          # wrong type
    ("train.epochs=2.5", "train.epochs"),          # float for an int
    ("train.lr=fast", "train.lr"),
    ("scaling.use_gpu=maybe", "scaling.use_gpu"),  # not a bool
    ("metrics.enabled=1", "metrics.enabled"),      # an int is not a bool
    ("train.epochs=0", "train.epochs"),            # out of range
    ("train.epochs=-1", "train.epochs"),
    ("data.batch_size=0", "data.batch_size"),
    ("metrics.port=70000", "metrics.port"),
    ("metrics.port=0", "metrics.port"),
    ("train.momentum=1.5", "train.momentum"),
    ("train.optimizer=rmsprop", "train.optimizer"),  # bad choice
    # data.name=mnist: any name may be an import path, so unknown names are plugins.validate's (test_plugins)
    ("checkpoint.upload=later", "checkpoint.upload"),
    ("run.name=../escape", "run.name"),
    ("data.name=cifar10", "data.path"),            # needs a path
    ("model.args=5", "model.args"),                # args must be a mapping
    ("task.args=[1]", "task.args"),
])
def test_bad_override_raises_config_error_naming_the_key(override, key):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [override])
    msg = str(exc.value)
    assert key in msg
    assert "\n" not in msg


def test_bad_choice_lists_the_allowed_values():
    with pytest.raises(ConfigError, match="sgd, adamw"):
        load_config(None, ["train.optimizer=rmsprop"])


def test_unknown_key_in_yaml_names_file_and_key(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  epochs: 3\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError) as exc:
        load_config(f, [])
    assert "train.learning_rate" in str(exc.value) and str(f) in str(exc.value)


def test_unknown_section_in_yaml(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("optim:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match="optim"):
        load_config(f, [])


def test_wrong_type_in_yaml(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("scaling:\n  num_workers: two\n")
    with pytest.raises(ConfigError, match="scaling.num_workers"):
        load_config(f, [])


def test_malformed_yaml_names_the_file_and_line(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  epochs: [1, 2\nrun: {}\n")
    with pytest.raises(ConfigError) as exc:
        load_config(f, [])
    assert str(f) in str(exc.value) and "line" in str(exc.value)


@pytest.mark.parametrize("text, key, lines", [
    ("train:\n  epochs: 2\n  epochs: 3\n", "train.epochs", "lines 2 and 3"),
    ("train:\n  epochs: 2\nrun: {}\ntrain:\n  lr: 0.1\n", "key train ", "lines 1 and 4"),
    ("model:\n  args:\n    opt: {beta: 0.9, beta: 0.5}\n", "model.args.opt.beta", "line 3"),
    ("data:\n  args:\n    sizes:\n      - {a: 1}\n      - {a: 1,\n         a: 2}\n", "data.args.sizes[1].a", "lines 5 and 6"),
])
def test_a_key_given_twice_in_yaml_names_file_key_and_lines(tmp_path, text, key, lines):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(f, [])
    msg = str(exc.value)
    assert str(f) in msg and key in msg and lines in msg and "twice" in msg and "\n" not in msg


def test_yaml_merge_keys_override_without_being_duplicates(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  args:\n    <<: {hidden: 8, depth: 2}\n    hidden: 16\n")
    assert load_config(f, []).model.args == {"hidden": 16, "depth": 2}


def test_a_key_given_twice_in_a_set_value():
    with pytest.raises(ConfigError, match=r"--set .*model\.args\.a is given twice"):
        load_config(None, ["model.args={a: 1, a: 2}"])


def test_a_file_that_is_not_utf8_names_the_byte_and_the_fix(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_bytes("run:\n  name: caf".encode() + b"\xe9\n")  # Latin-1
    with pytest.raises(ConfigError) as exc:
        load_config(f, [])
    msg = str(exc.value)
    assert str(f) in msg and "byte 16" in msg and "line 2" in msg and "save the file as UTF-8" in msg


def test_utf8_text_and_a_byte_order_mark_are_read(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_bytes("\ufeffrun:\n  name: café\n".encode())
    with pytest.raises(ConfigError, match="run.name"):  # read as text, then rejected as a run name
        load_config(f, [])
    f.write_bytes("\ufeff# données\ntrain:\n  epochs: 4\n".encode())
    assert load_config(f, []).train.epochs == 4


def test_section_that_is_not_a_mapping(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train: 5\n")
    with pytest.raises(ConfigError, match="train"):
        load_config(f, [])


def test_missing_config_file_raises(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml", [])


def test_set_overrides_yaml_and_parses_scalars():
    cfg = load_config(REPO / "configs" / "local.yaml", [
        "train.epochs=3", "train.lr=0.5", "train.weight_decay=1e-4", "scaling.use_gpu=false",
        "train.compile=true", "run.name=my-run", "scaling.cpus_per_worker=2", "checkpoint.upload=async",
    ])
    assert cfg.train.epochs == 3 and isinstance(cfg.train.epochs, int)
    assert cfg.train.lr == 0.5 and cfg.train.weight_decay == pytest.approx(1e-4)
    assert isinstance(cfg.scaling.cpus_per_worker, float) and cfg.scaling.cpus_per_worker == 2.0
    assert cfg.scaling.use_gpu is False and cfg.train.compile is True
    assert cfg.run.name == "my-run" and cfg.checkpoint.upload == "async"


def test_later_set_wins():
    assert load_config(None, ["train.epochs=3", "train.epochs=7"]).train.epochs == 7


def test_parse_override_values():
    assert parse_override("train.epochs=5") == {"train": {"epochs": 5}}
    assert parse_override("train.lr=0.01") == {"train": {"lr": 0.01}}
    assert parse_override("train.compile=true") == {"train": {"compile": True}}
    assert parse_override("run.name=abc") == {"run": {"name": "abc"}}
    assert parse_override("data.path=") == {"data": {"path": ""}}
    # only the first '=' splits: the rest belongs to the value
    assert parse_override("run.resume_from=s3://b/p/run?x=1") == {"run": {"resume_from": "s3://b/p/run?x=1"}}
    assert parse_override("run.name=a=b") == {"run": {"name": "a=b"}}


def test_numeric_looking_string_value_stays_usable():
    # a run name of digits is still a string
    assert load_config(None, ["run.name=123"]).run.name == "123"


@pytest.mark.parametrize("text", ["train.epochs", "epochs=3", "a.b.c=1", ".x=1"])
def test_malformed_set_is_rejected(text):
    with pytest.raises(ConfigError, match="--set"):
        load_config(None, [text])


def test_storage_local_and_s3_accepted():
    assert load_config(None, ["run.storage=/tmp/runs"]).run.storage == "/tmp/runs"
    assert load_config(None, ["run.storage=s3://bucket/prefix"]).run.storage == "s3://bucket/prefix"
    assert load_config(None, ["run.storage=s3://bucket"]).run.storage == "s3://bucket"


@pytest.mark.parametrize("uri, fragment", [("s3://", "no bucket"), ("s3:///prefix", "no bucket"),
                                           ("gs://bucket/prefix", "not supported"),
                                           ("http://host/x", "not supported")])
def test_storage_rejected(uri, fragment):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [f"run.storage={uri}"])
    assert "run.storage" in str(exc.value) and fragment in str(exc.value)


def test_gpu_needs_positive_gpus_per_worker():
    with pytest.raises(ConfigError, match="scaling.gpus_per_worker"):
        load_config(None, ["scaling.use_gpu=true", "scaling.gpus_per_worker=0"])


def test_to_dict_round_trips():
    from ray_app.shared.config import config_from_dict

    cfg = load_config(None, ["train.epochs=4", "run.name=x"])
    assert config_from_dict(cfg.to_dict()) == cfg


def test_exponent_floats_are_numbers_in_set_and_yaml(tmp_path):
    # PyYAML (YAML 1.1) reads 1e-4 without a dot as a string; a user means a number
    cfg = load_config(None, ["train.weight_decay=1e-4", "train.lr=5e-3"])
    assert cfg.train.weight_decay == pytest.approx(1e-4) and cfg.train.lr == pytest.approx(5e-3)
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lr: 1e-3\n")
    assert load_config(f, []).train.lr == pytest.approx(1e-3)


@pytest.mark.parametrize("value", [".nan", ".inf", "nan", "inf"])
def test_non_finite_numbers_are_rejected(value):
    with pytest.raises(ConfigError, match="train.lr"):
        load_config(None, [f"train.lr={value}"])


def test_string_keys_are_taken_as_written():
    assert load_config(None, ["run.name=007"]).run.name == "007"
    assert load_config(None, ["run.name=true"]).run.name == "true"


def readme_config_rows() -> dict[str, tuple[str, str, str]]:
    """{key: (type, default, meaning)} of the README's "## Configuration" table."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    lines = section.splitlines()
    start = lines.index("| key | type | default | meaning |")
    assert lines[start + 1] == "| --- | --- | --- | --- |"
    table = list(itertools.takewhile(lambda line: line.startswith("|"), lines[start + 2:]))
    rows = {}
    for line in table:  # every row of the table, not only those that look right: none is skipped unread
        m = re.fullmatch(r"\| `([^`]+)` \| (\w+) \| `(.*?)` \| (.*) \|", line)
        assert m, f"README config table: {line!r} is not a `key` | type | `default` | meaning row"
        assert m.group(1) not in rows, f"README config table: {m.group(1)} has two rows"
        rows[m.group(1)] = m.group(2, 3, 4)
    return rows


def test_readme_config_table_has_every_key_with_its_type_default_and_help():
    """Row by row: a key the code lacks, a key the README lacks, another default or help all fail."""
    documented = readme_config_rows()
    code = {key: (typ, format_default(default), help_text) for key, typ, default, help_text in describe_keys()}
    hint = "regenerate the table with `ray-app config keys --markdown`"
    assert sorted(documented.keys() - code.keys()) == [], f"README documents keys the code does not have; {hint}"
    assert sorted(code.keys() - documented.keys()) == [], f"README lacks keys; {hint}"
    for key in code:
        assert documented[key] == code[key], f"{key}: README row differs from the code; {hint}"
    assert f"\n{keys_markdown()}" in (REPO / "README.md").read_text(), f"rows out of the code's order; {hint}"


def test_documented_defaults_are_what_a_run_without_config_gets(tmp_path, monkeypatch):
    """Each default, written as in the README, is the value load_config gives when no file or --set names it
    (local paths made absolute against the working directory)."""
    monkeypatch.chdir(tmp_path)
    loaded = load_config(None, []).to_dict()
    absolute = {"run.storage": str(tmp_path / "runs")}
    for key, (_typ, default, _help) in readme_config_rows().items():
        section, name = key.split(".")
        expected = absolute.get(key, "" if default == '""' else yaml.safe_load(default))
        if _typ == "str" and not isinstance(expected, str):  # a word-or-number key takes 1 as "1" (train.replicate)
            expected = str(expected)
        assert loaded[section][name] == expected, key


# ---------------------------------------------------------------- plug-in args and task

def test_plugin_sections_default_to_the_builtin_example():
    cfg = load_config(None, [])
    assert (cfg.task.name, cfg.task.args, cfg.model.args, cfg.data.args) == ("classification", {}, {}, {})
    assert Config().model.args is not Config().model.args  # one dict per config, never shared


def test_set_args_merges_one_argument_into_the_yaml_args(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  name: acme.model:Net\n  args: {hidden: 128, depth: 3, opt: {beta: 0.9, eps: 1.0e-8}}\n"
                 "data:\n  name: synthetic\n  args: {image_size: 16}\n")
    cfg = load_config(f, ["model.args.hidden=256", "model.args.opt.beta=0.5", "data.args.num_samples=10",
                          "task.args.label_smoothing=0.1"])
    assert cfg.model.name == "acme.model:Net"
    assert cfg.model.args == {"hidden": 256, "depth": 3, "opt": {"beta": 0.5, "eps": 1e-8}}
    assert cfg.data.args == {"image_size": 16, "num_samples": 10}
    assert isinstance(cfg.data.args["num_samples"], int) and cfg.task.args == {"label_smoothing": 0.1}
    # the YAML file alone is untouched by another load
    assert load_config(f, []).model.args == {"hidden": 128, "depth": 3, "opt": {"beta": 0.9, "eps": 1e-8}}


def test_set_whole_args_replaces_them(tmp_path):
    """``--set model.args={...}`` is the whole mapping (``{}`` clears what the file gave); one argument merges."""
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  args: {hidden: 128, depth: 3}\n")
    assert load_config(f, ["model.args={}"]).model.args == {}
    assert load_config(f, ["model.args={width: 8}"]).model.args == {"width": 8}
    assert load_config(f, ["model.args={width: 8}", "model.args.depth=2"]).model.args == {"width": 8, "depth": 2}
    from ray_app.shared.config import config_from_dict

    saved = load_config(f, []).to_dict()
    assert config_from_dict(saved, ["model.args={}"]).model.args == {}
    assert config_from_dict(saved, ["model.args.depth=1"]).model.args == {"hidden": 128, "depth": 1}


def test_set_args_values_are_yaml_scalars():
    assert parse_override("data.args.num_samples=10") == {"data": {"args": {"num_samples": 10}}}
    assert parse_override("model.args.dropout=0.25") == {"model": {"args": {"dropout": 0.25}}}
    assert parse_override("model.args.bias=false") == {"model": {"args": {"bias": False}}}
    assert parse_override("data.args.root=/data/x") == {"data": {"args": {"root": "/data/x"}}}
    assert parse_override("model.args.sizes=[1, 2]") == {"model": {"args": {"sizes": [1, 2]}}}
    assert parse_override("model.args.a.b=1") == {"model": {"args": {"a": {"b": 1}}}}
    cfg = load_config(None, ["data.name=synthetic", "data.args.num_samples=10", "data.args.image_size=8"])
    assert cfg.data.args == {"num_samples": 10, "image_size": 8}
    assert type(cfg.data.args["num_samples"]) is int


def test_args_must_be_a_mapping_with_argument_names(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  args: [128]\n")
    with pytest.raises(ConfigError, match="config key model.args") as exc:
        load_config(f, [])
    assert "mapping" in str(exc.value) and "\n" not in str(exc.value)
    f.write_text("model:\n  args: {1: 2}\n")
    with pytest.raises(ConfigError, match="config key model.args"):
        load_config(f, [])
    f.write_text("model:\n  args: {not-a-name: 2}\n")
    with pytest.raises(ConfigError, match="config key model.args"):
        load_config(f, [])
    # only args take a third part: section.key.sub is still malformed elsewhere
    with pytest.raises(ConfigError, match="--set"):
        load_config(None, ["model.name.x=1"])


def test_old_data_keys_are_unknown_in_new_configs():
    """data.num_samples / data.image_size moved to data.args; a new config naming them fails on the key."""
    with pytest.raises(ConfigError, match="data.num_samples"):
        load_config(None, ["data.num_samples=10"])


def test_config_from_dict_migrates_old_data_keys():
    """A checkpoint saved before data.args: its data.num_samples / image_size become the factory's args."""
    from ray_app.shared.config import config_from_dict

    old = Config().to_dict()
    old["data"] = {k: v for k, v in old["data"].items() if k != "args"}
    synthetic = config_from_dict({**old, "data": {**old["data"], "name": "synthetic", "num_samples": 100,
                                                  "image_size": 16}})
    assert synthetic.data.args == {"num_samples": 100, "image_size": 16}
    folder = config_from_dict({**old, "data": {**old["data"], "name": "imagefolder", "path": "/d",
                                               "num_samples": 2048, "image_size": 64}})
    assert folder.data.args == {"image_size": 64}  # imagefolder never took num_samples
    digits = config_from_dict({**old, "data": {**old["data"], "num_samples": 2048, "image_size": 32}})
    assert digits.data.args == {}  # digits took neither
    # no task section in an old config: the classification it trained
    assert config_from_dict({k: v for k, v in old.items() if k != "task"}).task.name == "classification"


def test_config_from_dict_applies_overrides_over_the_saved_args():
    from ray_app.shared.config import config_from_dict

    saved = load_config(None, ["model.args.width=8", "model.args.dropout=0.2"]).to_dict()
    cfg = config_from_dict(saved, ["model.args.width=4", "scaling.num_workers=1"])
    assert cfg.model.args == {"width": 4, "dropout": 0.2} and cfg.scaling.num_workers == 1
    with pytest.raises(ConfigError, match="train.epochs"):
        config_from_dict(saved, ["train.epochs=0"])


@pytest.mark.parametrize("change, key", [
    ("model.name=mlp", "model.name"),
    ("model.args.width=8", "model.args"),
    ("data.name=synthetic", "data.name"),
    ("data.args.num_samples=64", "data.args"),
    ("task.name=regression", "task.name"),
    ("task.args.label_smoothing=0.1", "task.args"),
    ("run.seed=1", "run.seed"),
    ("data.batch_size=64", "data.batch_size"),
    ("train.grad_accum=2", "train.grad_accum"),
    ("train.optimizer=adamw", "train.optimizer"),
])
def test_resume_conflicts_name_what_the_checkpoint_depends_on(change, key):
    from ray_app.shared.config import RESUME_MUST_MATCH, resume_conflicts

    assert key in RESUME_MUST_MATCH
    saved = load_config(None, []).to_dict()
    conflicts = resume_conflicts(saved, load_config(None, [change]))
    assert len(conflicts) == 1 and conflicts[0].startswith(f"{key} ("), conflicts
    assert "->" in conflicts[0]


def test_resume_conflicts_ignore_what_may_change_on_resume():
    from ray_app.shared.config import resume_conflicts

    saved = load_config(None, []).to_dict()
    changed = load_config(None, ["train.epochs=50", "train.lr=0.3", "train.max_steps=7", "train.warmup_epochs=2",
                                 "checkpoint.every_epochs=2", "checkpoint.every_steps=10", "checkpoint.keep=5",
                                 "checkpoint.upload=async", "failure.max_failures=9", "metrics.enabled=false",
                                 "data.loader_workers=2", "scaling.cpus_per_worker=2", "run.storage=/elsewhere",
                                 "scaling.num_workers=3"])  # the loop re-shards the rest of the epoch
    assert resume_conflicts(saved, changed) == []
    assert resume_conflicts(saved, load_config(None, [])) == []


def test_resume_conflicts_read_old_checkpoints_configs():
    """A checkpoint saved before data.args / task: its data.num_samples is the same run as data.args.num_samples."""
    from ray_app.shared.config import resume_conflicts

    now = load_config(None, ["data.name=synthetic", "data.args.num_samples=100", "data.args.image_size=16"])
    old = now.to_dict()
    del old["task"]
    old["data"] = {k: v for k, v in old["data"].items() if k != "args"}
    old["data"].update(num_samples=100, image_size=16)
    assert resume_conflicts(old, now) == []
    old["data"]["num_samples"] = 200
    assert [c.split(" ")[0] for c in resume_conflicts(old, now)] == ["data.args"]


@dataclasses.dataclass
class _SectionWithModernAnnotations:
    """A section as a later field may be written: a parametrized dict, an optional int (string annotations:
    this module has ``from __future__ import annotations`` as ray_app.shared.config has)."""

    name: str = "x"
    args: dict[str, Any] = dataclasses.field(default_factory=dict)
    limit: int | None = None
    ratio: Optional[float] = None  # noqa: UP045 - the older spelling resolves the same way


@pytest.mark.timeout(30)
def test_config_keys_are_typed_by_their_resolved_annotations_not_their_text():
    from ray_app.shared import config

    cfg = Config()
    cfg.task = _SectionWithModernAnnotations()
    config._apply(cfg, {"task": {"args": {"a": 1}, "limit": 3, "ratio": 1}}, "test")
    assert (cfg.task.args, cfg.task.limit, cfg.task.ratio) == ({"a": 1}, 3, 1.0)
    config._apply(cfg, {"task": {"limit": None}}, "test")
    assert cfg.task.limit is None
    with pytest.raises(ConfigError, match="task.limit: expected an integer"):
        config._apply(cfg, {"task": {"limit": "many"}}, "test")
    with pytest.raises(ConfigError, match="task.args: expected a mapping"):
        config._apply(cfg, {"task": {"args": [1]}}, "test")
    assert config.field_types(_SectionWithModernAnnotations) == {
        "name": (str, False), "args": (dict, False), "limit": (int, True), "ratio": (float, True)}


def test_a_saved_config_with_train_amp_resolves_to_its_precision_and_takes_overrides():
    """A checkpoint's config from before train.precision (train.amp only) means bf16-mixed; an override of
    train.precision (ray-app eval --set) changes it without a conflict; a config the driver resolved (both keys)
    round-trips as it is."""
    old = config_from_dict({"train": {"amp": True}})
    assert old.train.precision == "bf16-mixed" and old.train.amp is False
    assert config_from_dict({"train": {"amp": True}}, ["train.precision=fp32"]).train.precision == "fp32"
    resolved = load_config(None, ["train.amp=true"])
    assert config_from_dict(resolved.to_dict()).train.precision == "bf16-mixed"
    assert config_from_dict(resolved.to_dict(), ["train.amp=false"]).train.precision == "fp32"
