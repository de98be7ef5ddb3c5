"""Config: defaults, shipped YAML files, --set parsing, and one-line errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from ray_app.config import Config, ConfigError, describe_keys, load_config, parse_override

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_defaults_are_valid_and_match_the_documented_default_run():
    cfg = load_config(None, [])
    assert isinstance(cfg, Config)
    assert (cfg.data.name, cfg.model.name, cfg.scaling.num_workers) == ("digits", "digits_cnn", 2)
    # ./runs, made absolute against the directory the command runs in (Ray workers run elsewhere)
    assert cfg.run.storage == str(Path.cwd() / "runs")
    assert cfg.metrics.port == 9500


def test_every_key_has_help_text():
    rows = describe_keys()
    assert len(rows) >= 30
    assert all(help_text.strip() for _, _, _, help_text in rows)
    documented = {"run.name", "run.seed", "run.storage", "data.name", "data.path", "data.batch_size",
                  "data.loader_workers", "model.name", "train.epochs", "train.lr", "train.optimizer",
                  "train.weight_decay", "train.warmup_epochs", "train.grad_accum", "train.clip_grad_norm",
                  "train.amp", "checkpoint.every_epochs", "checkpoint.every_steps", "checkpoint.keep",
                  "checkpoint.upload", "scaling.num_workers", "scaling.use_gpu", "scaling.cpus_per_worker",
                  "scaling.gpus_per_worker", "failure.max_failures", "metrics.enabled", "metrics.port"}
    assert documented <= {key for key, *_ in rows}


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
    ("data.name=mnist", "data.name"),
    ("checkpoint.upload=later", "checkpoint.upload"),
    ("run.name=../escape", "run.name"),
    ("data.name=cifar10", "data.path"),            # needs a path
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
        "train.amp=true", "run.name=my-run", "scaling.cpus_per_worker=2", "checkpoint.upload=async",
    ])
    assert cfg.train.epochs == 3 and isinstance(cfg.train.epochs, int)
    assert cfg.train.lr == 0.5 and cfg.train.weight_decay == pytest.approx(1e-4)
    assert isinstance(cfg.scaling.cpus_per_worker, float) and cfg.scaling.cpus_per_worker == 2.0
    assert cfg.scaling.use_gpu is False and cfg.train.amp is True
    assert cfg.run.name == "my-run" and cfg.checkpoint.upload == "async"


def test_later_set_wins():
    assert load_config(None, ["train.epochs=3", "train.epochs=7"]).train.epochs == 7


def test_parse_override_values():
    assert parse_override("train.epochs=5") == {"train": {"epochs": 5}}
    assert parse_override("train.lr=0.01") == {"train": {"lr": 0.01}}
    assert parse_override("train.amp=true") == {"train": {"amp": True}}
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
    from ray_app.config import config_from_dict

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


def test_readme_config_reference_matches_the_code():
    """The README's config table is the one `describe_keys()` gives: same keys, defaults and help."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = {line.split("|")[1].strip().strip("`"): line for line in readme.splitlines()
            if line.startswith("| `") and "." in line.split("|")[1]}
    for key, typ, _default, help_text in describe_keys():
        assert key in rows, f"README config table lacks {key}"
        cells = [c.strip() for c in rows[key].split("|")[1:-1]]
        assert cells[1] == typ, key
        assert cells[3].startswith(help_text), key
