"""A real Prometheus scrapes a real 2-worker training run.

Debian's `prometheus` runs on 127.0.0.1 with a 1 s scrape interval, the
shipped alert rules, and the compose path's discovery: rank 0 writes its own
file_sd target (RAY_APP_METRICS_SD_DIR) and Prometheus finds it there. One
`ray-app train` run (local Ray, 2 CPU workers) serves the whole module; its
rank 1 reads its first 40 batches slowly (0.1 s each, a data plug-in that
sleeps on that rank, first worker group only). The tests run in order: scrape,
the slowed rank named and shown, one exporter, kill rank 0, clean end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from ray_app.shared import journal
from ray_app.shared.catalog import newest_good
from ray_app.shared.storage import LocalStorage
from tests.support.ports import free_port
from tests.support.processes import stop_process

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "monitoring" / "rules" / "ray-app.rules.yml"
RUN = "metrics-it"
SLOW_DATA = "tests.support.faulty_data:slow_rank"


def require(binary: str) -> str:
    path = shutil.which(binary)
    if path:
        return path
    if os.environ.get("REQUIRE_DOCKER") == "1" or os.environ.get("REQUIRE_PROMETHEUS") == "1":
        pytest.fail(f"{binary} is required (REQUIRE_DOCKER/REQUIRE_PROMETHEUS=1): apt-get install -y prometheus")
    pytest.skip(f"{binary} not installed (apt-get install -y prometheus)")


def wait_for(what: str, check, timeout: float, interval: float = 0.5, on_timeout=lambda: ""):
    """Poll ``check()`` until it returns something truthy; fail with ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{on_timeout()}")


def listeners(port: int) -> list[int]:
    """PIDs of the processes listening on TCP ``port`` (any address)."""
    out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    return sorted({int(p) for p in re.findall(r"pid=(\d+)", out)})


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def descendants(root: int) -> list[int]:
    """Every live process under ``root`` (the ray-app driver: raylet, workers, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class Prometheus:
    def __init__(self, tmp: Path, sd_dir: Path):
        self.port = free_port()
        config = tmp / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "ray-app",
                                "file_sd_configs": [{"files": [str(sd_dir / "ray-app-*.json")], "refresh_interval": "5s"}]}],
        }))
        self.log = tmp / "prometheus.log"
        self.proc = subprocess.Popen(
            [require("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        wait_for("Prometheus to be ready", self.ready, timeout=60, on_timeout=self.log.read_text)

    def get(self, path: str, **params) -> dict:
        url = f"http://127.0.0.1:{self.port}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def query(self, expr: str) -> list[tuple[dict, float]]:
        """Instant query: [(labels, value), ...]."""
        return [(r["metric"], float(r["value"][1])) for r in self.get("/api/v1/query", query=expr)["result"]]

    def scalar(self, expr: str) -> float | None:
        rows = self.query(expr)
        assert len(rows) <= 1, f"{expr}: more than one series: {rows}"
        return rows[0][1] if rows else None

    def targets(self) -> list[dict]:
        return self.get("/api/v1/targets", state="active")["activeTargets"]

    def stop(self) -> None:
        stop_process(self.proc, grace_s=30)


class TrainingRun:
    """``ray-app train`` in a subprocess, long enough (~2-3 min) for every check below: 20 epochs (at 10, a run on a
    machine less loaded than usual ended before the rank-0 kill, and the checks after it waited on a finished run)."""

    def __init__(self, tmp: Path, sd_dir: Path, metrics_port: int):
        self.port, self.sd_dir = metrics_port, sd_dir
        self.storage = tmp / "runs"
        self.sd_file = sd_dir / f"ray-app-{RUN}.json"
        self.log, self.stdout = tmp / "train.log", tmp / "train.stdout"
        ray_app = Path(sys.executable).with_name("ray-app")
        cmd = [str(ray_app)] if ray_app.exists() else [sys.executable, "-m", "ray_app"]
        cmd.append("train")
        overrides = {
            "run.name": RUN, "run.storage": str(self.storage),
            "data.name": SLOW_DATA, "model.name": "mlp",
            "data.args": f"{{name: synthetic, num_samples: 4096, rank: 1, delay_s: 0.1, batches: 40, once: {tmp / 'slowed'}}}",
            "train.epochs": 20, "train.log_every_steps": 5,
            "checkpoint.every_steps": 20, "checkpoint.every_epochs": 1,
            "scaling.num_workers": 2, "failure.max_failures": 2,
            "metrics.port": metrics_port,
        }
        for key, value in overrides.items():
            cmd += ["--set", f"{key}={value}"]
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a fresh local Ray, not someone's cluster
        env.update({"RAY_APP_METRICS_SD_DIR": str(sd_dir), "RAY_APP_METRICS_HOST": "127.0.0.1", "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))})  # the slow data
        self.proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=self.stdout.open("w"), stderr=self.log.open("w"),
                                     start_new_session=True)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(line for f in (self.stdout, self.log) for line in f.read_text(errors="replace").splitlines()[-lines:])

    def stragglers(self) -> list[str]:
        """Rank 0's lines naming a rank that stays behind (each once, wherever Ray forwarded it)."""
        text = self.stdout.read_text(errors="replace") + self.log.read_text(errors="replace")
        return sorted(set(re.findall(r"straggler: .*", text)))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGINT)  # Ray's driver shuts its local cluster down on Ctrl-C
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # our own session only
                self.proc.wait()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metrics-it")
    sd_dir = tmp / "targets"
    sd_dir.mkdir()
    prom = Prometheus(tmp, sd_dir)
    run = TrainingRun(tmp, sd_dir, free_port())
    try:
        yield prom, run
    finally:
        run.stop()
        prom.stop()


