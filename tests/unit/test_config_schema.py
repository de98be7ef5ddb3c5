"""The JSON Schema of config files: committed as printed, valid, naming every key, agreeing with load_config,
and named by every shipped config so editors use it."""

from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import pytest

from ray_app.driver.config_reference import config_schema, describe_keys, schema_json
from ray_app.shared.config import load_config, parse_yaml
from ray_app.shared.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
SCHEMA_FILE = REPO / "configs" / "schema.json"
CONFIG_FILES = sorted([*(REPO / "configs").glob("*.yaml"), *(REPO / "examples").glob("*/*.yaml"),
                       REPO / "k8s" / "base" / "config.yaml", REPO / "k8s" / "overlays" / "gpu" / "config.yaml"])
MODELINE = re.compile(r"# yaml-language-server: \$schema=(\S+)$")


def validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(config_schema())


def test_committed_schema_is_what_the_command_prints(run_cli):
    assert SCHEMA_FILE.read_text() == schema_json(), "configs/schema.json is stale: ray-app config schema > configs/schema.json"
    rc, out, err = run_cli(["config", "schema"], timeout=60)
    assert rc == 0, err
    assert out == SCHEMA_FILE.read_text()


def test_schema_is_a_valid_draft_2020_12_schema():
    schema = config_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)


def test_schema_has_every_key_with_type_default_and_help():
    schema = config_schema()
    assert schema["additionalProperties"] is False
    for key, typ, default, help_text in describe_keys():
        section, name = key.split(".")
        sec = schema["properties"][section]
        assert sec["additionalProperties"] is False and sec["description"], section
        prop = sec["properties"][name]
        assert prop["default"] == default and help_text.startswith(prop["description"]), key
        json_type = {"int": "integer", "float": "number", "bool": "boolean", "str": "string", "dict": "object"}[typ]
        assert prop["type"] == json_type or json_type in prop["type"], key  # a word or a number: both
    assert sum(len(s["properties"]) for s in schema["properties"].values()) == len(describe_keys())
    assert schema["properties"]["train"]["properties"]["optimizer"]["enum"] == ["sgd", "adamw"]
    assert schema["properties"]["metrics"]["properties"]["port"]["maximum"] == 65535


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[str(p.relative_to(REPO)) for p in CONFIG_FILES])
def test_every_shipped_and_example_config_is_valid_and_names_the_schema(path):
    tree = parse_yaml(path.read_text(), str(path))
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator().iter_errors(tree)]
    assert errors == [], errors
    first = path.read_text().splitlines()[0]
    if path.is_relative_to(REPO / "k8s"):  # byte-identical copies of configs/kind.yaml and configs/gpu.yaml
        return
    match = MODELINE.match(first)
    assert match, f"{path.name}: first line should be '# yaml-language-server: $schema=...'"
    assert (path.parent / match.group(1)).resolve() == SCHEMA_FILE


@pytest.mark.parametrize("text, key", [
    ("train:\n  learning_rate: 0.1\n", "train.learning_rate"),   # a typo
    ("optim:\n  lr: 0.1\n", "optim"),                            # an unknown section
    ("scaling:\n  num_workers: two\n", "scaling.num_workers"),   # a wrong type
    ("metrics:\n  enabled: 1\n", "metrics.enabled"),
    ("train:\n  epochs: 0\n", "train.epochs"),                   # below the minimum
    ("metrics:\n  port: 70000\n", "metrics.port"),               # above the maximum
    ("checkpoint:\n  upload: later\n", "checkpoint.upload"),     # not one of the choices
    ("model:\n  args: [128]\n", "model.args"),                   # args are a mapping
    ("data:\n  num_samples: 10\n", "data.num_samples"),          # moved to data.args
    ("train: 5\n", "train"),
    ("train:\n  replicate: some\n", "train.replicate"),            # a word that is not auto
])
def test_schema_rejects_what_load_config_rejects(tmp_path, text, key):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(f, [])
    assert list(validator().iter_errors(parse_yaml(text, "c.yaml"))), f"the schema accepts {text!r}"


@pytest.mark.parametrize("text", [
    "model:\n  name: acme.model:Net\n  args: {hidden: 8, layers: [1, {a: 2}], opt: {beta: 0.9}}\n",  # args: free
    "train:\nrun: {name: r1}\n",                                         # an empty section
    "train: {lr: 1, warmup_epochs: 2}\nscaling: {cpus_per_worker: 2}\n",  # integers where numbers go
    "{}\n",
    "train: {strategy: fsdp, replicate: 2}\n", "train: {strategy: fsdp, replicate: auto}\n",  # a number or a word
])
def test_schema_accepts_what_load_config_accepts(tmp_path, text):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    load_config(f, [])
    assert [e.message for e in validator().iter_errors(parse_yaml(text, "c.yaml"))] == []
