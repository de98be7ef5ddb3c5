"""The files under k8s/ made from configs/ and monitoring/ (k8s/scripts/sync.sh):
`make render` / `make deploy` render an edited source at once without
writing to the tracked tree, and say which tracked copy is stale;
`make k8s-sync` rewrites the copies and says each one. Every test works on
a copy of the repository's Makefile, mk/, k8s/, configs/ and monitoring/ in
a temp folder, so nothing here touches the checkout."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.k8s import REPO, kubectl, make_env

RULES = "monitoring/rules/ray-app.rules.yml"
RULE_EXPR = "rate(ray_app_samples_processed_total[1m])"


@pytest.fixture
def checkout(tmp_path) -> Path:
    if not shutil.which("make"):
        pytest.skip("make not installed")
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy2(REPO / "Makefile", root / "Makefile")
    for folder in ("mk", "k8s", "configs", "monitoring"):
        shutil.copytree(REPO / folder, root / folder)
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted((root / "k8s").rglob("*")) if p.is_file()}


def make(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", "--no-print-directory", "-C", str(root), *args],
                          capture_output=True, text=True, timeout=120, env=make_env())


def edit_sources(root: Path) -> None:
    """A user's edits of the sources, as they are told to make them."""
    with open(root / "configs" / "kind.yaml", "a") as f:
        f.write("# edited by the user\n")
    rules = root / RULES
    assert RULE_EXPR in rules.read_text()
    rules.write_text(rules.read_text().replace(RULE_EXPR, RULE_EXPR.replace("[1m]", "[2m]")))


def test_sync_on_a_clean_checkout_rewrites_nothing(checkout):
    """The committed files are byte for byte what the script makes (the
    PrometheusRule included), so `make k8s-sync` on a clean checkout is silent."""
    before = snapshot(checkout)
    out = make(checkout, "k8s-sync")
    assert out.returncode == 0, out.stderr
    assert out.stderr == "" and snapshot(checkout) == before


def test_render_uses_the_edited_source_and_leaves_the_tracked_tree_as_it_is(checkout):
    kubectl()
    edit_sources(checkout)
    before = snapshot(checkout)
    out = make(checkout, "render")
    assert out.returncode == 0, out.stderr
    assert snapshot(checkout) == before, "make render rewrote files under k8s/"
    assert "# edited by the user" in out.stdout, "the RayJob's ConfigMap is not the edited configs/kind.yaml"
    assert "note: k8s/base/config.yaml differs from configs/kind.yaml" in out.stderr
    assert "make k8s-sync" in out.stderr
    assert "configs/gpu.yaml" not in out.stderr, "a note for a copy that is not stale"
    # deploy's other renders (k8s/monitoring) read the same fresh tree
    rule = (checkout / "build" / "k8s-tree" / "monitoring" / "prometheusrule.ray-app.yaml").read_text()
    assert "ray_app_samples_processed_total[2m]" in rule
    assert "note: k8s/monitoring/prometheusrule.ray-app.yaml differs from " + RULES in out.stderr


def test_deploy_and_kind_up_render_from_the_fresh_tree():
    for target in ("deploy", "kind-up"):
        out = subprocess.run(["make", "-n", "-C", str(REPO), target], capture_output=True, text=True,
                             timeout=60, env=make_env())
        assert out.returncode == 0, out.stderr
        assert "sync.sh --tree build/k8s-tree" in out.stdout and "K8S_TREE=build/k8s-tree" in out.stdout, target
        assert "k8s/scripts/sync.sh" not in out.stdout.splitlines(), f"make {target} would rewrite the tracked copies"


def test_k8s_sync_rewrites_the_stale_copies_and_says_each_one(checkout):
    kubectl()
    edit_sources(checkout)
    out = make(checkout, "k8s-sync")
    assert out.returncode == 0, out.stderr
    assert sorted(out.stderr.splitlines()) == [
        "k8s-sync: k8s/base/config.yaml <- configs/kind.yaml",
        f"k8s-sync: k8s/monitoring/prometheusrule.ray-app.yaml <- {RULES}",
    ]
    assert (checkout / "k8s/base/config.yaml").read_bytes() == (checkout / "configs/kind.yaml").read_bytes()
    again = make(checkout, "render")
    assert again.returncode == 0 and "note:" not in again.stderr, again.stderr