def serving(prom: Prometheus, run: TrainingRun, timeout: float = 240) -> None:
    """Wait until Prometheus scrapes rank 0 successfully and has a global step above 0; fail at once if the run
    has ended (every caller checks a live run: waiting on a finished one would only time out)."""
    def check():
        assert run.alive(), f"the run ended (exit {run.proc.returncode}) before this check\n{run.tail()}"
        step = prom.scalar('ray_app_global_step{job="ray-app"}')
        return step is not None and step > 0
    wait_for("Prometheus to scrape a global step from rank 0", check, timeout,
             on_timeout=lambda: f"targets: {prom.targets()}\n{run.tail()}")


def test_prometheus_scrapes_loss_throughput_and_a_growing_step(stack):
    prom, run = stack
    serving(prom, run)
    assert [t["labels"]["instance"] for t in prom.targets()] == [f"127.0.0.1:{run.port}"]
    t0 = time.monotonic()
    first = prom.scalar("ray_app_global_step")
    loss = wait_for("a train loss", lambda: [v for _, v in prom.query("ray_app_train_loss") if v > 0], 60)
    assert 0 < loss[0] < 10
    assert prom.scalar("ray_app_samples_per_second") > 0
    assert prom.scalar("ray_app_world_size") == 2
    (info, _), = prom.query("ray_app_info")
    assert (info["run"], info["model"], info["dataset"]) == (RUN, "mlp", SLOW_DATA)
    second = wait_for("the global step to grow between scrapes",
                      lambda: (s := prom.scalar("ray_app_global_step")) is not None and s > first and s, 60)
    print(f"global step {first:.0f} -> {second:.0f} in {time.monotonic() - t0:.1f}s; loss {loss[0]:.3f}")
    # the shipped rules load and evaluate against real series
    groups = prom.get("/api/v1/rules")["groups"]
    assert {r["health"] for g in groups for r in g["rules"]} == {"ok"}, groups
    wait_for("the recorded throughput", lambda: prom.scalar("ray_app:samples_processed:rate1m"), 30)


def test_a_slowed_rank_is_named_with_its_host_within_three_intervals_and_prometheus_shows_it(stack):
    prom, run = stack
    serving(prom, run)
    (line,) = wait_for("rank 0's line naming the slowed rank", run.stragglers, 120, on_timeout=run.tail)
    print(line)
    m = re.match(r"straggler: rank (\d+) on host (\S+) is behind for 3 log intervals to step (\d+):", line)
    assert m, line
    assert (m.group(1), m.group(2)) == ("1", socket.gethostname()) and int(m.group(3)) <= 15  # 3 intervals of 5
    assert "its data wait explains it" in line
    # the per-rank series in Prometheus, labelled with rank and host: rank 1 well above rank 0 while it was slow
    host = socket.gethostname()
    window = "[10m]"
    # the line comes with the gauges' values; a scrape (every second) after it brings them to Prometheus
    def slow_scraped():
        value = prom.scalar(f'max_over_time(ray_app_rank_step_seconds{{rank="1", host="{host}"}}{window})')
        return value if value is not None and value > 0.05 else None

    slow = wait_for("rank 1's slow steps (> 0.05 s) in Prometheus", slow_scraped, 30)
    fast = prom.scalar(f'quantile_over_time(0.5, ray_app_rank_step_seconds{{rank="0", host="{host}"}}{window})')
    slow_wait = prom.scalar(f'max_over_time(ray_app_rank_data_wait_seconds{{rank="1", host="{host}"}}{window})')
    fast_wait = prom.scalar(f'quantile_over_time(0.5, ray_app_rank_data_wait_seconds{{rank="0", host="{host}"}}{window})')
    print(f"Prometheus: rank 1 {slow:.3f} s own per step (data wait {slow_wait:.3f} s), "
          f"rank 0's median {fast:.3f} s (data wait {fast_wait:.3f} s)")
    # the injected data wait (0.1 s a batch) on top of whatever the load makes a step cost on both ranks
    assert slow > 0.05 and slow > fast + 0.05 and slow_wait > 0.05 > fast_wait


