"""What a local run listens on: the kit's own sockets on loopback; on every interface only Ray's, and the
rendezvous store Ray Train's torch backend starts.

One real `ray-app train` (no RAY_ADDRESS: the driver starts its own Ray, 2 CPU workers, gloo, metrics on).
Once rank 0's exporter is up (the process group is up by then), every listening TCP socket of the
driver's process tree is listed and named by who owns it:

- Ray's daemons (GCS, raylet, dashboard, autoscaler and log monitors, dashboard and runtime-env agents), whole;
- the core worker gRPC server of every Ray worker process and of the driver (its port is in that
  process's core worker log: "worker (driver) server started, listening on port N");
- in the Ray Train workers, the rest: the kit's exporter (``metrics.port``), torch's rendezvous store
  (the TCPStore Ray Train's torch backend starts on rank 0: the listener every worker, rank 0
  included, is connected to) and gloo's listeners (everything else).

Where this machine's host name resolves to a loopback address, gloo would pick loopback by itself,
so (given root and ``unshare``) the run gets a private /etc/hosts in which the host name resolves to
this machine's network address, as on a laptop whose host name is its address on the local network.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.support.ports import free_port
from tests.support.processes import train_workers

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]

EPOCHS, STEPS_PER_EPOCH = 4, 32  # 1024 samples / 2 workers / batch 16
# rank 0's loader sleeps PACE_S per batch (rank 1 waits for it in the all-reduce): the run trains for at least
# EPOCHS x STEPS_PER_EPOCH x PACE_S = 19 s, so its sockets are listed while it trains however loaded the
# machine (at full speed it trained for a few seconds, and a loaded machine's scan could miss them all)
PACE_S = 0.15
WORKLOAD = [
    "--set", "data.name=tests.support.faulty_data:slow_rank",
    "--set", f"data.args={{name: synthetic, rank: 0, delay_s: {PACE_S}, batch_size: 16}}",
    "--set", "data.args.num_samples=1024", "--set", "data.args.image_size=16",
    "--set", "data.batch_size=16", "--set", "model.name=digits_cnn", "--set", f"train.epochs={EPOCHS}",
    "--set", "train.log_every_steps=8", "--set", "metrics.enabled=true",
]

# Ray's own server processes (by executable name, or how their command line starts): every socket they
# hold is Ray's, and Ray's choice.
RAY_DAEMONS = {
    "gcs_server": "Ray GCS",
    "raylet": "Ray raylet",
    "ray/dashboard/dashboard.py": "Ray dashboard",
    "ray/autoscaler/_private/monitor.py": "Ray autoscaler monitor",
    "ray/_private/log_monitor.py": "Ray log monitor",
    "ray::DashboardAgent": "Ray dashboard agent",
    "ray::RuntimeEnvAgent": "Ray runtime-env agent",
}
CORE_WORKER = "Ray core worker gRPC"
RENDEZVOUS = "torch rendezvous store (Ray Train's TCPStore)"
EXPORTER, GLOO = "ray-app metrics exporter", "gloo"
# Listeners the kit does not choose: Ray's, and the rendezvous store (torch 2.14's TCPStore binds every
# interface whatever MASTER_ADDR is; Ray Train's torch backend starts it).
NOT_THE_KITS = {CORE_WORKER, RENDEZVOUS, *RAY_DAEMONS.values()}


@dataclass
class Listener:
    pid: int
    process: str
    ip: str
    port: int
    owner: str = "?"

    @property
    def on_loopback(self) -> bool:
        return ipaddress.ip_address(self.ip.split("%")[0]).is_loopback

    def __str__(self) -> str:
        return f"{self.ip}:{self.port} pid {self.pid} {self.process}: {self.owner}"


def cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def session_logs(tree: list[psutil.Process]) -> Path:
    """The local Ray's log folder, from its GCS's command line."""
    for p in tree:
        m = re.search(r"--log_dir=(\S+)", cmdline(p))
        if m:
            return Path(m.group(1))
    raise AssertionError("no gcs_server under the driver: it did not start its own Ray")


def core_worker_port(logs: Path, pid: int) -> int | None:
    for log in logs.glob(f"python-core-*_{pid}.log"):
        m = re.search(r"(?:worker|driver) server started, listening on port (\d+)", log.read_text(errors="replace"))
        if m:
            return int(m.group(1))
    return None


def ray_daemon(p: psutil.Process) -> str | None:
    try:
        name, line = p.name(), cmdline(p)
    except psutil.Error:
        return None
    script = next((a for a in line.split()[1:] if a.endswith(".py")), "")  # python [-u] SCRIPT ...
    for marker, owner in RAY_DAEMONS.items():
        if name == marker or line.startswith(marker) or script.endswith(marker):
            return owner
    return None


def listeners_of(p: psutil.Process) -> list[Listener]:
    try:
        conns = p.net_connections("tcp")
        name = cmdline(p).strip()[:60] or p.name()
    except psutil.Error:
        return []
    return [Listener(p.pid, name, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]


def process_tree(root: int) -> list[psutil.Process]:
    try:
        top = psutil.Process(root)
        return [top, *top.children(recursive=True)]
    except psutil.Error:
        return []


def store_port(workers: list[psutil.Process], listening: set[int]) -> int | None:
    """The port of torch's TCPStore: a worker's listener that every worker is connected to as a client."""
    remotes = []
    for w in workers:
        try:
            remotes.append({c.raddr.port for c in w.net_connections("tcp") if c.raddr and c.status == "ESTABLISHED"})
        except psutil.Error:
            return None
    common = set.intersection(*remotes) & listening if remotes else set()
    return min(common) if len(common) == 1 else None


def owned_sockets(root: int, metrics_port: int) -> tuple[list[Listener], set[int]]:
    """Every listening TCP socket of ``root``'s process tree, each with its owner; the Ray Train workers' pids."""
    tree = process_tree(root)
    logs = session_logs(tree)
    workers = train_workers(root)
    worker_pids = {w.pid for w in workers}
    found = []
    for p in tree:
        mine = listeners_of(p)
        daemon = ray_daemon(p)
        grpc = core_worker_port(logs, p.pid) if daemon is None else None
        for s in mine:
            if daemon:
                s.owner = daemon
            elif s.port == grpc:
                s.owner = CORE_WORKER
        found += mine
    in_workers = [s for s in found if s.pid in worker_pids and s.owner == "?"]
    store = store_port(workers, {s.port for s in in_workers})
    for s in in_workers:
        s.owner = EXPORTER if s.port == metrics_port else RENDEZVOUS if s.port == store else GLOO
    return found, worker_pids


def network_address() -> str | None:
    """An IPv4 address of this machine on an interface that is up, not loopback."""
    stats = psutil.net_if_stats()
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET and stats.get(name) and stats[name].isup and \
                    not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return None


def hostname_on_the_network(tmp: Path) -> list[str]:
    """A command prefix that runs the driver with the host name resolving to this machine's network
    address (a private /etc/hosts in a mount namespace); none where it already does or cannot."""
    try:
        resolves_to_loopback = ipaddress.ip_address(socket.gethostbyname(socket.gethostname())).is_loopback
    except OSError:
        resolves_to_loopback = True
    address, unshare = network_address(), shutil.which("unshare")
    if not resolves_to_loopback or address is None or unshare is None or os.geteuid() != 0:
        return []
    name = socket.gethostname()
    kept = [ln for ln in Path("/etc/hosts").read_text().splitlines() if name not in ln.split("#")[0].split()[1:]]
    hosts = tmp / "hosts"
    hosts.write_text("\n".join([*kept, f"{address} {name}", ""]))
    probe = subprocess.run([unshare, "-m", "sh", "-c", f"mount --bind {hosts} /etc/hosts && getent hosts {name}"],
                           capture_output=True, text=True)
    if probe.returncode != 0 or address not in probe.stdout:
        return []
    return [unshare, "-m", "sh", "-c", f'mount --bind {hosts} /etc/hosts && exec "$0" "$@"']


def test_a_local_run_listens_on_loopback_except_for_rays_own_servers(tmp_path):
    metrics_port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "GLOO_SOCKET_IFNAME", "RAY_APP_METRICS_BIND")}
    env["OMP_NUM_THREADS"] = "1"
    prefix = hostname_on_the_network(tmp_path)
    cmd = [*prefix, sys.executable, "-m", "ray_app", "train", "--set", f"run.storage={tmp_path}",
           "--set", "run.name=sockets", "--set", f"metrics.port={metrics_port}", *WORKLOAD]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(ln.rstrip("\n") for ln in proc.stdout), daemon=True)
    reader.start()
    sockets: list[Listener] = []
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if any(s.port == metrics_port for p in process_tree(proc.pid) for s in listeners_of(p)):
                break  # rank 0 serves metrics: the process group (gloo and its store) is up on every rank
            time.sleep(0.2)
        listed_while_training = proc.poll() is None
        sockets, workers = owned_sockets(proc.pid, metrics_port)
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join(timeout=10)
    text = "\n".join(lines)
    table = "\n".join(f"  {s}" for s in sorted(sockets, key=lambda s: (s.pid, s.port)))
    print(f"\n[local sockets] host name on the network: {bool(prefix)}; listening sockets of the run:\n{table}")
    assert rc == 0, text[-4000:]
    assert json.loads(text.strip().splitlines()[-1])["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert listed_while_training, f"the run ended before rank 0's exporter was seen listening:\n{table}"

    exposed = [s for s in sockets if not s.on_loopback]
    not_rays = [s for s in exposed if s.owner not in NOT_THE_KITS]
    assert not not_rays, ("listening beyond loopback, not Ray's:\n" + "\n".join(f"  {s}" for s in not_rays)
                          + "\nall non-loopback listeners:\n" + "\n".join(f"  {s}" for s in exposed))
    exporter = [s for s in sockets if s.owner == EXPORTER]
    assert [s.ip for s in exporter] == ["127.0.0.1"], f"the exporter must bind 127.0.0.1 only:\n{table}"
    gloo = [s for s in sockets if s.owner == GLOO]
    assert len(workers) == 2 and {s.pid for s in gloo} == workers, f"a worker without a gloo listener:\n{table}"
    assert all(s.ip == "127.0.0.1" for s in gloo), f"gloo must listen on loopback:\n{table}"
