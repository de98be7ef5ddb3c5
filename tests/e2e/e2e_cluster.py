"""The cluster of containers of docker/compose.yaml, started where no image can be pulled.

The Ray nodes are the compose file's own: the same image, the same ``command``
(``ray start ...``), the same environment variable names, ``init``, ``shm_size``
and CPU/memory limits, all read from docker/compose.yaml, and the same
configs/cluster.yaml. Only secret values and the S3 endpoint differ. The two
third-party images of the compose file are replaced by real servers that
install from the package registries (docs/containers.md):

    minio       -> moto_server (the .venv's S3 API server), its own process,
                   listening on the private docker network's gateway address
    prometheus  -> Debian's prometheus binary on 127.0.0.1, running
                   monitoring/prometheus.yml (paths rewritten to temp dirs)

Traffic stays on loopback and on the test's own docker network.
"""

from __future__ import annotations

import copy
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.support.ports import free_port
from tests.support.processes import stop_process
from tests.support.tools import venv_tool

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker" / "compose.yaml"
PROMETHEUS_CONFIG = REPO / "monitoring" / "prometheus.yml"
LOG_DIR = REPO / "build" / "e2e-logs"
BUCKET = "ray-app"
# Kept out of `ray job submit --working-dir .` uploads (as `make compose-submit` does).
SUBMIT_EXCLUDES = [".ray-token", ".minio-secret", ".venv", "runs", "build"]


def docker(*args: str, check: bool = True, timeout: float = 120, env: dict | None = None,
           capture: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], check=check, timeout=timeout, text=True,
                          capture_output=capture, env=env)


