"""ray_app/worker/podlabel.py: rank 0 labels its own pod for the PodMonitor.

A real HTTP server on 127.0.0.1 stands in for the Kubernetes API server and
records what it receives."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from ray_app.worker import podlabel

TOKEN = "test-sa-token"
NS = "ray-app"


class FakeApiServer:
    """Pods in one namespace; answers GET pod, LIST pods by label, PATCH pod."""

    def __init__(self, pods: dict[str, dict], fail_patch: int = 0, delay: float = 0.0):
        self.pods, self.fail_patch, self.delay = pods, fail_patch, delay
        self.requests: list[dict] = []
        self.replies: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code: int, body: dict):
                if code >= 400:  # the API server's errors are Status objects
                    body = {"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": code, **body}
                fake.replies.append(body)
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _record(self, body=None):
                fake.requests.append({"method": self.command, "path": self.path, "body": body,
                                      "auth": self.headers.get("Authorization"),
                                      "content_type": self.headers.get("Content-Type")})
                time.sleep(fake.delay)

            def do_GET(self):
                self._record()
                url = urlsplit(self.path)
                prefix = f"/api/v1/namespaces/{NS}/pods"
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._reply(401, {"reason": "Unauthorized"})
                if url.path == prefix:
                    selector = parse_qs(url.query)["labelSelector"][0]
                    wanted = dict(term.split("=") for term in selector.split(","))
                    items = [{"metadata": {"name": n, "labels": labels}} for n, labels in fake.pods.items()
                             if wanted.items() <= labels.items()]
                    return self._reply(200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items})
                name = url.path.removeprefix(prefix + "/")
                if name not in fake.pods:
                    return self._reply(404, {"reason": "NotFound"})
                return self._reply(200, pod(name))

            def do_PATCH(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self._record(body)
                if fake.fail_patch:
                    return self._reply(fake.fail_patch, {"reason": "Forbidden"})
                name = self.path.rsplit("/", 1)[1]
                for key, value in body["metadata"]["labels"].items():
                    if value is None:
                        fake.pods[name].pop(key, None)
                    else:
                        fake.pods[name][key] = value
                return self._reply(200, pod(name))

        def pod(name: str) -> dict:
            return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": fake.pods[name]}}

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                pass  # a client that gave up (the timeout test) is expected

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def sa_dir(tmp_path):
    (tmp_path / "token").write_text(TOKEN + "\n")
    return str(tmp_path)


def pod_env(name="worker-b"):
    return {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "6443",
            "POD_NAME": name, "POD_NAMESPACE": NS}


def cluster_pods():
    """worker-a was rank 0 before a restart; worker-b is rank 0 now; other-x belongs to another RayCluster."""
    return {
        "worker-a": {"ray.io/cluster": "job-abc", podlabel.METRICS_LABEL: "true"},
        "worker-b": {"ray.io/cluster": "job-abc"},
        "other-x": {"ray.io/cluster": "job-old", podlabel.METRICS_LABEL: "true"},
    }


@pytest.mark.parametrize("drop", ["KUBERNETES_SERVICE_HOST", "POD_NAME", "POD_NAMESPACE", "token"])
def test_outside_kubernetes_it_is_a_no_op(drop, sa_dir, tmp_path):
    with FakeApiServer(cluster_pods()) as api:
        env = {k: v for k, v in pod_env().items() if k != drop}
        directory = str(tmp_path / "no-such-dir") if drop == "token" else sa_dir
        assert podlabel.label_own_pod_as_metrics_target(env=env, sa_dir=directory, api_base_url=api.url) is False
        assert api.requests == []


# The Kubernetes API's own routes (API reference, core/v1 Pod: list, read, patch) for the calls podlabel makes.
POD_ROUTES = {
    ("GET", "/api/v1/namespaces/{namespace}/pods"),
    ("GET", "/api/v1/namespaces/{namespace}/pods/{name}"),
    ("PATCH", "/api/v1/namespaces/{namespace}/pods/{name}"),
}


def api_route(path: str) -> str:
    parts = urlsplit(path).path.split("/")  # "", api, v1, namespaces, NS, pods[, NAME]
    parts[4] = "{namespace}"
    if len(parts) > 6:
        parts[6] = "{name}"
    return "/".join(parts)


def test_the_fake_api_server_answers_as_the_kubernetes_api_does(sa_dir):
    """The fake serves the Kubernetes API's routes, and each object it answers with is a valid Pod or PodList
    (kubernetes-validate, strict); its errors are Status objects, as the API server's are."""
    import kubernetes_validate

    with FakeApiServer(cluster_pods()) as api:
        assert podlabel.label_own_pod_as_metrics_target(env=pod_env(), sa_dir=sa_dir, api_base_url=api.url) is True
    assert {(r["method"], api_route(r["path"])) for r in api.requests} == POD_ROUTES
    assert {r["kind"] for r in api.replies} == {"Pod", "PodList"}
    for reply in api.replies:
        kubernetes_validate.validate(reply, "1.30.0", strict=True)


