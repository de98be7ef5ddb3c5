"""Model names, checked without importing torch.

The driver checks ``model.name`` before it starts Ray; importing torch and torchvision for that would cost
it ~2 s of one core ahead of everything else. torchvision's classifiers are the functions its
``torchvision/models/*.py`` files decorate with ``@register_model()``; they are read from its sources
(tests/unit/test_models.py checks they are the names ``torchvision.models.list_models`` gives). Should
the sources not yield any, torchvision itself is asked.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

from ray_app.config import ConfigError

BUILTIN = ("digits_cnn", "mlp", "wide_mlp")

# @register_model() or @register_model(name="x"), then (other decorators) the def it names
_REGISTERED = re.compile(r"@register_model\(\s*(?:name\s*=\s*)?(?:[\"'](\w+)[\"'])?\s*\)(?:.|\n)*?\ndef\s+(\w+)")


@functools.cache
def torchvision_classifiers() -> frozenset[str]:
    """``torchvision.models.list_models(module=torchvision.models)``, from torchvision's sources."""
    try:
        spec = importlib.util.find_spec("torchvision")
    except (ImportError, ValueError):
        return frozenset()
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    names = set()
    for folder in spec.submodule_search_locations:
        for source in sorted((Path(folder) / "models").glob("*.py")):
            try:
                text = source.read_text(encoding="utf-8")
            except OSError:
                continue
            names |= {explicit or fn for explicit, fn in _REGISTERED.findall(text)}
    return frozenset(names)


def _asked_torchvision(name: str) -> frozenset[str]:
    try:
        import torchvision
    except Exception:
        raise ConfigError(f"config key model.name={name}: needs torchvision; use {', '.join(BUILTIN)}") from None
    return frozenset(torchvision.models.list_models(module=torchvision.models))


def validate_model_name(name: str) -> None:
    """Cheap check at config time (no model is built, torch is not imported)."""
    if name in BUILTIN:
        return
    known = torchvision_classifiers() or _asked_torchvision(name)
    if name not in known:
        raise ConfigError(f"config key model.name: unknown model {name!r}; use {', '.join(BUILTIN)} "
                          "or a torchvision classifier such as resnet18")
