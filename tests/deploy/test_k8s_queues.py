"""Queues and priorities (docs/kubernetes.md, "Queues and priorities").

The gpu overlay with the kueue and priority components renders a RayJob that is created suspended (Kueue admits
the whole gang, then unsuspends it), carries the queue label of the LocalQueue a team's admin creates, and runs
every pod at a PriorityClass the admin's manifests define; the check fails when either component is dropped. The
admin's manifests (k8s/kueue) validate: Kueue's kinds against the openAPIV3Schema of Kueue's own CRDs
(tests/deploy/schemas, their sources in SOURCES.md there), the PriorityClasses against Kubernetes' schemas, and
the ClusterQueue's quota admits one RayJob of the gpu overlay.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.deploy.test_k8s_manifests import K8S_VERSIONS, validate_core
from tests.support.k8s import K8S, REPO, kubectl, one, rayjob_templates, render, strict_schema, validate_crd

SCHEMAS = Path(__file__).resolve().parent / "schemas"
KUEUE_API = "kueue.x-k8s.io/v1beta2"
KUEUE_SCHEMAS = {
    "LocalQueue": "kueue.x-k8s.io_localqueues.v1beta2.json",
    "ClusterQueue": "kueue.x-k8s.io_clusterqueues.v1beta2.json",
    "ResourceFlavor": "kueue.x-k8s.io_resourceflavors.v1beta2.json",
}
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# What a team's admin applies (`make kueue-setup`): cluster-wide objects, then the namespace's LocalQueue.
ADMIN = ["kueue/cluster-queue", "kueue/local-queue"]
BOTH = "overlays/gpu+components/kueue+components/priority"
DOCS = REPO / "docs" / "kubernetes.md"
SECTION = "### Queues and priorities"


@functools.lru_cache(maxsize=None)
def kueue_schema(kind: str) -> dict:
    doc = json.loads((SCHEMAS / KUEUE_SCHEMAS[kind]).read_text())
    assert doc["kind"] == kind and f"{doc['group']}/{doc['version']}" == KUEUE_API
    return strict_schema(doc["openAPIV3Schema"])


def validate_kueue(obj: dict) -> None:
    """A Kueue object against its CRD's schema, unknown fields rejected (as validate_crd does for KubeRay's)."""
    assert obj["apiVersion"] == KUEUE_API, f"{obj['kind']}/{obj['metadata']['name']}: {obj['apiVersion']}"
    validator = jsonschema.Draft4Validator(kueue_schema(obj["kind"]))
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.path))
    assert not errors, f"{obj['kind']}/{obj['metadata']['name']}: " + "; ".join(
        f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors[:5])


def admin_objects() -> list[dict]:
    return [obj for rel in ADMIN for obj in render(rel)]


def queue_and_priority_problems(objs: list[dict], admin: list[dict]) -> list[str]:
    """What keeps the rendered RayJob from queueing as one gang at a priority the cluster knows."""
    rayjob = one(objs, "RayJob", "ray-app-train")
    local_queues = sorted(o["metadata"]["name"] for o in admin if o["kind"] == "LocalQueue")
    classes = sorted(o["metadata"]["name"] for o in admin if o["kind"] == "PriorityClass")
    problems = []
    label = rayjob["metadata"].get("labels", {}).get(QUEUE_LABEL)
    if label not in local_queues:
        problems.append(f"label {QUEUE_LABEL}={label!r} names no LocalQueue of k8s/kueue ({local_queues})")
    if rayjob["spec"].get("suspend") is not True:
        problems.append("spec.suspend is not true: KubeRay would start the cluster before Kueue admits the gang")
    for where, template in rayjob_templates(rayjob).items():
        name = template["spec"].get("priorityClassName")
        if name not in classes:
            problems.append(f"{where}: priorityClassName {name!r} is no PriorityClass of k8s/kueue ({classes})")
    return problems


def test_the_gpu_overlay_with_both_components_queues_a_suspended_gang_at_a_known_priority():
    objs = render(BOTH)
    rayjob = one(objs, "RayJob", "ray-app-train")
    validate_crd(rayjob)  # KubeRay's RayJob schema: suspend and priorityClassName are real fields
    for version in K8S_VERSIONS:
        for obj in objs:
            if obj["kind"] != "RayJob":
                validate_core(obj, version)
    assert queue_and_priority_problems(objs, admin_objects()) == []
    assert rayjob["metadata"]["labels"][QUEUE_LABEL] == "ray-app" and rayjob["spec"]["suspend"] is True
    # nothing else changes: the gpu overlay's objects, but for the label, suspend and the classes
    plain = render("overlays/gpu")
    job = one(plain, "RayJob", "ray-app-train")
    job["metadata"]["labels"][QUEUE_LABEL] = "ray-app"
    job["spec"]["suspend"] = True
    for template in rayjob_templates(job).values():
        template["spec"]["priorityClassName"] = "ray-app-production"
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted(objs, key=key) == sorted(plain, key=key)


@pytest.mark.parametrize("rel, missing", [
    ("overlays/gpu+components/kueue", ["priorityClassName"] * 3),
    ("overlays/gpu+components/priority", ["label", "suspend"]),
    ("overlays/gpu", ["label", "suspend"] + ["priorityClassName"] * 3),
])
def test_dropping_either_component_is_caught(rel, missing):
    problems = queue_and_priority_problems(render(rel), admin_objects())
    kinds = ["label" if p.startswith("label") else "suspend" if p.startswith("spec.suspend") else
             "priorityClassName" if "priorityClassName" in p else p for p in problems]
    assert kinds == missing, problems
    if "priorityClassName" in missing:
        assert {p.split(":")[0] for p in problems if "priorityClassName" in p} == set(
            rayjob_templates(one(render(rel), "RayJob")))


def test_the_documented_gpu_variant_is_the_overlay_with_both_components(tmp_path):
    """Uncommenting `components:` and the kueue and priority lines of k8s/overlays/gpu/kustomization.yaml, as
    its comments and the docs say, renders what the test above checked."""
    text = (K8S / "overlays" / "gpu" / "kustomization.yaml").read_text()
    wanted = ("# components:", "#   - ../../components/kueue ", "#   - ../../components/priority ")
    lines = [ln[2:] if ln.startswith(wanted) else ln for ln in text.splitlines()]
    assert sum(1 for a, b in zip(text.splitlines(), lines) if a != b) == 3, "the documented lines moved"
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    (tree / "overlays" / "gpu" / "kustomization.yaml").write_text("\n".join(lines) + "\n")
    out = subprocess.run([kubectl(), "kustomize", str(tree / "overlays" / "gpu")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    objs = [d for d in yaml.safe_load_all(out.stdout) if d]
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted(objs, key=key) == sorted(render(BOTH), key=key)


def test_the_admins_manifests_validate_and_refer_to_each_other():
    cluster, local = render(ADMIN[0]), render(ADMIN[1])
    assert sorted(o["kind"] for o in cluster) == ["ClusterQueue", "PriorityClass", "PriorityClass", "ResourceFlavor"]
    assert [o["kind"] for o in local] == ["LocalQueue"]
    for obj in cluster + local:
        if obj["kind"] in KUEUE_SCHEMAS:
            validate_kueue(obj)
        else:
            for version in K8S_VERSIONS:
                validate_core(obj, version)
        assert obj["metadata"]["labels"]["app.kubernetes.io/name"] == "ray-app"
    # cluster-scoped objects carry no namespace (kustomize would add one to Kueue's kinds); the LocalQueue does
    assert all("namespace" not in o["metadata"] for o in cluster)
    assert local[0]["metadata"]["namespace"] == "ray-app"
    queue = one(cluster, "ClusterQueue")
    assert local[0]["spec"]["clusterQueue"] == queue["metadata"]["name"]
    flavors = {o["metadata"]["name"] for o in cluster if o["kind"] == "ResourceFlavor"}
    assert {f["name"] for g in queue["spec"]["resourceGroups"] for f in g["flavors"]} == flavors
    assert queue["spec"]["preemption"]["withinClusterQueue"] == "LowerPriority"
    classes = {o["metadata"]["name"]: o for o in cluster if o["kind"] == "PriorityClass"}
    assert classes["ray-app-production"]["value"] > classes["ray-app-experiment"]["value"]
    assert not any(c.get("globalDefault") for c in classes.values())


def test_kueue_schema_validation_rejects_unknown_and_wrong_fields():
    """The strict Kueue validation really bites (so the test above means something)."""
    queue = one(render(ADMIN[0]), "ClusterQueue")
    validate_kueue(queue)
    typo = yaml.safe_load(yaml.safe_dump(queue))
    typo["spec"]["preemptionn"] = {}
    with pytest.raises(AssertionError, match="preemptionn"):
        validate_kueue(typo)
    wrong = yaml.safe_load(yaml.safe_dump(queue))
    wrong["spec"]["queueingStrategy"] = "Random"
    with pytest.raises(AssertionError, match="Random"):
        validate_kueue(wrong)
    local = one(render(ADMIN[1]), "LocalQueue")
    del local["spec"]["clusterQueue"]
    validate_kueue(local)  # optional in the schema; the reference test above asks for it
    local["spec"]["clusterQueue"] = "Not_A_Name"
    with pytest.raises(AssertionError, match="Not_A_Name"):
        validate_kueue(local)


_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(m|Ki|Mi|Gi|Ti)?$")
_SCALE = {None: 1, "m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(value) -> float:
    m = _QUANTITY.match(str(value))
    assert m, f"quantity {value!r}"
    return float(m.group(1)) * _SCALE[m.group(2)]


def gang_requests(rayjob: dict) -> dict[str, float]:
    """What Kueue counts for one RayJob: each pod's container requests (limits where no request), every replica."""
    spec = rayjob["spec"]
    pods = [(1, spec["rayClusterSpec"]["headGroupSpec"]["template"]), (1, spec["submitterPodTemplate"])]
    pods += [(g["replicas"], g["template"]) for g in spec["rayClusterSpec"]["workerGroupSpecs"]]
    total: dict[str, float] = {}
    for count, template in pods:
        for c in template["spec"]["containers"]:
            res = {**c.get("resources", {}).get("limits", {}), **c.get("resources", {}).get("requests", {})}
            for name, value in res.items():
                total[name] = total.get(name, 0.0) + count * quantity(value)
    return total