def test_plain_machine_returns_false():
    assert podlabel.label_own_pod_as_metrics_target(env={}) is False


def test_labels_own_pod_with_bearer_token_and_clears_the_former_rank0(sa_dir):
    with FakeApiServer(cluster_pods()) as api:
        assert podlabel.label_own_pod_as_metrics_target(env=pod_env(), sa_dir=sa_dir, api_base_url=api.url) is True
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in api.requests)
    patches = [r for r in api.requests if r["method"] == "PATCH"]
    assert patches[0]["path"] == f"/api/v1/namespaces/{NS}/pods/worker-b"
    assert patches[0]["content_type"] == "application/merge-patch+json"
    assert patches[0]["body"] == {"metadata": {"labels": {podlabel.METRICS_LABEL: "true"}}}
    # The former rank 0 of the same RayCluster loses the label (null deletes in a merge patch);
    # pods of other RayClusters are not touched.
    assert patches[1]["path"] == f"/api/v1/namespaces/{NS}/pods/worker-a"
    assert patches[1]["body"] == {"metadata": {"labels": {podlabel.METRICS_LABEL: None}}}
    assert len(patches) == 2
    assert api.pods["worker-b"][podlabel.METRICS_LABEL] == "true"
    assert podlabel.METRICS_LABEL not in api.pods["worker-a"]
    assert api.pods["other-x"][podlabel.METRICS_LABEL] == "true"
    listing = next(r for r in api.requests if "labelSelector" in r["path"])
    assert "ray.io%2Fcluster%3Djob-abc" in listing["path"]


def test_rbac_refusal_is_a_warning_not_an_exception(sa_dir, caplog):
    with FakeApiServer(cluster_pods(), fail_patch=403) as api:
        with caplog.at_level("WARNING", logger="ray_app.worker.podlabel"):
            assert podlabel.label_own_pod_as_metrics_target(env=pod_env(), sa_dir=sa_dir, api_base_url=api.url) is False
    assert "HTTPError" in caplog.text and "403" in caplog.text
    assert TOKEN not in caplog.text


def test_unreachable_or_slow_api_server_gives_up_quickly(sa_dir, monkeypatch):
    assert podlabel.TIMEOUT_S <= 5
    with FakeApiServer(cluster_pods()) as api:
        closed_url = api.url
    assert podlabel.label_own_pod_as_metrics_target(env=pod_env(), sa_dir=sa_dir, api_base_url=closed_url) is False
    monkeypatch.setattr(podlabel, "TIMEOUT_S", 0.3)
    with FakeApiServer(cluster_pods(), delay=1.5) as api:
        start = time.monotonic()
        assert podlabel.label_own_pod_as_metrics_target(env=pod_env(), sa_dir=sa_dir, api_base_url=api.url) is False
        assert time.monotonic() - start < 1.5


def test_in_cluster_address_comes_from_the_service_env(sa_dir):
    base, token, pod, ns = podlabel._in_cluster_settings(pod_env(), sa_dir)
    assert (base, token, pod, ns) == ("https://127.0.0.1:6443", TOKEN, "worker-b", NS)
    v6 = dict(pod_env(), KUBERNETES_SERVICE_HOST="fd00::1")
    assert podlabel._in_cluster_settings(v6, sa_dir)[0] == "https://[fd00::1]:6443"
