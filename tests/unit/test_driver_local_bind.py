"""Where the kit's own sockets listen: loopback on a local run (the kit starts Ray), every interface on
a cluster (Prometheus scrapes rank 0 from another host). The real sockets of a local run are listed
in tests/integration/test_local_sockets.py."""

from __future__ import annotations

import os
import socket
import sys

import psutil
import pytest

from ray_app.driver import launcher as driver
from ray_app.shared import ray_seam
from ray_app.shared.config import Config
from ray_app.worker.metrics import ADVERTISE_HOST_ENV, BIND_ENV, PrometheusMetrics, advertised_host
from tests.support.stand_ins import assert_stands_in_for


class FakeRay:
    """What init_ray calls on ``ray``; records the environment the local Ray would start with."""

    def __init__(self):
        self.calls = []

    def init(self, **kwargs):
        self.calls.append((kwargs, dict(os.environ)))

    def cluster_resources(self):
        return {"CPU": 64}


def test_the_fake_ray_takes_its_calls_as_ray_does():
    import ray

    assert_stands_in_for(FakeRay(), ray)


@pytest.fixture
def fake_ray(monkeypatch):
    """A fake ``ray``; the environment init_ray changes is put back afterwards."""
    saved = dict(os.environ)
    monkeypatch.setitem(sys.modules, "ray", FakeRay())
    for key in ("RAY_ADDRESS", "GLOO_SOCKET_IFNAME", BIND_ENV):
        os.environ.pop(key, None)
    yield sys.modules["ray"]
    os.environ.clear()
    os.environ.update(saved)


def test_a_local_run_binds_the_exporter_and_gloo_to_loopback():
    env = driver.local_bind_env({})
    assert env == {"GLOO_SOCKET_IFNAME": driver.loopback_interface(), BIND_ENV: "127.0.0.1"}
    addresses = psutil.net_if_addrs()[env["GLOO_SOCKET_IFNAME"]]
    assert "127.0.0.1" in {a.address for a in addresses}  # `lo` on Linux


def test_a_users_own_interface_and_bind_address_are_kept():
    assert driver.local_bind_env({"GLOO_SOCKET_IFNAME": "eth1", BIND_ENV: "0.0.0.0"}) == {}


def test_the_local_ray_starts_with_the_loopback_environment(fake_ray):
    driver.init_ray(Config())
    (kwargs, env), = fake_ray.calls
    assert kwargs["address"] == "local" and kwargs["dashboard_host"] == "127.0.0.1"
    assert kwargs["include_dashboard"] is False  # Ray Train needs none; it cost ~5 s of ray.init
    assert env["GLOO_SOCKET_IFNAME"] == driver.loopback_interface() and env[BIND_ENV] == "127.0.0.1"


def test_the_dashboard_of_a_local_run_is_asked_for(fake_ray, monkeypatch):
    monkeypatch.setenv(driver.DASHBOARD_ENV, "1")
    driver.init_ray(Config())
    (kwargs, _), = fake_ray.calls
    assert kwargs["include_dashboard"] is True and kwargs["dashboard_host"] == "127.0.0.1"


def test_a_cluster_run_leaves_the_workers_binding_to_the_cluster(fake_ray, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "ray-head:6379")
    driver.init_ray(Config())
    (kwargs, env), = fake_ray.calls
    assert kwargs == {"address": "ray-head:6379", "logging_level": kwargs["logging_level"]}
    assert "GLOO_SOCKET_IFNAME" not in env and BIND_ENV not in env


def test_the_exporter_binds_all_interfaces_unless_told(monkeypatch):
    monkeypatch.delenv(BIND_ENV, raising=False)
    assert PrometheusMetrics(port=9500).bind == "0.0.0.0"  # Prometheus scrapes rank 0 from another host
    monkeypatch.setenv(BIND_ENV, "127.0.0.1")
    assert PrometheusMetrics(port=9500).bind == "127.0.0.1"
    assert PrometheusMetrics(port=9500, bind="10.1.2.3").bind == "10.1.2.3"


def test_the_exporter_serves_on_the_address_it_was_told(monkeypatch):
    monkeypatch.setenv(BIND_ENV, "127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    m = PrometheusMetrics(port=port)
    m._serve(attempts=1)
    try:
        assert m._server.server_address[:2] == ("127.0.0.1", port)
    finally:
        m.close()


def test_the_announced_target_is_the_bound_address_unless_set(monkeypatch):
    monkeypatch.delenv(ADVERTISE_HOST_ENV, raising=False)
    assert advertised_host("127.0.0.1") == "127.0.0.1"  # a local Prometheus can reach what was bound
    assert advertised_host("0.0.0.0") == socket.gethostbyname(socket.gethostname())  # a container's own IP
    monkeypatch.setenv(ADVERTISE_HOST_ENV, "10.0.0.7")
    assert advertised_host("127.0.0.1") == "10.0.0.7"


LOCAL_RAY_PROCESSES = """
import json, psutil, ray
from ray_app.driver import launcher as driver
from ray_app.shared import ray_seam
from ray_app.shared.config import Config
driver.init_ray(Config())
procs = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
answer = ray.get(ray.remote(lambda: 41).remote()) + 1
ray.shutdown()
print(json.dumps({"procs": procs, "answer": answer}))
"""


def test_a_local_ray_starts_no_api_server_and_no_autoscaler_monitor(tmp_path):
    """A real local Ray started by the kit without the dashboard: Ray's own servers and a worker, but not
    the API server ``include_dashboard=False`` still starts (``ray.init`` waits for it) nor the monitor
    of an autoscaler a local Ray does not have; tasks run."""
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", driver.DASHBOARD_ENV)}
    out = subprocess.run([sys.executable, "-c", LOCAL_RAY_PROCESSES], capture_output=True, text=True, timeout=120,
                         env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["answer"] == 42
    procs = seen["procs"]
    for server in ("gcs_server", "raylet", "log_monitor.py"):
        assert any(server in p for p in procs), (server, procs)
    assert not [p for p in procs if "dashboard/dashboard.py" in p or "autoscaler/_private/monitor.py" in p], procs


def test_the_api_server_starts_when_the_dashboard_is_asked_for():
    from ray._private.node import Node

    before = Node.start_api_server, Node.start_monitor
    with ray_seam.lean_local_ray(api_server=True):
        assert Node.start_api_server is before[0] and Node.start_monitor is not before[1]
    with ray_seam.lean_local_ray(api_server=False):
        assert Node.start_api_server is not before[0]
    assert (Node.start_api_server, Node.start_monitor) == before  # put back after ray.init
