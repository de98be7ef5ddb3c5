"""The documented overlay that runs a torchrun-style script as the RayJob's entrypoint
(docs/kubernetes.md, "Your torchrun-style script on the RayJob") renders on top of each overlay, is a
valid RayJob, and changes nothing but the entrypoint."""

from __future__ import annotations

import re
import shlex

import pytest
import yaml

from tests.support.k8s import OVERLAYS, REPO, one, render, render_user_overlay, validate_crd

DOCS = REPO / "docs" / "kubernetes.md"
SECTION = "### Your torchrun-style script on the RayJob"


def documented_overlay() -> str:
    text = DOCS.read_text()
    assert SECTION in text, f"{DOCS} has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n#", 1)[0]
    blocks = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, f"expected one kustomization in {SECTION!r}, found {len(blocks)}"
    return blocks[0]


@pytest.mark.parametrize("base", OVERLAYS)
def test_documented_script_overlay_replaces_only_the_entrypoint(base, tmp_path):
    kustomization = yaml.safe_load(documented_overlay())
    assert kustomization["resources"] == ["../gpu"]
    kustomization["resources"] = [f"../{base}"]
    objs = render_user_overlay(kustomization, "my-script", tmp_path)

    job = one(objs, "RayJob", "ray-app-train")
    validate_crd(job)
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:4] == ["ray-app", "run", "--config", "/etc/ray-app/config.yaml"], argv
    assert argv[4] == "/home/ray/project/train.py" and argv[5:] == ["--epochs", "10"], argv
    # the file the entrypoint reads: the ConfigMap's config.yaml, mounted in the head's pod (the driver's)
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    mounted = {m["name"] for c in head["containers"] for m in c.get("volumeMounts", []) if m["mountPath"] == "/etc/ray-app"}
    volumes = [v for v in head["volumes"] if v["name"] in mounted and "configMap" in v]
    assert len(volumes) == 1 and volumes[0]["configMap"]["name"] == "ray-app-config", head["volumes"]
    assert "config.yaml" in one(objs, "ConfigMap", "ray-app-config")["data"]

    # everything else is the base overlay's, object for object
    original = render(f"overlays/{base}")
    one(original, "RayJob", "ray-app-train")["spec"]["entrypoint"] = job["spec"]["entrypoint"]
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted(objs, key=key) == sorted(original, key=key)
