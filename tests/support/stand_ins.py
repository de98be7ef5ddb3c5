"""Keeps a hand-written fake honest: what it offers, the real object offers the same way.

A fake stands in for a real object (``ray``, ``ray.train``, Ray Train's context, ``worker.RayRuntime``,
a metrics sink). ``assert_stands_in_for(fake, real)`` fails when the real object loses or renames
something the fake offers, or takes its parameters otherwise (names, kinds, defaults, order): the fake
then no longer tests what production calls.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
BY_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def assert_stands_in_for(fake, real, own: Iterable[str] = ()) -> None:
    """Every public attribute that ``fake`` (a class, or an instance of one) defines exists on ``real``;
    a callable one takes the same parameters, a class one stands in for the real class of that name.
    ``own``: the fake's own helpers for the test (e.g. a ``drain`` that waits for its uploads)."""
    problems: list[str] = []
    _compare(fake, real, getattr(real, "__name__", type(real).__name__), set(own), problems)
    assert not problems, "the fake has drifted from the real object:\n" + "\n".join(problems)


def _compare(fake, real, where: str, own: set[str], problems: list[str]) -> None:
    cls = fake if inspect.isclass(fake) else type(fake)
    if inspect.isclass(fake) and "__init__" in vars(cls):
        problems += signature_problems(fake, real, where)
    for name in vars(cls):
        if name.startswith("_") or name in own:
            continue
        if not hasattr(real, name):
            problems.append(f"{where}.{name}: the fake has it, the real one does not")
            continue
        fake_attr, real_attr = getattr(fake, name), getattr(real, name)
        if inspect.isclass(fake_attr):
            _compare(fake_attr, real_attr, f"{where}.{name}", set(), problems)
        elif callable(fake_attr):
            problems += signature_problems(fake_attr, real_attr, f"{where}.{name}")


def signature_problems(fake, real, where: str) -> list[str]:
    """How ``fake``'s parameters differ from ``real``'s; a ``*args`` / ``**kwargs`` of the fake absorbs the
    real one's positional / keyword parameters it does not name."""
    fake_params, real_params = inspect.signature(fake).parameters, inspect.signature(real).parameters
    fake_kinds = {p.kind for p in fake_params.values()}
    real_kinds = {p.kind for p in real_params.values()}
    problems = []
    for name, p in fake_params.items():
        if p.kind in VARIADIC:
            continue
        r = real_params.get(name)
        if r is None:
            if inspect.Parameter.VAR_KEYWORD not in real_kinds or p.kind not in BY_KEYWORD:
                problems.append(f"{where}: the fake takes {name!r}, the real one does not")
        elif r.kind != p.kind:
            problems.append(f"{where}: {name!r} is {p.kind.description} in the fake, {r.kind.description} in the real one")
        elif not _same_default(p.default, r.default):
            problems.append(f"{where}: {name!r} defaults to {p.default!r} in the fake, {r.default!r} in the real one")
    for name, r in real_params.items():
        if name in fake_params or r.kind in VARIADIC:
            continue
        absorbed = (inspect.Parameter.VAR_KEYWORD in fake_kinds and r.kind in BY_KEYWORD) or \
                   (inspect.Parameter.VAR_POSITIONAL in fake_kinds and r.kind == inspect.Parameter.POSITIONAL_ONLY)
        if not absorbed:
            problems.append(f"{where}: the real one takes {name!r}, the fake does not")
    fake_order = [n for n, p in fake_params.items() if p.kind in POSITIONAL]
    real_order = [n for n, p in real_params.items() if p.kind in POSITIONAL and n in fake_order]
    if fake_order != real_order:
        problems.append(f"{where}: positional order {fake_order} in the fake, {real_order} in the real one")
    return problems


def _same_default(a, b) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 - a default without a usable ==
        return False
