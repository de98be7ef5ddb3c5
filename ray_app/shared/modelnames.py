"""torchvision's classifier names, known without importing torch.

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


def is_torchvision_classifier(name: str) -> bool:
    """Whether ``name`` is one of torchvision's classifiers (read from its sources; else ask it)."""
    known = torchvision_classifiers()
    if not known:
        try:
            import torchvision
        except Exception:
            return False
        known = frozenset(torchvision.models.list_models(module=torchvision.models))
    return name in known
