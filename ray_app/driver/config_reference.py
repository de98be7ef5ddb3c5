"""The config's keys for people and editors, read off the dataclass sections of ``ray_app.shared.config``.

- the key table: ``ray-app config keys`` (``--markdown``: the README's table rows);
- the JSON Schema of a config file: ``ray-app config schema``, committed as ``configs/schema.json``,
  which the YAML files name in their ``# yaml-language-server: $schema=...`` first line so editors
  complete keys and flag typos, wrong types, values out of range and choices not offered.

Neither can list a key the code does not have; the unit tests hold the README and the committed
schema to them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ray_app.shared.config import Config, field_types

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
_JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string", dict: "object"}


def sections() -> list[tuple[str, type]]:
    """(name, dataclass) of every config section, in the config's order."""
    return [(f.name, f.default_factory) for f in dataclasses.fields(Config)]


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def describe_keys() -> list[tuple[str, str, Any, str]]:
    """(key, type, default, help) for every key; the help of a key with choices ends with them."""
    rows = []
    for section, cls in sections():
        for f in dataclasses.fields(cls):
            help_text = f.metadata["help"]
            if f.metadata.get("choices"):
                help_text += f" One of: {', '.join(f.metadata['choices'])}."
            typ, optional = field_types(cls)[f.name]
            rows.append((f"{section}.{f.name}", typ.__name__ + (" | None" if optional else ""), _default(f), help_text))
    return rows


def format_default(value: Any) -> str:
    """A default as a YAML file would write it: ``false``, ``0.05``, ``""``, ``{}``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value or '""'
    if isinstance(value, dict):
        return json.dumps(value)
    return repr(value)


def keys_markdown() -> str:
    """The README's config table: a header and one row per key."""
    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    lines += [f"| `{key}` | {typ} | `{format_default(default)}` | {help_text} |"
              for key, typ, default, help_text in describe_keys()]
    return "\n".join(lines) + "\n"


def keys_text() -> str:
    """One aligned line per key: key, type, default, help."""
    rows = [(key, typ, format_default(default), help_text) for key, typ, default, help_text in describe_keys()]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "".join(f"{k:<{widths[0]}}  {t:<{widths[1]}}  {d:<{widths[2]}}  {h}\n" for k, t, d, h in rows)


def _key_schema(cls: type, f: dataclasses.Field) -> dict:
    meta = f.metadata
    typ, optional = field_types(cls)[f.name]
    schema = {"type": [_JSON_TYPES[typ], "null"] if optional else _JSON_TYPES[typ], "description": meta["help"],
              "default": _default(f)}
    if typ is dict:
        schema["additionalProperties"] = True  # a plug-in's keyword arguments: whatever it takes
    if meta.get("choices"):
        schema["enum"] = list(meta["choices"])
    for bound, word in (("min", "minimum"), ("max", "maximum")):
        if meta.get(bound) is not None:
            schema[word] = meta[bound]
    return schema | meta.get("schema", {})


def _section_schema(cls: type) -> dict:
    return {"type": ["object", "null"], "description": cls.__doc__, "additionalProperties": False,
            "properties": {f.name: _key_schema(cls, f) for f in dataclasses.fields(cls)}}


def config_schema() -> dict:
    """JSON Schema (draft 2020-12) of a config file: every section and key, unknown ones rejected."""
    return {
        "$schema": SCHEMA_DIALECT,
        "title": "ray-app run config",
        "description": f"{Config.__doc__} Printed by `ray-app config schema`; checks keys, types, ranges "
                       "and choices (ray-app also checks what spans keys, e.g. data.path for cifar10).",
        "type": "object",
        "additionalProperties": False,
        "properties": {name: _section_schema(cls) for name, cls in sections()},
    }


def schema_json() -> str:
    """``config_schema()`` as ``configs/schema.json`` holds it."""
    return json.dumps(config_schema(), indent=2) + "\n"
