"""Where the egress NetworkPolicy lets the Ray pods and the submitter connect,
evaluated as a NetworkPolicy implementation would (peers, ports, ipBlocks,
label selectors) for the destinations a first deploy needs: the cluster's DNS
however it is deployed, and each S3 credential source the docs name."""

from __future__ import annotations

import ipaddress

import pytest

from tests.support.k8s import DEPLOYABLE, K8S, NAMESPACE, REPO, render


def selects(selector: dict | None, labels: dict) -> bool:
    """A LabelSelector; None or {} selects everything."""
    if not selector:
        return True
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def port_matches(rule: dict, port: int, protocol: str) -> bool:
    ports = rule.get("ports")
    if not ports:
        return True  # all ports
    for p in ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        low = p.get("port")
        if low is None or low == port or (isinstance(low, int) and low <= port <= p.get("endPort", low)):
            return True
    return False


def peer_matches(peer: dict, *, ip: str | None, namespace_labels: dict | None, pod_labels: dict | None) -> bool:
    if "ipBlock" in peer:
        if ip is None:
            return False
        addr, block = ipaddress.ip_address(ip), peer["ipBlock"]
        net = ipaddress.ip_network(block["cidr"])
        return addr.version == net.version and addr in net and not any(
            addr in ipaddress.ip_network(e) for e in block.get("except") or [] if ipaddress.ip_network(e).version == addr.version)
    if pod_labels is None:
        return False
    if "namespaceSelector" in peer:
        ns_ok = selects(peer["namespaceSelector"], namespace_labels or {})
    else:  # a podSelector alone: pods of the policy's own namespace
        ns_ok = (namespace_labels or {}).get("kubernetes.io/metadata.name") == NAMESPACE
    return ns_ok and selects(peer.get("podSelector"), pod_labels)


def egress_allows(objs: list[dict], *, port: int, protocol: str = "TCP", ip: str | None = None,
                  namespace: str | None = None, pod_labels: dict | None = None) -> bool:
    """Does some egress policy selecting the Ray pods admit this connection?"""
    ns_labels = {"kubernetes.io/metadata.name": namespace} if namespace else None
    for policy in objs:
        if policy["kind"] != "NetworkPolicy" or "Egress" not in policy["spec"]["policyTypes"]:
            continue
        for rule in policy["spec"].get("egress") or []:
            if not port_matches(rule, port, protocol):
                continue
            peers = rule.get("to")
            if not peers or any(peer_matches(p, ip=ip, namespace_labels=ns_labels, pod_labels=pod_labels) for p in peers):
                return True
    return False


# The cluster DNS as clusters deploy it: (namespace, pod labels) or a node-local address.
DNS_PODS = {
    "kube-dns / CoreDNS of kubeadm, kind, EKS, GKE": ("kube-system", {"k8s-app": "kube-dns"}),
    "CoreDNS labelled by its Helm chart": ("kube-system", {"app.kubernetes.io/name": "coredns", "k8s-app": "coredns"}),
    "CoreDNS in its own namespace": ("coredns", {"app.kubernetes.io/name": "coredns"}),
    "OpenShift": ("openshift-dns", {"dns.operator.openshift.io/daemonset-dns": "default"}),
}
NODELOCAL_DNS = "169.254.20.10"


@pytest.mark.parametrize("rel", DEPLOYABLE)
@pytest.mark.parametrize("dns", sorted(DNS_PODS))
def test_dns_resolves_however_the_cluster_runs_it(rel, dns):
    namespace, labels = DNS_PODS[dns]
    objs = render(rel)
    for protocol in ("UDP", "TCP"):
        assert egress_allows(objs, port=53, protocol=protocol, namespace=namespace, pod_labels=labels), f"{rel}: {dns} {protocol}"


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_dns_reaches_nodelocal_dnscache(rel):
    objs = render(rel)
    for protocol in ("UDP", "TCP"):
        assert egress_allows(objs, port=53, protocol=protocol, ip=NODELOCAL_DNS), f"{rel}: NodeLocal DNSCache {protocol}"


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_rules_open_to_any_pod_or_address_name_their_ports(rel):
    """Broad peers (any pod of any namespace, 0.0.0.0/0) only with narrow ports: 53, 443, 6443."""
    for policy in (o for o in render(rel) if o["kind"] == "NetworkPolicy" and "Egress" in o["spec"]["policyTypes"]):
        for rule in policy["spec"]["egress"]:
            broad = [p for p in rule.get("to") or [{}] if p == {} or p.get("namespaceSelector") == {}
                     or p.get("ipBlock", {}).get("cidr") in ("0.0.0.0/0", "::/0")]
            if broad:
                ports = {p.get("port") for p in rule.get("ports") or [{}]}
                assert ports and ports <= {53, 443, 6443}, f"{rel}: {rule}"


# Each credential source the docs name: where the AWS SDK fetches credentials.
# (overlay to render, address, port); S3 itself and STS are public HTTPS endpoints.
CREDENTIAL_SOURCES = {
    "ray-app-s3 Secret (S3 over HTTPS)": ("overlays/gpu", "52.216.0.10", 443),
    "IRSA (STS AssumeRoleWithWebIdentity)": ("overlays/gpu", "54.239.29.25", 443),
    "EKS Pod Identity": ("overlays/gpu+components/egress-eks-pod-identity", "169.254.170.23", 80),
    "EKS Pod Identity (IPv6)": ("overlays/gpu+components/egress-eks-pod-identity", "fd00:ec2::23", 80),
    "EC2 instance role (IMDS)": ("overlays/gpu+components/egress-aws-instance-role", "169.254.169.254", 80),
    "EC2 instance role (IMDS, IPv6)": ("overlays/gpu+components/egress-aws-instance-role", "fd00:ec2::254", 80),
}