def test_exactly_one_process_serves_metrics(stack):
    prom, run = stack
    serving(prom, run)
    workers = [p for p in descendants(run.proc.pid) if cmdline(p).startswith("ray::RayTrainWorker")]
    serving_pids = listeners(run.port)
    assert len(workers) == 2, [cmdline(p) for p in workers]
    assert len(serving_pids) == 1 and serving_pids[0] in workers, (serving_pids, workers)
    assert json.loads(run.sd_file.read_text()) == [{"targets": [f"127.0.0.1:{run.port}"], "labels": {}}]
    assert len(prom.targets()) == 1 and len(prom.query("ray_app_info")) == 1


def test_killed_rank0_comes_back_and_reports_resumed_step(stack):
    prom, run = stack
    serving(prom, run)
    wait_for("a committed checkpoint", lambda: (prom.scalar("max(ray_app_last_checkpoint_timestamp_seconds)") or 0) > 0, 120)
    step_before = prom.scalar("ray_app_global_step")
    (rank0,) = listeners(run.port)
    assert cmdline(rank0).startswith("ray::RayTrainWorker")
    t_kill = time.monotonic()
    os.kill(rank0, signal.SIGKILL)
    # the newest committed checkpoint at the kill (rank 0 writes them, so none lands after it):
    # Prometheus' last scrape may lag the training by more than a checkpoint interval
    newest = newest_good(LocalStorage(str(run.storage)), RUN).name
    committed = int(newest[len("ckpt-s"):].split("-")[0])

    def new_rank0():
        pids = listeners(run.port)
        return pids if pids and pids != [rank0] else None
    pids = wait_for("a new rank 0 serving the metrics port", new_rank0, 240, on_timeout=run.tail)
    assert len(pids) == 1 and cmdline(pids[0]).startswith("ray::RayTrainWorker")
    resumed = wait_for("Prometheus to see ray_app_resumed_from_step > 0",
                       lambda: prom.scalar("ray_app_resumed_from_step > 0"), 120, on_timeout=run.tail)
    print(f"rank 0 pid {rank0} killed at step {step_before:.0f}; pid {pids[0]} serves again after "
          f"{time.monotonic() - t_kill:.1f}s, resumed from step {resumed:.0f}")
    assert resumed == committed, f"resumed from step {resumed}, newest committed checkpoint at the kill: {committed}"
    wait_for("training to continue after the restart", lambda: (prom.scalar("ray_app_global_step") or 0) > resumed, 120)
    # the new rank 0's goodput is the whole run's: its journal holds the first attempt and the restart
    goodput = wait_for("the run's goodput from the new rank 0", lambda: prom.scalar("ray_app_goodput_ratio"), 120,
                       on_timeout=run.tail)
    events = journal.read_events(LocalStorage(str(run.storage)), RUN)
    kinds = [e["kind"] for e in events]
    assert kinds.count("attempt") == 2 and kinds.count("restart") == 1, kinds
    whole = journal.account(events, now=time.time())
    assert 0 < goodput < 1 and whole["parts"]["restarts"] > 0, (goodput, whole)
    print(f"goodput after the restart: {goodput:.3f} scraped, {whole['goodput_ratio']:.3f} from the journal now")
    def firing():
        return {a["labels"]["alertname"] for a in prom.get("/api/v1/alerts")["alerts"] if a["state"] == "firing"}
    wait_for("the RayAppWorkerGroupResumed alert", lambda: "RayAppWorkerGroupResumed" in firing(), 60,
             on_timeout=lambda: json.dumps([prom.get("/api/v1/alerts"), prom.get("/api/v1/rules"),
                                            prom.get("/api/v1/query", query="up[60s]"),
                                            prom.get("/api/v1/query", query="ray_app_worker_group_starts_created[60s]")]))
    assert len(prom.targets()) == 1  # the same single target, never a stale second one


def test_clean_end_withdraws_the_target(stack):
    prom, run = stack
    run.proc.wait(timeout=600)
    assert run.proc.returncode == 0, run.tail()
    summary = json.loads(run.stdout.read_text().strip().splitlines()[-1])
    assert summary["resumed_from_step"] > 0
    assert len(run.stragglers()) == 1  # the slowed window only: no other rank, interval or worker group named
    assert not run.sd_file.exists()
    wait_for("Prometheus to drop the finished run's target", lambda: prom.targets() == [], 30)
    assert listeners(run.port) == []
