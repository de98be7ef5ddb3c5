"""The deploy tier: static checks of what ships beside ray_app (k8s/, monitoring/, docker/, the CI scripts,
lint and packaging). No cluster, engine or Ray starts: kubectl kustomize, promtool, hadolint, ruff and
the schemas read the files. Each test here carries the ``deploy`` marker (``-m deploy`` / ``-m "not deploy"``)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.deploy)
