"""The ValidatingAdmissionPolicy of k8s/admission: the kit's ServiceAccount
(the token in the worker pods, which RBAC lets `patch` any pod of its
namespace) may change nothing on a pod but the metrics label.

Its CEL expressions are evaluated on pod updates a workload could attempt
with cel-python (the Common Expression Language in Python) when it is
installed; the structure is checked always."""

from __future__ import annotations

import copy

import pytest

from tests.support.k8s import REPO, one, render

LABEL = "ray-app.io/metrics-rank0"
SA = "system:serviceaccount:ray-app:ray-app"


def policy() -> dict:
    return one(render("admission"), "ValidatingAdmissionPolicy")


def test_the_policy_binds_every_update_of_a_pod_by_the_kits_service_account():
    p, binding = policy(), one(render("admission"), "ValidatingAdmissionPolicyBinding")
    assert "namespace" not in p["metadata"] and "namespace" not in binding["metadata"], "cluster-scoped"
    assert binding["spec"]["policyName"] == p["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert "matchResources" not in binding["spec"], "every namespace the kit is deployed to"
    assert p["spec"]["failurePolicy"] == "Fail"
    (rule,) = p["spec"]["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == [""] and rule["resources"] == ["pods"] and "UPDATE" in rule["operations"]
    (cond,) = p["spec"]["matchConditions"]
    assert "system:serviceaccount:" in cond["expression"] and "request.namespace" in cond["expression"]


def test_rbac_grants_no_verb_the_policy_does_not_hold():
    """`patch` is an UPDATE in admission; create, delete, pods/* subresources are not granted at all."""
    role = one(render("base"), "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "patch"]}]


def test_docs_say_what_the_workloads_token_can_do():
    docs = (REPO / "docs" / "kubernetes.md").read_text()
    assert "### What the workload's token can do" in docs
    assert "k8s/admission" in docs


# --- the CEL, evaluated --------------------------------------------------------------------------

def pod() -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "w-1", "namespace": "ray-app",
                         "labels": {"app.kubernetes.io/name": "ray-app", "ray.io/cluster": "job-abc", "ray.io/node-type": "worker"},
                         "annotations": {"ray.io/ft-enabled": "false"},
                         "ownerReferences": [{"apiVersion": "ray.io/v1", "kind": "RayCluster", "name": "job-abc", "uid": "u"}]},
            "spec": {"serviceAccountName": "ray-app", "containers": [{"name": "ray-worker", "image": "ray-app:0.1.0"}]}}


def labelled(p: dict) -> dict:
    p = copy.deepcopy(p)
    p["metadata"]["labels"][LABEL] = "true"
    return p


def change(mutate):
    def build():
        old = pod()
        new = copy.deepcopy(old)
        mutate(new)
        return old, new
    return build


UPDATES = {
    "rank 0 labels its own pod": (change(lambda p: p["metadata"]["labels"].__setitem__(LABEL, "true")), True),
    "rank 0 removes the label of a former rank 0": (lambda: (labelled(pod()), pod()), True),
    "a no-op patch": (change(lambda p: None), True),
    "another image": (change(lambda p: p["spec"]["containers"][0].__setitem__("image", "evil:1")), False),
    "out of the NetworkPolicies (app label removed)": (change(lambda p: p["metadata"]["labels"].pop("app.kubernetes.io/name")), False),
    "another label added": (change(lambda p: p["metadata"]["labels"].__setitem__("team", "x")), False),
    "the metrics label set to false": (change(lambda p: p["metadata"]["labels"].__setitem__(LABEL, "false")), False),
    "an annotation changed": (change(lambda p: p["metadata"]["annotations"].__setitem__("ray.io/ft-enabled", "true")), False),
    "orphaned from its RayCluster": (change(lambda p: p["metadata"].pop("ownerReferences")), False),
    "a toleration added": (change(lambda p: p["spec"].__setitem__("tolerations", [{"operator": "Exists"}])), False),
}


def evaluate(expression: str, activation: dict):
    celpy = pytest.importorskip("celpy", reason="cel-python not installed: the policy's CEL is not evaluated here")
    env = celpy.Environment()
    program = env.program(env.compile(expression))
    return program.evaluate({k: celpy.json_to_cel(v) for k, v in activation.items()})


def admitted(old: dict, new: dict, username: str = SA) -> bool:
    spec = policy()["spec"]
    request = {"userInfo": {"username": username}, "namespace": new["metadata"]["namespace"], "operation": "UPDATE"}
    base = {"object": new, "oldObject": old, "request": request}
    if not all(bool(evaluate(c["expression"], base)) for c in spec["matchConditions"]):
        return True  # the policy does not apply
    variables = {}
    for var in spec.get("variables") or []:
        value = evaluate(var["expression"].replace("variables.", "variables_"), dict(base, **{f"variables_{k}": v for k, v in variables.items()}))
        variables[var["name"]] = celpy_to_python(value)
    activation = dict(base, **{f"variables_{k}": v for k, v in variables.items()})
    return all(bool(evaluate(v["expression"].replace("variables.", "variables_"), activation)) for v in spec["validations"])


def celpy_to_python(value):
    if isinstance(value, dict):
        return {str(k): celpy_to_python(v) for k, v in value.items()}
    if isinstance(value, list):
        return [celpy_to_python(v) for v in value]
    return str(value) if isinstance(value, str) else value


@pytest.mark.parametrize("update", sorted(UPDATES))
def test_the_service_account_may_change_only_the_metrics_label(update):
    build, allowed = UPDATES[update]
    old, new = build()
    assert admitted(old, new) is allowed, f"{update}: {'denied' if allowed else 'admitted'}"


def test_other_users_are_not_held_by_the_policy():
    old, new = change(lambda p: p["spec"]["containers"][0].__setitem__("image", "ray-app:0.2.0"))()
    assert admitted(old, new, username="system:serviceaccount:kuberay-system:kuberay-operator")
    assert admitted(old, new, username="system:serviceaccount:other-ns:ray-app")  # a pod in ray-app, another namespace's SA
    assert not admitted(old, new)