@pytest.mark.parametrize("source", sorted(CREDENTIAL_SOURCES))
def test_each_documented_credential_source_can_be_reached(source):
    rel, ip, port = CREDENTIAL_SOURCES[source]
    assert egress_allows(render(rel), port=port, ip=ip), f"{source}: {ip}:{port} blocked by the egress policy of {rel}"
    # The rest stays as the overlay has it: the component adds one rule.
    if "+" in rel:
        base_rules = next(o for o in render(rel.split("+")[0]) if o["metadata"]["name"] == "ray-app-egress")["spec"]["egress"]
        rules = next(o for o in render(rel) if o["metadata"]["name"] == "ray-app-egress")["spec"]["egress"]
        assert rules[: len(base_rules)] == base_rules and len(rules) == len(base_rules) + 1


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_link_local_credential_endpoints_are_closed_by_default(rel):
    """Security by default: the node's role (IMDS) and the Pod Identity agent
    only where the user enables their component."""
    objs = render(rel)
    for ip in ("169.254.169.254", "169.254.170.23", "fd00:ec2::254"):
        assert not egress_allows(objs, port=80, ip=ip), f"{rel}: {ip}:80 open without its component"


CREDENTIAL_COMPONENTS = sorted({rel.split("+components/")[1] for rel, _, _ in CREDENTIAL_SOURCES.values() if "+" in rel})
OTHER_COMPONENTS = {"egress-mlflow": "### Experiment tracking",  # component -> the docs section that says when
                    "kueue": "### Queues and priorities", "priority": "### Queues and priorities"}


def test_every_component_is_a_credential_source_or_documented_elsewhere():
    docs = (REPO / "docs" / "kubernetes.md").read_text()
    for component in sorted(p.parent.name for p in (K8S / "components").glob("*/kustomization.yaml")):
        if component in CREDENTIAL_COMPONENTS:
            continue
        assert component in OTHER_COMPONENTS, f"k8s/components/{component}: neither a credential source nor listed"
        section = docs.split(OTHER_COMPONENTS[component], 1)[1].split("\n## ", 1)[0]
        assert f"k8s/components/{component}" in section, f"docs do not say when to use {component}"
        assert f"../../components/{component}" in (K8S / "overlays" / "gpu" / "kustomization.yaml").read_text()


# An in-cluster MLflow server as its component admits it: (namespace, pod labels, port)
MLFLOW_POD = ("mlflow", {"app.kubernetes.io/name": "mlflow"}, 5000)


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_an_in_cluster_mlflow_server_is_closed_by_default(rel):
    namespace, labels, port = MLFLOW_POD
    assert not egress_allows(render(rel), port=port, namespace=namespace, pod_labels=labels), rel


def test_the_mlflow_component_opens_the_tracking_server_and_nothing_else():
    namespace, labels, port = MLFLOW_POD
    rel = "overlays/gpu+components/egress-mlflow"
    objs = render(rel)
    assert egress_allows(objs, port=port, namespace=namespace, pod_labels=labels)
    assert not egress_allows(objs, port=port, namespace="default", pod_labels=labels)
    assert not egress_allows(objs, port=port, ip="10.0.0.5")
    base_rules = next(o for o in render("overlays/gpu") if o["metadata"]["name"] == "ray-app-egress")["spec"]["egress"]
    rules = next(o for o in objs if o["metadata"]["name"] == "ray-app-egress")["spec"]["egress"]
    assert rules[: len(base_rules)] == base_rules and len(rules) == len(base_rules) + 1


def test_docs_claim_the_credential_sources_that_work_and_how():
    docs = (REPO / "docs" / "kubernetes.md").read_text()
    section = docs.split("### S3 credentials", 1)[1].split("\n## ", 1)[0]
    for component in CREDENTIAL_COMPONENTS:
        assert f"k8s/components/{component}" in section, f"docs do not say when to use {component}"
        assert f"../../components/{component}" in (K8S / "overlays" / "gpu" / "kustomization.yaml").read_text()
    assert "GKE Workload Identity" in section and "not a credential source" in section
    for path in (K8S / "scripts" / "deploy.sh", REPO / "README.md"):
        assert "workload identity" not in path.read_text().lower(), f"{path.name} still promises workload identity"


def test_docs_say_where_network_policies_may_not_hold_and_how_to_check():
    """A NetworkPolicy the plugin ignores is accepted without an error: the
    docs name the cases and give a check a user can run."""
    docs = (REPO / "docs" / "kubernetes.md").read_text()
    assert "### Where NetworkPolicies may not hold" in docs
    section = docs.split("### Where NetworkPolicies may not hold", 1)[1].split("\n## ", 1)[0]
    for needle in ("kindnet", "nfnetlink_queue", "without NetworkPolicy support", "6379", "kubectl -n ray-app run"):
        assert needle in section, needle
    kind_cluster = " ".join((K8S / "kind" / "cluster.yaml").read_text().split())
    assert "kindnet, enforces NetworkPolicy)" not in kind_cluster and "nfnetlink_queue" in kind_cluster
