"""What the k8s tests (tests/deploy/test_k8s_*.py) share: render with kustomize, a
user's overlay on a copy of k8s/, find pod specs, validate custom resources against
the CRD schemas of ../shared/schemas."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
# kustomize Components (k8s/components/*): each is rendered on top of the gpu
# overlay, where the docs tell users to enable it ("overlays/gpu+components/NAME").
COMPONENTS = sorted(p.parent.name for p in (K8S / "components").glob("*/kustomization.yaml"))
COMPOSED = [f"overlays/gpu+components/{c}" for c in COMPONENTS]
# Every kustomization a user (or `make`) renders.
KUSTOMIZATIONS = ["namespace", "admission", "base", *(f"overlays/{o}" for o in OVERLAYS), *COMPOSED, "monitoring", "kind/minio"]
DEPLOYABLE = ["base", *(f"overlays/{o}" for o in OVERLAYS)]
NAMESPACE = "ray-app"
APP_LABEL = {"app.kubernetes.io/name": "ray-app"}

# CRD kinds validated against ../shared/schemas (file, group) instead of kubernetes-validate.
CRD_FILES = {
    "RayJob": "ray.io_rayjobs.yaml",
    "RayCluster": "ray.io_rayclusters.yaml",
    "RayService": "ray.io_rayservices.yaml",
    "PodMonitor": "monitoring.coreos.com_podmonitors.yaml",
    "ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml",
}


def kubectl() -> str:
    """The kubectl binary, or skip (fail with REQUIRE_KUBECTL=1, as CI sets)."""
    path = shutil.which("kubectl")
    if path:
        return path
    if os.environ.get("REQUIRE_KUBECTL") == "1":
        pytest.fail("kubectl (with kustomize) is required: REQUIRE_KUBECTL=1")
    pytest.skip("kubectl not installed: the k8s/ manifests cannot be rendered here")


def _composed_dir(rel: str) -> Path:
    """A kustomization under build/ with the overlay and the components of
    "overlays/X+components/Y+...": kustomize takes neither absolute paths nor
    files outside its root, so it lives in the repository like make's."""
    base, *components = rel.split("+")
    directory = REPO / "build" / "k8s" / ("test-" + rel.replace("/", "-").replace("+", "--"))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [f"../../../k8s/{base}"], "components": [f"../../../k8s/{c}" for c in components],
    }))
    return directory


@functools.lru_cache(maxsize=None)
def _render_cached(rel: str) -> tuple[str, ...]:
    directory = _composed_dir(rel) if "+" in rel else K8S / rel
    out = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    if out.returncode != 0:
        raise AssertionError(f"kubectl kustomize k8s/{rel} failed:\n{out.stderr}")
    return tuple(yaml.safe_dump(d) for d in yaml.safe_load_all(out.stdout) if d)


def render(rel: str) -> list[dict]:
    """The objects of `kubectl kustomize k8s/<rel>` (fresh copies each call)."""
    return [yaml.safe_load(text) for text in _render_cached(rel)]


def render_user_overlay(kustomization: dict, name: str, tmp_path: Path) -> list[dict]:
    """The objects of a user's own overlay ``k8s/overlays/<name>`` (as the docs show it), rendered in a copy
    of k8s/ under ``tmp_path``; a failed render fails the test with kustomize's message."""
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    (tree / "overlays" / name).mkdir()
    (tree / "overlays" / name / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    out = subprocess.run([kubectl(), "kustomize", str(tree / "overlays" / name)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr  # a `test` op fails here when an entry it patches has moved
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_specs(obj, where: str = "") -> list[tuple[str, dict]]:
    """Every pod spec inside an object, wherever it is nested: a dict with a
    list of containers. Covers Deployments, Jobs, and a RayJob's head, worker
    groups and submitter template alike."""
    found = []
    if isinstance(obj, dict):
        if isinstance(obj.get("containers"), list) and all(isinstance(c, dict) for c in obj["containers"]):
            found.append((where or "/", obj))
        for key, value in obj.items():
            found += pod_specs(value, f"{where}/{key}")
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            found += pod_specs(value, f"{where}/{i}")
    return found


def all_containers(spec: dict) -> list[tuple[str, dict]]:
    return [(kind, c) for kind in ("initContainers", "containers", "ephemeralContainers") for c in spec.get(kind) or []]


def rayjob_templates(rayjob: dict) -> dict[str, dict]:
    """{'head': template, 'workers/<group>': template, 'submitter': template}."""
    spec = rayjob["spec"]
    out = {"head": spec["rayClusterSpec"]["headGroupSpec"]["template"]}
    for group in spec["rayClusterSpec"].get("workerGroupSpecs", []):
        out[f"workers/{group['groupName']}"] = group["template"]
    if "submitterPodTemplate" in spec:
        out["submitter"] = spec["submitterPodTemplate"]
    return out


def shared_dir() -> Path | None:
    """../shared beside the clone (CI and these machines), or $SHARED_DIR."""
    candidates = [os.environ.get("SHARED_DIR"), REPO.parent / "shared", REPO / "shared"]
    for c in candidates:
        if c and (Path(c) / "schemas").is_dir():
            return Path(c)
    return None


def strict_schema(node):
    """The CRD's OpenAPI v3 schema with unknown fields rejected: add
    additionalProperties: false wherever properties are listed, unless the
    schema keeps unknown fields (x-kubernetes-preserve-unknown-fields) or
    already says what extra properties may be."""
    if isinstance(node, list):
        return [strict_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict_schema(v) for k, v in node.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=None)
def crd_schema(kind: str) -> dict:
    directory = shared_dir()
    if directory is None:
        pytest.skip("CRD schemas not found: set SHARED_DIR or put shared/ beside the clone")
    crd = yaml.safe_load((directory / "schemas" / CRD_FILES[kind]).read_text())
    assert crd["spec"]["names"]["kind"] == kind
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return strict_schema(version["schema"]["openAPIV3Schema"])


def make_env() -> dict[str, str]:
    """The environment for `make` in tests: the Makefile's own defaults, not the caller's."""
    return {k: v for k, v in os.environ.items() if k not in ("IMAGE", "IMAGE_GPU", "VERSION", "OVERLAY", "K8S_NAMESPACE")}


def make_var(name: str) -> str:
    """The value of a variable of the main Makefile (mk/*.mk included)."""
    if not shutil.which("make"):
        pytest.skip("make not installed")
    out = subprocess.run(
        ["make", "-s", "--no-print-directory", "-C", str(REPO), "--eval", "print-var-%: ; @echo $($*)", f"print-var-{name}"],
        capture_output=True, text=True, timeout=30, env=make_env(),
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def validate_crd(obj: dict) -> None:
    """A custom resource against its CRD's schema, unknown fields rejected."""
    validator = jsonschema.Draft4Validator(crd_schema(obj["kind"]))  # OpenAPI 3.0 schemas are draft-4 flavoured
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.path))
    assert not errors, f"{obj['kind']}/{obj['metadata']['name']}: " + "; ".join(
        f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors[:5]
    )
