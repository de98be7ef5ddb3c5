"""The seam to Ray's private code holds against the installed Ray: each assumption checked, and a
broken one is named with what the kit does without it (what `make check-ray` prints)."""

from __future__ import annotations

import subprocess
import sys

from ray_app.shared import ray_seam


def test_every_assumption_of_the_seam_holds_against_the_installed_ray():
    assert len(ray_seam.ASSUMPTIONS) >= 10
    assert ray_seam.broken() == []


def test_a_missing_attribute_is_named_by_its_check(monkeypatch):
    from ray._private import node

    monkeypatch.delattr(node.Node, "start_monitor")
    broken = {a.item: problem for a, problem in ray_seam.broken()}
    assert broken == {"lean_local_ray": "ray._private.node has no Node.start_monitor"}


def test_check_ray_lists_every_item_and_exits_0():
    out = subprocess.run([sys.executable, "-m", "ray_app.shared.ray_seam"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"{len(ray_seam.ASSUMPTIONS)} of {len(ray_seam.ASSUMPTIONS)} assumptions hold" in out.stdout
    assert all(a.item in out.stdout for a in ray_seam.ASSUMPTIONS)
