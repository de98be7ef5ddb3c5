"""What the KubeRay operator does with the rendered RayJob, as its source says
(ray-project/kuberay, ray-operator/controllers/ray/common/pod.go and
rayjob_controller.go, 1.6 to 1.7), checked on the manifests statically:
probes the operator would otherwise inject, the version the manifests need,
and the time budget of a RayJob with retries."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.k8s import DEPLOYABLE, K8S, REPO, one, render

# The oldest operator the manifests work with, stated the same everywhere:
# 1.6 is the first with authOptions.secretName, preRunningDeadlineSeconds and
# HTTP probes for Ray >= 2.53 (1.5.x injects exec probes that run wget).
KUBERAY_MINIMUM = "1.6.0"
DASHBOARD_AGENT_PORT = 52365  # Ray's default dashboard-agent-listen-port, KubeRay's probe port
HEALTH_PATH = "/api/healthz"  # the dashboard agent's unified health check (Ray >= 2.53), no token needed


def ray_groups(rayjob: dict) -> dict[str, dict]:
    cluster = rayjob["spec"]["rayClusterSpec"]
    groups = {"head": cluster["headGroupSpec"]}
    groups.update({f"workers/{g['groupName']}": g for g in cluster["workerGroupSpecs"]})
    return groups


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_ray_containers_carry_http_probes_so_the_operator_injects_none(rel):
    """KubeRay's initLivenessAndReadinessProbe fills in a probe only where the
    Ray container (index 0) has none; the ones it injects on 1.5.x are
    `bash -c "wget ... api/local_raylet_healthz"`, and the kit's images have no
    wget. Explicit HTTP probes work on every operator version."""
    for name, group in ray_groups(one(render(rel), "RayJob")).items():
        container = group["template"]["spec"]["containers"][0]
        port = int(group.get("rayStartParams", {}).get("dashboard-agent-listen-port", DASHBOARD_AGENT_PORT))
        for kind in ("readinessProbe", "livenessProbe"):
            probe = container.get(kind)
            assert probe, f"{rel} {name}: no {kind}: KubeRay would inject its own (exec + wget before 1.6)"
            assert "exec" not in probe, f"{rel} {name}: {kind} runs a command in the image"
            assert probe.get("httpGet", {}).get("path") == HEALTH_PATH, f"{rel} {name}: {kind} {probe}"
            assert probe["httpGet"]["port"] == port, f"{rel} {name}: {kind} not on the dashboard agent's port {port}"
            # Liveness far more patient than readiness, as KubeRay's own defaults.
        assert container["livenessProbe"]["failureThreshold"] > container["readinessProbe"]["failureThreshold"]


def test_ray_version_is_one_with_the_unified_health_check():
    rayjob = one(render("base"), "RayJob")
    major, minor, *_ = (int(x) for x in rayjob["spec"]["rayClusterSpec"]["rayVersion"].split("."))
    assert (major, minor) >= (2, 53), "/api/healthz on the dashboard agent needs Ray >= 2.53"


# "KubeRay 1.6+", "KubeRay >= 1.6", "operator 1.6.0 or newer", "(KubeRay ray.io/v1, v1.6.0+)" ...
STATED = re.compile(
    r"(?:KubeRay|operator)\b[^;]{0,40}?(?:>=\s*v?|\bv?)(1\.\d+(?:\.\d+)?)(?:\.x)?(\+|\s+or\s+newer|\s+or\s+later)?")


def statement_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "docs" / "kubernetes.md", REPO / "mk" / "k8s.mk"]
    files += sorted((K8S / "scripts").glob("*.sh"))
    files += sorted(p for p in K8S.rglob("*.yaml"))
    return files


def as_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


def test_the_minimum_kubernetes_operator_is_stated_the_same_everywhere():
    """One minimum: no file may still promise an operator version whose
    injected probes, CRDs or fields break the deploy."""
    wrong = []
    for path in statement_files():
        text = " ".join(path.read_text().split())  # a statement may wrap
        for m in STATED.finditer(text):
            version, promise = m.group(1), m.group(2)
            claims_support = promise or ">=" in m.group(0)
            if claims_support and as_tuple(version) < as_tuple(KUBERAY_MINIMUM)[: len(as_tuple(version))]:
                wrong.append(f"{path.relative_to(REPO)}: ...{m.group(0)}")
    assert not wrong, f"KubeRay older than {KUBERAY_MINIMUM} still stated as supported:\n" + "\n".join(wrong)
    deploy = (K8S / "scripts" / "deploy.sh").read_text()
    assert f">= {KUBERAY_MINIMUM}" in deploy, "deploy.sh names the minimum when the CRDs are missing"
    assert f"operator {KUBERAY_MINIMUM} or newer" in (REPO / "docs" / "kubernetes.md").read_text()


def test_kind_up_pins_an_operator_at_least_the_minimum():
    pinned = re.search(r"KUBERAY_VERSION \?= (\S+)", (REPO / "mk" / "k8s.mk").read_text()).group(1)
    assert as_tuple(pinned) >= as_tuple(KUBERAY_MINIMUM)


# The most time one RayJob may hold its cluster, all attempts together.
TIME_BUDGET_S = {"base": 24 * 3600, "overlays/gpu": 24 * 3600, "overlays/kind-cpu": 3600}


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_the_deadline_budget_covers_every_retry(rel):
    """rayjob_controller.go: a retry goes Retrying -> New, and the next
    initRayJobStatusIfNeed sets Status.StartTime again, which
    checkActiveDeadlineAndUpdateStatusIfNeeded measures from. So the worst
    case is (backoffLimit + 1) x activeDeadlineSeconds."""
    spec = one(render(rel), "RayJob")["spec"]
    attempts = spec.get("backoffLimit", 0) + 1
    assert spec["activeDeadlineSeconds"] * attempts <= TIME_BUDGET_S[rel], (
        f"{rel}: {attempts} attempts x {spec['activeDeadlineSeconds']} s exceed the budget of {TIME_BUDGET_S[rel]} s")


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_an_attempt_that_never_runs_fails_early(rel):
    """checkPreRunningDeadlineAndUpdateStatusIfNeeded (1.6+) fails an attempt
    that is not Running preRunningDeadlineSeconds after StartTime."""
    spec = one(render(rel), "RayJob")["spec"]
    pre = spec.get("preRunningDeadlineSeconds")
    assert pre and 0 < pre <= spec["activeDeadlineSeconds"] / 2, f"{rel}: preRunningDeadlineSeconds {pre}"


def test_docs_say_what_a_retry_costs_and_where_a_failed_attempts_logs_go():
    text = " ".join((REPO / "docs" / "kubernetes.md").read_text().split())
    assert "(backoffLimit + 1) x activeDeadlineSeconds" in text
    assert "preRunningDeadlineSeconds" in text
    assert "### Logs of a failed attempt" in (REPO / "docs" / "kubernetes.md").read_text()