def wait_until(predicate, timeout: float, interval: float = 0.5, what: str = "condition", fail_fast=()):
    """Poll ``predicate`` until it returns a truthy value; that value is returned. An exception of a type
    in ``fail_fast`` ends the wait at once (the predicate found that the condition can no longer come)."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except fail_fast:
            raise
        except Exception as exc:  # noqa: BLE001 - retried until the deadline
            last_exc = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}" + (f" (last error: {last_exc})" if last_exc else ""))


# ------------------------------------------------------------ compose file

_VAR = re.compile(r"^\$\{(?P<name>[A-Z0-9_]+)(?::?[-?].*)?\}$")


@dataclass
class NodeSpec:
    """What `docker run` needs from one Ray service of docker/compose.yaml."""

    service: str
    command: list[str]
    environment: dict[str, str]
    init: bool
    shm_size: str | None
    cpus: str | None
    memory: str | None
    replicas: int
    healthcheck: list[str] | None
    container_paths: list[str] = field(default_factory=list)  # volume mount points


def load_compose(path: Path = COMPOSE_FILE) -> dict:
    return yaml.safe_load(path.read_text())


def node_spec(compose: dict, service: str) -> NodeSpec:
    svc = compose["services"][service]
    limits = (svc.get("deploy") or {}).get("resources", {}).get("limits", {})
    health = (svc.get("healthcheck") or {}).get("test")
    if health and health[0] == "CMD":
        health = health[1:]
    return NodeSpec(
        service=service,
        command=list(svc["command"]),
        environment={k: str(v) for k, v in (svc.get("environment") or {}).items()},
        init=bool(svc.get("init")),
        shm_size=svc.get("shm_size"),
        cpus=str(limits["cpus"]) if "cpus" in limits else None,
        memory=str(limits["memory"]) if "memory" in limits else None,
        replicas=int((svc.get("deploy") or {}).get("replicas", 1)),
        healthcheck=health,
        container_paths=[v.split(":")[1] for v in svc.get("volumes", []) if isinstance(v, str)],
    )


def resolve_environment(spec_env: dict[str, str], variables: dict[str, str],
                        overrides: dict[str, str], drop: set[str]) -> dict[str, str]:
    """Fill ``${VAR...}`` from ``variables``; replace endpoint values from ``overrides``."""
    env = {}
    for key, value in spec_env.items():
        if key in drop:
            continue
        if key in overrides:
            env[key] = overrides[key]
            continue
        m = _VAR.match(value)
        if m:
            if m.group("name") not in variables:
                raise KeyError(f"compose variable {m.group('name')} (for {key}) has no test value")
            env[key] = variables[m.group("name")]
        else:
            env[key] = value
    return env


# ------------------------------------------------------------ substitutes

class MotoS3:
    """moto_server on ``host`` (the docker network's gateway): an S3 API over HTTP."""

    def __init__(self, host: str, access_key: str, secret_key: str, log_path: Path):
        self.host, self.port = host, free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.access_key, self.secret_key = access_key, secret_key
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([venv_tool("moto_server"), "-H", host, "-p", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT)
        wait_until(self._up, 30, what="moto_server")

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with {self.proc.returncode}")
        with socket.create_connection((self.host, self.port), timeout=1):
            return True

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key)

    def env(self) -> dict:
        """The standard AWS variables a process on this machine reads the store with."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": self.url, "AWS_EC2_METADATA_DISABLED": "true"}

    def keys(self, prefix: str) -> list[str]:
        out, token = [], None
        s3 = self.client()
        while True:
            kw = {"Bucket": BUCKET, "Prefix": prefix}
            if token:
                kw["ContinuationToken"] = token
            page = s3.list_objects_v2(**kw)
            out += [o["Key"] for o in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return out
            token = page["NextContinuationToken"]

    def committed_steps(self, run: str) -> list[int]:
        """Global steps of the run's checkpoints whose manifest (the commit) is in the bucket."""
        steps = []
        for key in self.keys(f"runs/{run}/"):
            m = re.search(r"/ckpt-s(\d+)-[^/]*/manifest\.json$", key)
            if m:
                steps.append(int(m.group(1)))
        return sorted(steps)

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


class HostPrometheus:
    """Debian's prometheus on 127.0.0.1 running monitoring/prometheus.yml.

    Rewritten for the host: file_sd paths point at temp dirs (rank 0's target
    file is written into ``targets_dir``, bind-mounted into the workers), the
    rules at monitoring/rules, and scrapes every 2 s so the short test runs
    are seen.
    """

    def __init__(self, workdir: Path, targets_dir: Path, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = self.config_for_host(yaml.safe_load(PROMETHEUS_CONFIG.read_text()), targets_dir, workdir)
        cfg_path = workdir / "prometheus.yml"
        cfg_path.write_text(yaml.safe_dump(config))
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [shutil.which("prometheus") or "prometheus", f"--config.file={cfg_path}",
             f"--storage.tsdb.path={workdir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self._log, stderr=subprocess.STDOUT)
        wait_until(self._ready, 60, what="prometheus /-/ready")

    @staticmethod
    def config_for_host(config: dict, targets_dir: Path, workdir: Path) -> dict:
        config = copy.deepcopy(config)
        config.setdefault("global", {}).update({"scrape_interval": "2s", "scrape_timeout": "1s"})
        rules_root = PROMETHEUS_CONFIG.parent
        config["rule_files"] = [str(rules_root / r) for r in config.get("rule_files", [])]
        for job in config.get("scrape_configs", []):
            job.pop("scrape_interval", None)
            job.pop("scrape_timeout", None)
            for sd in job.get("file_sd_configs", []):
                sd["files"] = [str(targets_dir / Path(f).name) if f.startswith("/etc/prometheus/targets/")
                               else str(workdir / "absent" / Path(f).name) for f in sd["files"]]
        return config

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self.proc.returncode}")
        with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
            return r.status == 200

    def query(self, promql: str) -> list[dict]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def targets(self) -> list[dict]:
        with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=10) as r:
            return json.load(r)["data"]["activeTargets"]

    def stop(self) -> None:
        stop_process(self.proc, grace_s=15)
        self._log.close()


# ------------------------------------------------------------ the cluster

@dataclass
class Secrets:
    """Test-only credentials; never part of an image (test_image.py checks)."""

    ray_token: str
    s3_access_key: str
    s3_secret_key: str

    @classmethod
    def generate(cls) -> "Secrets":
        return cls(ray_token=secrets.token_hex(32),
                   s3_access_key="e2eaccess" + secrets.token_hex(6),
                   s3_secret_key="e2esecret" + secrets.token_hex(16))

    def values(self) -> list[str]:
        return [self.ray_token, self.s3_access_key, self.s3_secret_key]


class ContainerCluster:
    """Ray head + N worker containers on a private network, plus moto and Prometheus."""

    def __init__(self, image: str, creds: Secrets, workdir: Path, workers: int | None = None,
                 log_prefix: str = ""):
        self.image, self.creds, self.workdir = image, creds, workdir
        self.log_prefix = log_prefix  # build/e2e-logs/<prefix>head.log, ...: one module's cluster per prefix
        self.tag = "ray-app-e2e-" + secrets.token_hex(3)
        self.network = self.tag
        self.compose = load_compose()
        self.head_spec = node_spec(self.compose, "head")
        self.worker_spec = node_spec(self.compose, "worker")
        self.n_workers = workers or self.worker_spec.replicas
        self.head = f"{self.tag}-head"
        self.workers = [f"{self.tag}-worker-{i + 1}" for i in range(self.n_workers)]
        self.removed: list[str] = []
        self.s3 = self.prometheus = None
        self.dashboard_port = None
        LOG_DIR.mkdir(parents=True, exist_ok=True)

    # -- start / stop
    def start(self) -> "ContainerCluster":
        docker("network", "create", self.network)
        gateway = docker("network", "inspect", self.network, "-f",
                         "{{(index .IPAM.Config 0).Gateway}}").stdout.strip()
        self.s3 = MotoS3(gateway, self.creds.s3_access_key, self.creds.s3_secret_key,
                         LOG_DIR / f"{self.log_prefix}moto.log")
        self.s3.client().create_bucket(Bucket=BUCKET)
        self.targets_dir = self.workdir / "metrics-targets"
        self.targets_dir.mkdir()
        try:  # the image's user (1000) writes rank 0's target file here
            os.chown(self.targets_dir, 1000, 1000)
        except PermissionError:  # not root: let anyone write this temp dir
            self.targets_dir.chmod(0o777)
        self.prometheus = HostPrometheus(self.workdir, self.targets_dir, LOG_DIR / f"{self.log_prefix}prometheus.log")
        self._run_node(self.head, self.head_spec, hostname="head", publish_dashboard=True)
        wait_until(self.head_healthy, 120, interval=1, what="Ray head health check")
        self.dashboard_port = int(docker("port", self.head, "8265/tcp").stdout.split(":")[-1])
        for i, name in enumerate(self.workers):
            self._run_node(name, self.worker_spec, hostname=f"worker-{i + 1}")
        self.wait_for_cpus(self.n_workers * int(float(self.worker_spec.command[self.worker_spec.command.index("--num-cpus") + 1])))
        return self

    def stop(self) -> None:
        for name in [self.head, *self.workers]:
            out = docker("logs", name, check=False, timeout=60)
            (LOG_DIR / f"{self.log_prefix}{name.split(self.tag + '-')[1]}.log").write_text(out.stdout + out.stderr)
        docker("rm", "-f", "-v", self.head, *self.workers, check=False, timeout=120)
        docker("network", "rm", self.network, check=False)
        for service in (self.prometheus, self.s3):
            if service is not None:
                service.stop()

    def add_worker(self) -> str:
        """One more worker container, as the compose file's (a node joining)."""
        name = f"{self.tag}-worker-{len(self.workers) + len(self.removed) + 1}"
        self.workers.append(name)
        self._run_node(name, self.worker_spec, hostname=name.split(self.tag + "-")[1])
        return name

    def remove_worker(self, name: str) -> None:
        """The container gone for good (``docker rm -f``: a node that does not come back); its log kept."""
        out = docker("logs", name, check=False, timeout=60)
        (LOG_DIR / f"{self.log_prefix}{name.split(self.tag + '-')[1]}.log").write_text(out.stdout + out.stderr)
        docker("rm", "-f", "-v", name, timeout=120)
        self.workers.remove(name)
        self.removed.append(name)

    def _env(self) -> dict[str, str]:
        return {"RAY_AUTH_TOKEN": self.creds.ray_token, "MINIO_ROOT_USER": self.creds.s3_access_key,
                "MINIO_ROOT_PASSWORD": self.creds.s3_secret_key}

    def _run_node(self, name: str, spec: NodeSpec, hostname: str, publish_dashboard: bool = False) -> None:
        env = resolve_environment(spec.environment, self._env(),
                                  overrides={"AWS_ENDPOINT_URL_S3": self.s3.url},
                                  drop={"RAY_PROMETHEUS_HOST"})  # the dashboard's charts: not tested
        args = ["run", "-d", "--name", name, "--hostname", hostname, "--network", self.network,
                "--network-alias", hostname, "--label", f"ray-app-e2e={self.tag}"]
        if spec.init:
            args.append("--init")
        if spec.shm_size:
            args += ["--shm-size", spec.shm_size]
        if spec.cpus:
            args += ["--cpus", spec.cpus]
        if spec.memory:
            args += ["--memory", spec.memory]
        if publish_dashboard:
            args += ["-p", "127.0.0.1::8265"]  # a free loopback port: a user's `make compose-up` may hold 8265
        for path in spec.container_paths:
            if path == spec.environment.get("RAY_APP_METRICS_SD_DIR"):  # rank 0 writes its target here
                args += ["-v", f"{self.targets_dir}:{path}"]
        # Values travel in docker's environment, not on its command line.
        for key in env:
            args += ["-e", key]
        docker(*args, self.image, *spec.command, env={**os.environ, **env})

    # -- state
    def head_healthy(self) -> bool:
        return docker("exec", self.head, *self.head_spec.healthcheck, check=False, timeout=30).returncode == 0

    def cluster_cpus(self) -> float:
        """The CPUs of the nodes Ray holds alive (the dashboard's node summary: one HTTP request, where a
        `ray status` in the head container is a Python process a poll); 0 while the dashboard does not answer."""
        request = urllib.request.Request(f"{self.address}/nodes?view=summary",
                                         headers={"Authorization": f"Bearer {self.creds.ray_token}"})
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                nodes = json.loads(r.read())["data"]["summary"]
        except (OSError, ValueError, KeyError):
            return 0.0
        return sum(n["raylet"].get("resourcesTotal", {}).get("CPU", 0.0) for n in nodes
                   if n.get("raylet", {}).get("state") == "ALIVE")

    def wait_for_cpus(self, cpus: float, timeout: float = 180) -> None:
        wait_until(lambda: self.cluster_cpus() >= cpus, timeout, interval=2, what=f"{cpus:g} CPUs in the Ray cluster")

    def wait_for_exactly_the_workers(self, timeout: float = 180) -> None:
        """Until Ray counts the CPUs of the worker containers running now, no more and no fewer: a
        container killed and started again is a new node, and the node it was stays counted until Ray
        finds it dead; a job placed meanwhile may get a worker on the dead node."""
        per_worker = float(self.worker_spec.command[self.worker_spec.command.index("--num-cpus") + 1])
        want = len(self.workers) * per_worker
        wait_until(lambda: self.cluster_cpus() == want, timeout, interval=2,
                   what=f"exactly {want:g} CPUs (the {len(self.workers)} worker containers) in the Ray cluster")

    def ip_of(self, container: str) -> str:
        return docker("inspect", "-f", f"{{{{(index .NetworkSettings.Networks \"{self.network}\").IPAddress}}}}",
                      container).stdout.strip()

    def rank0_ip(self, run: str) -> str | None:
        """The address rank 0 announced in its Prometheus target file (RAY_APP_METRICS_SD_DIR)."""
        path = self.targets_dir / f"ray-app-{run}.json"
        try:
            return json.loads(path.read_text())[0]["targets"][0].rsplit(":", 1)[0]
        except (OSError, ValueError, LookupError):
            return None

    def container_by_ip(self, ip: str) -> str:
        return next(c for c in [self.head, *self.workers] if self.ip_of(c) == ip)

    # -- jobs (the .venv's ray CLI, as `make compose-submit`)
    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def client_env(self, token: str | None = "cluster", auth_mode: bool = True) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RAY_AUTH", "AWS_", "RAY_ADDRESS"))}
        env["HOME"] = str(self.workdir / "client-home")  # no ~/.ray/auth_token of this machine's
        Path(env["HOME"]).mkdir(exist_ok=True)
        if auth_mode:
            env["RAY_AUTH_MODE"] = "token"
        if token is not None:
            env["RAY_AUTH_TOKEN"] = self.creds.ray_token if token == "cluster" else token
        return env

    def ray(self, *args: str, timeout: float = 120, **env_kw) -> subprocess.CompletedProcess:
        return subprocess.run([venv_tool("ray"), *args], cwd=REPO, env=self.client_env(**env_kw),
                              capture_output=True, text=True, timeout=timeout)

    def submit(self, submission_id: str, train_args: list[str], wait: bool = True,
               timeout: float = 600, config: str = "configs/cluster.yaml", working_dir: bool | Path = True,
               command: str = "train", **env_kw) -> subprocess.CompletedProcess:
        """`ray job submit ... -- ray-app COMMAND --config CONFIG ...`; with ``working_dir`` True the
        repository is uploaded (as `make compose-submit`), with a path that folder, without it the job runs only
        what the image holds."""
        args = ["job", "submit", "--address", self.address, "--submission-id", submission_id]
        if working_dir:
            folder = "." if working_dir is True else str(working_dir)
            args += ["--working-dir", folder, "--runtime-env-json", json.dumps({"excludes": SUBMIT_EXCLUDES})]
        if not wait:
            args.append("--no-wait")
        args += ["--", "ray-app", command, "--config", config, *train_args]
        return self.ray(*args, timeout=timeout, **env_kw)

    def exec(self, container: str, *argv: str, stdin: str | None = None, workdir: str | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess:
        """`docker exec` in one of the cluster's containers (as its image's user)."""
        flags = ["-i"] if stdin is not None else []
        if workdir:
            flags += ["-w", workdir]
        return subprocess.run(["docker", "exec", *flags, container, *argv], input=stdin, capture_output=True,
                              text=True, timeout=timeout)

    def jobs_api(self, path: str, method: str = "GET", timeout: float = 60):
        """The dashboard's job REST API (what the `ray job` CLI calls), with the cluster's token: one HTTP
        request, no Python process started per poll (a `ray job status` costs about a CPU-second)."""
        request = urllib.request.Request(f"{self.address}/api/jobs/{path}", method=method,
                                         headers={"Authorization": f"Bearer {self.creds.ray_token}"})
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return json.loads(r.read())

    def job_status(self, submission_id: str) -> str:
        """PENDING, RUNNING, STOPPED, SUCCEEDED, FAILED; UNKNOWN for a job the cluster does not know."""
        try:
            return self.jobs_api(urllib.parse.quote(submission_id))["status"]
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return "UNKNOWN"
            raise

    def save_head_logs(self, name: str) -> Path:
        """Ray Train's controller logs (from whichever container runs the controller) and GCS's log from
        the head container, for a test that failed."""
        text = ""
        for container in [self.head, *self.workers]:
            out = docker("exec", container, "sh", "-c",
                         "cd /tmp/ray/session_latest/logs && tail -n 300 train/ray-train-*-controller-*.log "
                         + ("gcs_server.out " if container == self.head else "") + "2>/dev/null",
                         check=False, timeout=60)
            text += f"==== {container}\n{out.stdout}{out.stderr}"
        path = LOG_DIR / f"{self.log_prefix}{name}"
        path.write_text(text)
        return path

    def job_logs(self, submission_id: str) -> str:
        return self.jobs_api(f"{urllib.parse.quote(submission_id)}/logs", timeout=120)["logs"]

    def wait_for_job(self, submission_id: str, timeout: float) -> str:
        return wait_until(lambda: (s := self.job_status(submission_id)) in {"SUCCEEDED", "FAILED", "STOPPED"} and s,
                          timeout, interval=3, what=f"job {submission_id} to finish")

    def job_ids(self) -> list[str]:
        return [job["submission_id"] for job in self.jobs_api("") if job.get("submission_id")]


# ------------------------------------------------------------ job log parsing

RANK_LINE = re.compile(r"rank (\d+)/(\d+) on host (\S+) ip (\S+)")


def rank_placements(logs: str) -> dict[int, tuple[str, str]]:
    """rank -> (hostname, ip) from the loop's per-rank start lines (the first of each rank)."""
    out = {}
    for m in RANK_LINE.finditer(logs):
        out.setdefault(int(m.group(1)), (m.group(3), m.group(4)))
    return out


def world_sizes(logs: str) -> list[int]:
    """The world size of each group that started training, in order (rank 0's "run ...: ..." line)."""
    return [int(n) for n in re.findall(r"steps/epoch x \d+ epochs, world size (\d+)", logs)]


def summary_of(logs: str) -> dict:
    """The train command's summary: its last line of output that is a JSON object."""
    for line in reversed(logs.strip().splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            return json.loads(line)
    raise AssertionError("no JSON summary line in the job logs:\n" + logs[-3000:])
