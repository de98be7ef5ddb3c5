"""Every kustomization under k8s/ renders, and every rendered object is valid:
core kinds against Kubernetes' own schemas (kubernetes-validate, strict: unknown
fields rejected), custom resources against the openAPIV3Schema of their CRDs
(KubeRay, prometheus-operator) with unknown fields rejected too. A real
cluster's API server would accept them the first time."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from tests.support.k8s import (
    CRD_FILES,
    K8S,
    KUSTOMIZATIONS,
    pod_specs,
    render,
    strict_schema,
    validate_crd,
)

# The oldest Kubernetes the manifests promise to work on (ValidatingAdmissionPolicy
# is GA from 1.30), and a recent one
# (kubernetes-validate ships schemas up to 1.37).
K8S_VERSIONS = ["1.30.0", "1.33.0"]


def validate_core(obj: dict, version: str) -> None:
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        pytest.fail(f"no Kubernetes {version} schema for {obj['apiVersion']} {obj['kind']}: a typo, or a CRD without a schema here")
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} invalid for Kubernetes {version} at {path}: {exc.message}")


@pytest.mark.parametrize("rel", KUSTOMIZATIONS)
def test_kustomization_renders(rel):
    objs = render(rel)
    assert objs, f"k8s/{rel} rendered nothing"
    for obj in objs:
        assert obj.get("apiVersion") and obj.get("kind") and obj["metadata"].get("name")


def test_every_kustomization_under_k8s_is_tested():
    from tests.deploy.test_k8s_queues import ADMIN  # the admin's Kueue objects: validated there, with Kueue's schemas

    found = {str(p.parent.relative_to(K8S)) for p in K8S.rglob("kustomization.yaml")}
    tested = {part for rel in KUSTOMIZATIONS for part in rel.split("+")} | set(ADMIN)
    assert found == tested, f"add new kustomizations to KUSTOMIZATIONS: {found ^ tested}"


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("rel", KUSTOMIZATIONS)
def test_core_objects_validate_strictly(rel, version):
    for obj in render(rel):
        if obj["kind"] in CRD_FILES or obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        validate_core(obj, version)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("rel", KUSTOMIZATIONS)
def test_pod_templates_inside_custom_resources_validate_strictly(rel, version):
    """The CRD schema checks a RayJob's pod templates too; this also checks them
    as core PodTemplates for each Kubernetes version."""
    for obj in render(rel):
        if obj["kind"] not in CRD_FILES:
            continue
        for where, _spec in pod_specs(obj):
            template_path = where.rsplit("/spec", 1)[0]
            node = obj
            for part in template_path.strip("/").split("/"):
                node = node[int(part)] if isinstance(node, list) else node[part]
            pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": node}
            validate_core(pod_template, version)


@pytest.mark.parametrize("rel", KUSTOMIZATIONS)
def test_custom_resources_validate_against_crd_schemas(rel):
    for obj in render(rel):
        if obj["kind"] in CRD_FILES:
            validate_crd(obj)


def test_prometheus_rule_has_the_shape_prometheus_operator_expects():
    """No PrometheusRule CRD schema is in ../shared: check its shape by hand."""
    rule = next(o for o in render("monitoring") if o["kind"] == "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(rule["spec"]) == {"groups"}
    for group in rule["spec"]["groups"]:
        assert group["name"] and group["rules"]
        for r in group["rules"]:
            assert ("alert" in r) != ("record" in r), r
            assert isinstance(r["expr"], str) and r["expr"].strip()
            assert set(r) <= {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}, r


def test_crd_validation_rejects_unknown_and_wrong_fields():
    """The strict CRD validation really bites (so the tests above mean something)."""
    rayjob = next(o for o in render("base") if o["kind"] == "RayJob")
    validate_crd(rayjob)
    typo = yaml.safe_load(yaml.safe_dump(rayjob))
    typo["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(AssertionError, match="imagePullPolicyy"):
        validate_crd(typo)
    wrong = yaml.safe_load(yaml.safe_dump(rayjob))
    wrong["spec"]["rayClusterSpec"]["authOptions"]["mode"] = "password"
    with pytest.raises(AssertionError, match="password"):
        validate_crd(wrong)
    # A field that keeps unknown keys stays open.
    assert strict_schema({"type": "object", "properties": {"a": {}}, "x-kubernetes-preserve-unknown-fields": True}) == {
        "type": "object", "properties": {"a": {}}, "x-kubernetes-preserve-unknown-fields": True}


def test_core_validation_rejects_unknown_fields():
    policy = next(o for o in render("base") if o["kind"] == "NetworkPolicy")
    policy["spec"]["podSelectorr"] = {}
    with pytest.raises(pytest.fail.Exception, match="podSelectorr"):
        validate_core(policy, K8S_VERSIONS[0])
