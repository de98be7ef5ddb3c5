"""A Ray Train worker's surroundings without Ray, for the tests that call ``worker.worker_main`` in-process."""

from __future__ import annotations

from pathlib import Path

import pytest

from ray_app.worker import entry as worker


def worker_without_ray(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, runtime_class: type) -> Path:
    """``runtime_class`` stands in for ``worker.RayRuntime``, Ray's logging hooks stay off, the working directory
    is ``tmp_path``; returns the user's project folder, ``tmp_path/project`` (empty, not on sys.path)."""
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.setattr(worker, "RayRuntime", runtime_class)
    monkeypatch.setattr(worker, "_worker_logging", lambda: None)
    monkeypatch.setattr(worker._SHOWN_BY_THE_DRIVER, "active", False)
    monkeypatch.chdir(tmp_path)
    return project