def test_the_cluster_queue_admits_one_rayjob_of_the_gpu_overlay():
    """A quota smaller than one gang would leave the RayJob pending forever, with no error anywhere."""
    need = gang_requests(one(render(BOTH), "RayJob"))
    queue = one(render(ADMIN[0]), "ClusterQueue")
    (group,) = queue["spec"]["resourceGroups"]
    assert set(need) <= set(group["coveredResources"]), set(need) - set(group["coveredResources"])
    quota = {r["name"]: quantity(r["nominalQuota"]) for f in group["flavors"] for r in f["resources"]}
    for name, amount in need.items():
        assert amount <= quota[name], f"one gpu-overlay RayJob needs {name} {amount:g}, the queue has {quota[name]:g}"
    assert need["nvidia.com/gpu"] == 2


def test_the_kueue_schemas_are_the_cited_upstream_files():
    """Each schema names its kind and version; SOURCES.md cites the repository, tag, path and sha256 of the CRD
    file it was taken from."""
    sources = (SCHEMAS / "SOURCES.md").read_text()
    assert "kubernetes-sigs/kueue" in sources and "v0.19.2" in sources
    for kind, name in KUEUE_SCHEMAS.items():
        row = next((ln for ln in sources.splitlines() if ln.startswith(f"| {name} |")), None)
        assert row, f"SOURCES.md has no row for {name}"
        plural = name.split("_")[1].split(".")[0]
        assert f"config/components/crd/bases/kueue.x-k8s.io_{plural}.yaml" in row
        assert re.search(r"\| [0-9a-f]{64} \|", row)
        doc = json.loads((SCHEMAS / name).read_text())
        assert doc["kind"] == kind and doc["openAPIV3Schema"]["type"] == "object"
        assert hashlib.sha256((SCHEMAS / name).read_bytes()).hexdigest() in row


def test_docs_say_how_an_admin_and_a_user_each_use_queues_and_priorities():
    text = DOCS.read_text()
    assert SECTION in text
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    for needle in ("make kueue-setup", "k8s/kueue", "k8s/components/kueue", "k8s/components/priority",
                   QUEUE_LABEL, "suspend", "ray-app-production", "ray-app-experiment", "make deploy OVERLAY=gpu",
                   "Kueue 0.15"):
        assert needle in section, needle
