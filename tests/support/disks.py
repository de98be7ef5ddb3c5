"""A real full disk for a test: a tmpfs of a few MB mounted on a folder (root only; skipped elsewhere)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(folder: Path, size: str = "2M"):
    """``folder`` as a tmpfs of ``size`` for the ``with`` block (unmounted after): writes past it fail with
    ENOSPC as on a full disk. Skips the test where it cannot be mounted (not root, no tmpfs)."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def files_under(folder: Path) -> list[str]:
    """Every file under ``folder``, relative, sorted (what a failed write must not leave)."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
