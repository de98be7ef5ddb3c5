"""Mark this pod as the metrics target: rank 0 labels its own Kubernetes pod.

Only rank 0 serves ``/metrics`` (port ``metrics.port``), and rank 0 may land
on any worker pod, a different one after every worker-group restart. So the
rank-0 process labels its own pod ``ray-app.io/metrics-rank0=true`` and a
PodMonitor selects exactly the pods with that label (k8s/monitoring). The
label is also removed from every other pod of the same RayCluster that still
carries it, so a restarted worker group leaves no stale, "down" target.

Standard library only (urllib + ssl) against the API server, with the pod's
service-account token. The ServiceAccount's one Role allows get/list/patch on
pods in its namespace (k8s/base/rbac.metrics-label.yaml), nothing more.

Outside Kubernetes this is a no-op. It never raises: a failure to label costs
a metrics target, never the training run, so it logs one warning and returns.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Mapping

log = logging.getLogger("ray_app.worker.podlabel")

METRICS_LABEL = "ray-app.io/metrics-rank0"
CLUSTER_LABEL = "ray.io/cluster"  # KubeRay puts it on every pod of a RayCluster
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
TIMEOUT_S = 5.0


class _ApiServer:
    """The few API-server calls this module needs, each bounded by TIMEOUT_S."""

    def __init__(self, base_url: str, token: str, ca_path: str | None):
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.context = None
        if self.base_url.startswith("https://"):
            self.context = ssl.create_default_context(cafile=ca_path if ca_path and os.path.isfile(ca_path) else None)

    def request(self, method: str, path: str, body: dict | None = None, content_type: str = "application/json"):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        with urllib.request.urlopen(req, timeout=TIMEOUT_S, context=self.context) as resp:
            return json.loads(resp.read() or b"{}")

    def pod_path(self, namespace: str, name: str = "") -> str:
        path = f"/api/v1/namespaces/{urllib.parse.quote(namespace)}/pods"
        return f"{path}/{urllib.parse.quote(name)}" if name else path

    def set_label(self, namespace: str, name: str, value: str | None) -> None:
        """JSON merge patch (RFC 7386): a null value deletes the label."""
        patch = {"metadata": {"labels": {METRICS_LABEL: value}}}
        self.request("PATCH", self.pod_path(namespace, name), patch, "application/merge-patch+json")


def _in_cluster_settings(env: Mapping[str, str], sa_dir: str) -> tuple[str, str, str, str] | None:
    """(api base URL, token, pod name, namespace), or None outside Kubernetes."""
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    pod, namespace = env.get("POD_NAME"), env.get("POD_NAMESPACE")
    token_path = os.path.join(sa_dir, "token")
    if not (host and pod and namespace and os.path.isfile(token_path)):
        return None
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    with open(token_path) as f:
        token = f.read().strip()
    return f"https://{host}:{port}", token, pod, namespace


def label_own_pod_as_metrics_target(
    *,
    env: Mapping[str, str] | None = None,
    sa_dir: str = SA_DIR,
    api_base_url: str | None = None,
) -> bool:
    """Label this pod as the rank-0 metrics target; True when the label is set.

    ``env``, ``sa_dir`` and ``api_base_url`` exist for tests (a local HTTP
    server standing in for the API server); production calls take none.
    """
    env = os.environ if env is None else env
    try:
        settings = _in_cluster_settings(env, sa_dir)
        if settings is None:
            return False
        base_url, token, pod, namespace = settings
        api = _ApiServer(api_base_url or base_url, token, os.path.join(sa_dir, "ca.crt"))
        own = api.request("GET", api.pod_path(namespace, pod))
        api.set_label(namespace, pod, "true")
        _clear_stale_labels(api, namespace, pod, (own.get("metadata") or {}).get("labels") or {})
        log.info("labelled pod %s/%s %s=true (Prometheus scrapes rank 0 here)", namespace, pod, METRICS_LABEL)
        return True
    except Exception as exc:  # noqa: BLE001 - labelling must never stop training
        log.warning("could not label this pod as the metrics target (%s: %s); "
                    "check the Role in k8s/base/rbac.metrics-label.yaml", type(exc).__name__, exc)
        return False


def _clear_stale_labels(api: _ApiServer, namespace: str, own_pod: str, own_labels: Mapping[str, str]) -> None:
    """Remove the label from the other pods of this RayCluster (a former rank 0)."""
    cluster = own_labels.get(CLUSTER_LABEL)
    if not cluster:
        return  # not a KubeRay pod: no group to clean up
    selector = urllib.parse.quote(f"{METRICS_LABEL}=true,{CLUSTER_LABEL}={cluster}", safe="")
    pods = api.request("GET", f"{api.pod_path(namespace)}?labelSelector={selector}")
    for item in pods.get("items") or []:
        name = (item.get("metadata") or {}).get("name")
        if name and name != own_pod:
            api.set_label(namespace, name, None)
            log.info("removed %s from pod %s/%s (a former rank 0)", METRICS_LABEL, namespace, name)
