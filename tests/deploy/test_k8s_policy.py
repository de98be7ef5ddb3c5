"""Security policy of the rendered manifests.

Every pod template in every rendered object (a RayJob's head, worker groups,
init containers and submitter; MinIO's Deployment and Job on kind) meets the
Pod Security "restricted" profile, checked on *effective* values (a
container's securityContext overrides the pod's). Plus the network and RBAC
rules: ClusterIP only, a NetworkPolicy that admits only the cluster's own
pods to GCS / the job API, token auth, one namespaced Role.
"""

from __future__ import annotations

import pytest

from tests.support.k8s import (
    APP_LABEL,
    DEPLOYABLE,
    KUSTOMIZATIONS,
    NAMESPACE,
    all_containers,
    one,
    pod_specs,
    rayjob_templates,
    render,
)

RUN_AS_USER = 1000  # the image's numeric user (docs/CONTRACTS.md)
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}


def effective(pod_sc: dict, c_sc: dict, key: str):
    return c_sc[key] if key in c_sc else pod_sc.get(key)


def restricted_violations(spec: dict) -> list[str]:
    """The Pod Security Standards "restricted" rules (baseline included)."""
    bad = []
    pod_sc = spec.get("securityContext") or {}
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(flag):
            bad.append(f"{flag}: true")
    for vol in spec.get("volumes") or []:
        kinds = set(vol) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            bad.append(f"volume {vol['name']}: type {sorted(kinds)} not allowed")
    for sysctl in pod_sc.get("sysctls") or []:
        if sysctl["name"] not in SAFE_SYSCTLS:
            bad.append(f"sysctl {sysctl['name']}")
    if (pod_sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
        bad.append("pod appArmorProfile Unconfined")
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        bad.append("pod hostProcess")
    for kind, c in all_containers(spec):
        name = f"{kind}/{c['name']}"
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation must be false")
        if effective(pod_sc, sc, "runAsNonRoot") is not True:
            bad.append(f"{name}: runAsNonRoot must be true")
        user = effective(pod_sc, sc, "runAsUser")
        if user != RUN_AS_USER:
            bad.append(f"{name}: runAsUser must be the numeric {RUN_AS_USER}, is {user!r}")
        seccomp = (effective(pod_sc, sc, "seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile must be RuntimeDefault, is {seccomp!r}")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            bad.append(f"{name}: capabilities must drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: adds capabilities {caps['add']}")
        if sc.get("procMount", "Default") != "Default":
            bad.append(f"{name}: procMount")
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
            bad.append(f"{name}: appArmorProfile Unconfined")
        se = effective(pod_sc, sc, "seLinuxOptions") or {}
        if se.get("user") or se.get("role") or se.get("type") not in (None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"):
            bad.append(f"{name}: seLinuxOptions")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            bad.append(f"{name}: hostProcess")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                bad.append(f"{name}: hostPort {port['hostPort']}")
    return bad


def every_pod_spec(rel: str):
    return [(f"{o['kind']}/{o['metadata']['name']}{where}", spec) for o in render(rel) for where, spec in pod_specs(o)]


@pytest.mark.parametrize("rel", KUSTOMIZATIONS)
def test_every_pod_template_meets_pod_security_restricted(rel):
    violations = [f"{where}: {v}" for where, spec in every_pod_spec(rel) for v in restricted_violations(spec)]
    assert violations == [], "\n".join(violations)


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_the_walk_finds_head_workers_and_submitter(rel):
    rayjob = one(render(rel), "RayJob")
    found = {where for where, _ in pod_specs(rayjob)}
    assert found == {
        "/spec/rayClusterSpec/headGroupSpec/template/spec",
        "/spec/rayClusterSpec/workerGroupSpecs/0/template/spec",
        "/spec/submitterPodTemplate/spec",
    }


def test_minio_pods_are_walked_too():
    assert {w.split("/")[0] for w, _ in every_pod_spec("kind/minio")} == {"Deployment", "Job"}


def test_the_policy_check_catches_each_violation():
    """A pod that breaks each rule once: the checker must name every one."""
    bad_pod = {
        "hostNetwork": True,
        "securityContext": {"runAsUser": 0, "seccompProfile": {"type": "Unconfined"}},
        "volumes": [{"name": "host", "hostPath": {"path": "/"}}],
        "initContainers": [{"name": "init", "image": "x", "securityContext": {"privileged": True}}],
        "containers": [{
            "name": "main", "image": "x", "ports": [{"containerPort": 80, "hostPort": 80}],
            "securityContext": {"allowPrivilegeEscalation": True, "capabilities": {"add": ["SYS_ADMIN"]}},
        }],
    }
    text = "\n".join(restricted_violations(bad_pod))
    for expected in ["hostNetwork", "volume host", "initContainers/init: privileged",
                     "initContainers/init: allowPrivilegeEscalation", "containers/main: runAsNonRoot",
                     "containers/main: runAsUser", "containers/main: seccompProfile", "drop ALL",
                     "adds capabilities", "hostPort 80"]:
        assert expected in text, f"{expected!r} not reported:\n{text}"
    # Container-level settings override the pod's: a container running as root is caught.
    pod = {"securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
           "containers": [{"name": "c", "image": "x", "securityContext": {
               "runAsUser": 0, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}]}
    assert restricted_violations(pod) == ["containers/c: runAsUser must be the numeric 1000, is 0"]


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_namespace_enforces_pod_security_restricted(rel):
    ns = one(render(rel), "Namespace")
    assert ns["metadata"]["name"] == NAMESPACE
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert {o["metadata"].get("namespace") for o in render(rel) if o["kind"] != "Namespace"} == {NAMESPACE}


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_ray_cluster_uses_token_auth_and_clusterip_only(rel):
    objs = render(rel)
    cluster = one(objs, "RayJob")["spec"]["rayClusterSpec"]
    assert cluster["authOptions"]["mode"] == "token"
    head = cluster["headGroupSpec"]
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"
    assert not head.get("enableIngress")
    assert head.get("headService", {}).get("spec", {}).get("type", "ClusterIP") == "ClusterIP"
    for rel_all in KUSTOMIZATIONS:
        for svc in (o for o in render(rel_all) if o["kind"] == "Service"):
            assert svc["spec"].get("type", "ClusterIP") == "ClusterIP", f"{rel_all}: Service {svc['metadata']['name']}"
    assert not [o for o in objs if o["kind"] in ("Ingress", "Route", "Gateway", "HTTPRoute")]


def _peers(rule: dict, key: str) -> list[dict]:
    return rule.get(key) or []


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_network_policy_admits_only_the_clusters_own_pods_to_ray_ports(rel):
    objs = render(rel)
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    ingress_policies = [p for p in policies if "Ingress" in p["spec"]["policyTypes"]]
    assert ingress_policies, "no ingress NetworkPolicy"
    # Every Ray pod and the submitter are selected by the policy.
    for name, template in rayjob_templates(one(objs, "RayJob")).items():
        labels = template["metadata"]["labels"]
        for p in ingress_policies:
            assert p["spec"]["podSelector"]["matchLabels"].items() <= labels.items(), f"{name} not selected by {p['metadata']['name']}"
    for p in ingress_policies:
        for rule in p["spec"].get("ingress") or []:
            peers = _peers(rule, "from")
            assert peers, f"{p['metadata']['name']}: a rule without 'from' admits everyone"
            ports = {port["port"] for port in rule.get("ports") or []}
            for peer in peers:
                assert "ipBlock" not in peer, "no ingress by IP range"
                same_namespace_ray_pod = set(peer) == {"podSelector"} and peer["podSelector"]["matchLabels"] == APP_LABEL
                if same_namespace_ray_pod:
                    continue  # the cluster's own pods and the submitter: all Ray ports
                # Anything else: a named component, on named ports only, never GCS.
                assert peer.get("podSelector", {}).get("matchLabels"), f"unrestricted peer {peer}"
                assert ports and 6379 not in ports, f"peer {peer} may reach {ports or 'every port'}"
                component = peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
                allowed = {"kuberay-operator": {8265}, "prometheus": {8080, 9500}}[component]
                assert ports <= allowed, f"{component} may reach {ports}, only {allowed} needed"


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_only_rbac_is_get_list_patch_pods_in_the_namespace(rel):
    objs = render(rel)
    assert not [o for o in objs if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    role = one(objs, "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "patch"]}]
    binding = one(objs, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ray-app", "namespace": NAMESPACE}]


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_service_account_token_only_where_needed(rel):
    objs = render(rel)
    sa = one(objs, "ServiceAccount", "ray-app")
    assert sa["automountServiceAccountToken"] is False
    for name, template in rayjob_templates(one(objs, "RayJob")).items():
        spec = template["spec"]
        assert spec["serviceAccountName"] == "ray-app", name
        # Workers need it: rank 0 labels its own pod. Head and submitter never call the API.
        assert spec.get("automountServiceAccountToken", False) is name.startswith("workers/"), name


def test_on_the_gpu_overlay_only_the_pods_that_request_gpus_can_see_one():
    """The gpu image sets NVIDIA_VISIBLE_DEVICES=all for the NVIDIA runtime (docker/Dockerfile): a pod that
    requests no nvidia.com/gpu (the head, the submitter) overrides it with "void", or on a node whose default
    runtime is NVIDIA's it would see every GPU of the node; the GPU workers leave it to the device plugin."""
    for rel in ("overlays/gpu", *(r for r in KUSTOMIZATIONS if r.startswith("overlays/gpu+"))):
        rayjob = one(render(rel), "RayJob")
        for where, template in rayjob_templates(rayjob).items():
            for kind, c in all_containers(template["spec"]):
                wants_gpu = any("nvidia.com/gpu" in (c.get("resources") or {}).get(k, {}) for k in ("limits", "requests"))
                env = {e["name"]: e.get("value") for e in c.get("env") or []}
                if wants_gpu:
                    assert "NVIDIA_VISIBLE_DEVICES" not in env, f"{rel} {where} {kind}/{c['name']}"
                else:
                    assert env.get("NVIDIA_VISIBLE_DEVICES") == "void", f"{rel} {where} {kind}/{c['name']}"
