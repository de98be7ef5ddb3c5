"""Running one measured process: the kit (cold or warm) or its bare-torchrun twin.

A run is described by a :class:`Spec`; :func:`run` starts it, timestamps
every output line, polls the kit's Prometheus exporter, optionally SIGKILLs a
worker, and returns a flat dict of figures (see ``run``). Start-up phases of
the kit come from Ray's own logs in a temp dir that belongs to this run
(``RAY_TMPDIR`` for a cold run, ``ray start --temp-dir`` for the warm cluster).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bench import parse

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv that runs the bench runs everything
CONFIG = REPO / "configs" / "local.yaml"
SKIP_STEPS = 5  # optimizer steps left out of the steady-state rate (kit and twin alike)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Spec:
    """One process to measure. ``overrides`` are ``--set`` values shared by the kit and the twin."""

    kind: str  # "kit", "twin", "script" (the twin under `ray-app run`: script mode), "ray" (bench/ray_alone.py) or
    #            "loop" (the kit's own loop without Ray under torchrun: bench/loop_alone.py)
    overrides: tuple[str, ...]
    workers: int = 2
    launch: str = "cold"  # kit: "cold" (ray-app train starts its own Ray) or "warm" (ray job submit)
    storage: str = "local"  # kit: "local" or "s3"
    kill: bool = False  # SIGKILL one worker after the first committed checkpoint (recovery case)
    scrape_every: float = 5.0  # seconds between exporter scrapes once training runs (a Prometheus would scrape)
    # False: nothing scrapes rank 0's exporter, as on a laptop without Prometheus (a scraped exporter waits, at
    # the end, for a scrape of its last values: up to scrape_every more); the first step is the summary's
    scraped: bool = True
    device: str = "cpu"  # twin: "cuda" runs one process on the GPU(s), no torchrun (bench/gpu.sh)
    data_parallel: bool = False  # twin on cuda: nn.DataParallel over every visible GPU (the article's baseline)
    variant: str = ""  # kit, cold: run through bench/variants.py VARIANT (a start-up experiment)
    cpu_sample: bool = False  # sample every process's CPU time (10 Hz) to say which used it before the first step
    rank_memory: bool = False  # each training rank's peak resident memory (VmHWM, 4 Hz; see RankMemory)

    @property
    def metrics_on(self) -> bool:
        return self.kind == "kit" and "metrics.enabled=false" not in self.overrides

    def value(self, key: str, default=None):
        """The effective value of a --set key (the last one wins, as in ray-app)."""
        found = default
        for o in self.overrides:
            if o.startswith(key + "="):
                found = o.split("=", 1)[1]
        return found

    @property
    def global_batch(self) -> int:
        return int(self.value("data.batch_size", 32)) * self.workers


@dataclass
class Context:
    """What every run shares: a scratch folder, the S3 server, the warm cluster."""

    workdir: Path
    s3: object = None  # tests.integration.s3server.S3Server
    cluster: "WarmCluster | None" = None
    counter: int = 0
    timeout: float = 900
    log: object = print
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_dir(self, label: str) -> Path:
        with self.lock:  # runs may start from several threads (smoke)
            self.counter += 1
            d = self.workdir / f"{self.counter:02d}"
        d.mkdir(parents=True)
        (d / "label").write_text(label)
        return d


# ---------------------------------------------------------------- output and exporter

class LineRecorder(threading.Thread):
    """Reads a process's output, keeps (arrival time, line) and copies it to a file."""

    def __init__(self, stream, path: Path, t0: float):
        super().__init__(daemon=True)
        self.stream, self.path, self.t0, self.lines = stream, path, t0, []

    def run(self) -> None:
        with open(self.path, "w") as f:
            for line in self.stream:
                now = time.time()
                self.lines.append((now, line.rstrip("\n")))
                f.write(f"[{now - self.t0:8.3f}] {line}")  # seconds since the process started
                f.flush()

    def text(self) -> list[str]:
        return [line for _, line in self.lines]


class ExporterPoller(threading.Thread):
    """Polls rank 0's /metrics: fast (20 Hz) while waiting for a step, then slowly (like a scraper).

    ``first_step`` is the first time ``ray_app_step_seconds_count`` >= 1 was seen; after
    ``watch_resume()`` it records ``resume_step``: the first scrape of a resumed group with a step.
    """

    FAST = 0.05

    def __init__(self, port: int, slow: float = 5.0):
        super().__init__(daemon=True)
        self.slow = slow
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.first_step = self.resume_step = None
        self.last: dict = {}
        self._watch_resume = False
        self._stop = threading.Event()

    def watch_resume(self) -> None:
        self._watch_resume = True

    def stop(self) -> None:
        self._stop.set()

    def _scrape(self) -> dict | None:
        try:
            with urllib.request.urlopen(self.url, timeout=1) as r:
                return parse.parse_prom(r.read().decode(errors="replace"))
        except (OSError, http.client.HTTPException):  # not up yet, or another server took the port first
            return None

    def run(self) -> None:
        while not self._stop.is_set():
            m = self._scrape()
            now = time.time()
            if m:
                self.last = m
                stepped = m.get("ray_app_step_seconds_count", 0) >= 1
                if stepped and self.first_step is None:
                    self.first_step = now
                if stepped and self._watch_resume and self.resume_step is None \
                        and m.get("ray_app_resumed_from_step", 0) > 0:
                    self.resume_step = now
            waiting = self.first_step is None or (self._watch_resume and self.resume_step is None)
            self._stop.wait(self.FAST if waiting else self.slow)


class Sampler(threading.Thread):
    """A daemon thread reading the processes under ``roots()`` every ``every`` seconds (``_sample``) until
    ``stop()``."""

    def __init__(self, roots, every: float):
        super().__init__(daemon=True)
        self.roots, self.every = roots, every
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)

    def run(self) -> None:
        while True:
            self._sample()
            if self._halt.wait(self.every):
                return

    def _sample(self) -> None:
        raise NotImplementedError


class CpuSampler(Sampler):
    """CPU seconds (user + system) of every process of one run, sampled at 10 Hz.

    ``roots()`` names the processes to follow with all their descendants (the run's process; for a warm
    run also the cluster's, whose CPU before the run is subtracted). ``report(t)`` gives each process's
    role and its CPU seconds up to time ``t`` (see ``parse.cpu_by_role``).
    """

    def __init__(self, roots, every: float = 0.1):
        super().__init__(roots, every)
        self.procs: dict[int, dict] = {}

    def _sample(self) -> None:
        found: dict[int, psutil.Process] = {}  # a root may also be another root's descendant
        for root in self.roots():
            try:
                found.update((p.pid, p) for p in (root, *root.children(recursive=True)))
            except psutil.Error:
                continue
        now = time.time()
        for pid, p in found.items():
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    if pid not in self.procs:
                        self.procs[pid] = {"created": p.create_time(), "role": "", "points": []}
                    role = parse.process_role(p.cmdline())  # Ray retitles a worker when it becomes an actor
            except psutil.Error:
                continue
            rec = self.procs[pid]
            if role and (not rec["role"] or role != "ray::IDLE"):  # an actor's name outlives its IDLE title
                rec["role"] = role
            rec["points"].append((now, t.user + t.system))

    def report(self, until: float, t0: float) -> dict:
        return parse.cpu_by_role(self.procs, until, t0)


RANK_ROLES = ("ray::RayTrainWorker", "twin.py")  # the processes that are training ranks (parse.process_role)


def high_water_kib(pid: int) -> int:
    """A process's peak resident memory so far (``VmHWM`` of /proc/PID/status, KiB)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


class RankMemory(Sampler):
    """Each training rank's peak resident memory (``VmHWM``: the kernel's high-water mark of the process's
    resident set), read at 4 Hz from every process under ``roots()`` whose role is a training rank (a Ray Train
    worker, a twin's rank). VmHWM only grows, so the last reading before a rank exits is its peak, but for what
    its last quarter second added (its shut-down, after the last step and evaluation). A twin's rank says its
    rank (``RANK`` in its environment); a kit's is matched to its rank, and to this run among the jobs of a warm
    cluster, from Ray Train's log after the run."""

    def __init__(self, roots, every: float = 0.25):
        super().__init__(roots, every)
        self.peak_kib: dict[int, int] = {}  # pid -> KiB
        self.rank: dict[int, int] = {}  # pid -> rank, where its environment says

    def _sample(self) -> None:
        procs: dict[int, psutil.Process] = {}
        for root in self.roots():
            try:
                procs.update((p.pid, p) for p in (root, *root.children(recursive=True)))
            except psutil.Error:
                continue
        for p in procs.values():
            try:
                if p.pid not in self.peak_kib:
                    if parse.process_role(p.cmdline()) not in RANK_ROLES:  # a Ray worker is ray::IDLE at first
                        continue
                    rank = p.environ().get("RANK")
                    if rank is not None:
                        self.rank[p.pid] = int(rank)
                self.peak_kib[p.pid] = max(self.peak_kib.get(p.pid, 0), high_water_kib(p.pid))
            except (psutil.Error, OSError, StopIteration, ValueError):
                continue

    def by_rank(self, ranks: dict[int, int] | None = None) -> list[float]:
        """Each rank's peak (MiB), in rank order. ``ranks`` ({pid: rank}, from the kit's log): only those
        processes; else those whose environment says their rank, then the others in pid order."""
        if ranks:
            pids = sorted((pid for pid in self.peak_kib if pid in ranks), key=ranks.get)
        else:
            pids = sorted(self.peak_kib, key=lambda pid: (self.rank.get(pid, 1 << 30), pid))
        return [round(self.peak_kib[pid] / 1024, 1) for pid in pids]


# ---------------------------------------------------------------- warm cluster

def _auth_env() -> dict:
    token = Path.home() / ".ray" / "auth_token"
    env = {"RAY_AUTH_MODE": "token"}
    if token.exists():
        env["RAY_AUTH_TOKEN_PATH"] = str(token)
    return env


def processes_mentioning(text: str) -> list[psutil.Process]:
    """Processes whose command line contains ``text`` (a temp dir that only this bench uses)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if text in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except psutil.Error:
            continue
    return found


def kill_tree(roots: list[psutil.Process]) -> None:
    procs = set()
    for p in roots:
        try:
            procs |= {p, *p.children(recursive=True)}
        except psutil.Error:
            procs.add(p)
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(list(procs), timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass


class WarmCluster:
    """A local ``ray start --head`` with its own temp dir and ports; stopped by pid, never ``ray stop``."""

    def __init__(self, workdir: Path, num_cpus: int):
        self.temp = workdir / "rw"
        self.num_cpus = num_cpus
        self.dashboard_port = free_port()

    def start(self, env: dict | None = None) -> float:
        """Start the head; its processes (and the job drivers) inherit ``env`` (e.g. the S3 credentials)."""
        t0 = time.time()
        env = {k: v for k, v in (env or os.environ).items() if k != "RAY_ADDRESS"}
        for attempt in (1, 2):  # a port picked here can be taken by the time Ray binds it: once more, new ports
            self.dashboard_port = free_port()
            cmd = [str(BIN / "ray"), "start", "--head", "--temp-dir", str(self.temp), "--port", str(free_port()),
                   "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port),
                   "--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
                   "--num-cpus", str(self.num_cpus), "--disable-usage-stats"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**env, **_auth_env()})
            if proc.returncode == 0:
                break
            kill_tree(self.processes())  # what the failed start left running
            if attempt == 2:
                said = (proc.stdout + proc.stderr).strip().splitlines()
                raise RuntimeError(f"warm cluster: ray start exited {proc.returncode}: " + " | ".join(said[-15:]))
            print(f"[bench] warm cluster: ray start exited {proc.returncode}; starting it again", flush=True)
        self._wait_for_jobs_api()
        return time.time() - t0

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _wait_for_jobs_api(self, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"{self.address}/api/version", timeout=2).close()
                return
            except urllib.error.HTTPError:  # 401 without the token: the server is up
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"warm cluster's job API at {self.address} did not come up")

    def raylet(self) -> list[psutil.Process]:
        return [p for p in processes_mentioning(str(self.temp)) if "raylet" in p.name()]

    def processes(self) -> list[psutil.Process]:
        """The head's processes (GCS, raylet, dashboard, monitors); their children are Ray's workers."""
        return processes_mentioning(str(self.temp))

    def logs(self) -> Path:
        return self.temp / "session_latest" / "logs"

    def stop(self) -> None:
        kill_tree(processes_mentioning(str(self.temp)))


# ---------------------------------------------------------------- commands

def _sets(overrides) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def kit_command(spec: Spec, ctx: Context, d: Path, port: int) -> tuple[list[str], dict, str]:
    """(argv, env, run URI) for one kit run."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    if spec.storage == "s3":
        env.update(ctx.s3.env())
        storage = f"s3://{ctx.s3.bucket}/bench"
    else:
        storage = str(d / "runs")
    name = f"bench-{d.name}-{os.getpid()}"
    overrides = [*spec.overrides, f"scaling.num_workers={spec.workers}", f"run.storage={storage}",
                 f"run.name={name}", f"metrics.port={port}"]
    train = ["train", "--config", str(CONFIG), *_sets(overrides), "--summary", str(d / "summary.json")]
    if spec.launch == "warm":
        env.update(_auth_env())
        argv = [str(BIN / "ray"), "job", "submit", "--address", ctx.cluster.address, "--",
                str(BIN / "python"), "-m", "ray_app", *train]
    elif spec.variant:
        env["RAY_TMPDIR"] = str(d / "r")
        argv = [str(BIN / "python"), str(REPO / "bench" / "variants.py"), spec.variant, *train]
    else:
        env["RAY_TMPDIR"] = str(d / "r")  # Ray's logs for this run only (start-up phases)
        argv = [str(BIN / "ray-app"), *train]
    return argv, env, f"{storage}/{name}"


def _twin_args(spec: Spec, d: Path) -> list[str]:
    return [str(REPO / "bench" / "twin.py"), "--config", str(CONFIG), *_sets(spec.overrides),
            "--out", str(d / "twin.jsonl"), "--skip-steps", str(SKIP_STEPS)]


def script_command(spec: Spec, d: Path) -> tuple[list[str], dict]:
    """The twin, unchanged, under `ray-app run` (its own Ray in a private RAY_TMPDIR, as a cold kit run)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env["RAY_TMPDIR"] = str(d / "r")
    kit = [f"scaling.num_workers={spec.workers}", f"run.storage={d / 'runs'}", f"run.name=bench-{d.name}-{os.getpid()}"]
    return [str(BIN / "ray-app"), "run", *_sets(kit), *_twin_args(spec, d)], env


def twin_command(spec: Spec, d: Path) -> tuple[list[str], dict]:
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: after a torchrun restart, a store shared with the rendezvous
    # hands gloo the dead peer's address (pytorch/pytorch#135712)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    args = _twin_args(spec, d)
    if spec.kill:
        args += ["--ckpt-dir", str(d / "ckpt"), "--ckpt-every-steps", spec.value("checkpoint.every_steps", "20")]
    if spec.device == "cuda" and spec.workers == 1:  # the bare single-process loop (and DataParallel)
        dp = ["--data-parallel"] if spec.data_parallel else []
        return [str(BIN / "python"), *args, "--device", "cuda", *dp], env
    restarts = ["--max-restarts", "1"] if spec.kill else []
    argv = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(spec.workers), *restarts, *args]
    return argv, env


def loop_command(spec: Spec, d: Path) -> tuple[list[str], dict]:
    """The kit's own loop without Ray (bench/loop_alone.py) under torchrun, one thread a rank as the twin."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [str(REPO / "bench" / "loop_alone.py"), "--config", str(CONFIG), *_sets(spec.overrides),
            "--out", str(d / "loop.jsonl")]
    return [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(spec.workers), *args], env


# ---------------------------------------------------------------- killing a worker

def _is_rank0(p: psutil.Process, port: int | None) -> bool:
    try:
        if port and any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
                        for c in p.net_connections()):
            return True
        return p.environ().get("RANK") == "0"
    except psutil.Error:
        return False


def train_workers(roots: list[psutil.Process], marker: str) -> list[psutil.Process]:
    out = []
    for root in roots:
        try:
            kids = root.children(recursive=True)
        except psutil.Error:
            continue
        for p in kids:
            try:
                if marker in " ".join(p.cmdline()):
                    out.append(p)
            except psutil.Error:
                continue
    return out


def _first_checkpoint_written(spec: Spec, ctx: Context, d: Path, run_uri: str) -> bool:
    if spec.kind == "twin":
        return (d / "ckpt" / "twin.pt").exists()
    if spec.storage == "s3":
        prefix = run_uri[len(f"s3://{ctx.s3.bucket}/"):] + "/"
        return any(k.endswith("/manifest.json") for k in ctx.s3.snapshot(prefix))
    return any(Path(run_uri).glob("ckpt-s*/manifest.json"))


def _victim(spec: Spec, ctx: Context, d: Path, proc, run_uri: str, port: int | None) -> int | None:
    """pid of a worker that is not rank 0: from Ray Train's log of this run, else from the process tree."""
    if spec.kind == "kit":
        logs = _kit_logs(spec, ctx, d)
        if logs is not None:
            pids = parse.worker_pids(parse.train_log_records(logs, 0, float("inf")), run_uri.rsplit("/", 1)[-1])
            others = [pid for rank, pid in sorted(pids.items()) if rank != 0]
            if others:
                return others[-1]
        if spec.launch == "warm":
            return None  # the cluster runs other jobs too: never guess
    marker = "twin.py" if spec.kind == "twin" else "RayTrainWorker"
    workers = [p for p in train_workers([psutil.Process(proc.pid)], marker) if not _is_rank0(p, port)]
    return workers[-1].pid if workers else None


def kill_one_worker(spec: Spec, ctx: Context, d: Path, proc, run_uri: str, port: int | None,
                    timeout: float = 300) -> float | None:
    """Wait for the first committed checkpoint, then SIGKILL one non-rank-0 worker. Returns the kill time."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if _first_checkpoint_written(spec, ctx, d, run_uri):
            break
        time.sleep(0.1)
    else:
        return None
    pid = _victim(spec, ctx, d, proc, run_uri, port)
    if pid is None:
        return None
    os.kill(pid, signal.SIGKILL)  # from outside, like a crash
    return time.time()


# ---------------------------------------------------------------- one run

def run(spec: Spec, ctx: Context, label: str) -> dict:
    """Start, watch and measure one process. Figures: wall_s, first_step_s (since the process started),
    steady_sps, breakdown {phase: s}, losses, ckpt_blocked_s, recovery_s; ``*_source`` says how each was taken."""
    d = ctx.next_dir(label)
    port = free_port() if spec.metrics_on else None
    if spec.kind == "kit":
        argv, env, run_uri = kit_command(spec, ctx, d, port or free_port())
    elif spec.kind == "ray":  # Ray Train alone: an empty train function, no kit code
        argv, run_uri = [str(BIN / "python"), "bench/ray_alone.py", "--workers", str(spec.workers)], ""
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_TRAIN_V2_ENABLED": "1"}
    else:
        command = {"script": script_command, "loop": loop_command}.get(spec.kind, twin_command)
        (argv, env), run_uri = command(spec, d), ""
    load1 = os.getloadavg()[0]
    t0 = time.time()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    recorder = LineRecorder(proc.stdout, d / "output.log", t0)
    recorder.start()
    poller = ExporterPoller(port, spec.scrape_every) if port and spec.scraped else None
    if poller:
        poller.start()
    sampler = None
    if spec.cpu_sample:
        here = psutil.Process(proc.pid)
        cluster = ctx.cluster.processes() if spec.launch == "warm" and ctx.cluster else []
        if spec.storage == "s3" and ctx.s3 is not None:
            cluster.append(psutil.Process(ctx.s3.proc.pid))  # the S3 server shares the machine's cores
        sampler = CpuSampler(lambda: [here, *cluster])
        sampler.start()
    memory = None
    if spec.rank_memory:  # a warm run's workers are the cluster's processes, not the job submitter's
        here, cluster = psutil.Process(proc.pid), ctx.cluster if spec.launch == "warm" else None
        memory = RankMemory(lambda: [here, *(cluster.processes() if cluster else [])])
    if memory:
        memory.start()
    t_kill = None
    try:
        if spec.kill:
            t_kill = kill_one_worker(spec, ctx, d, proc, run_uri, port)
            if poller:
                poller.watch_resume()
        rc = proc.wait(timeout=ctx.timeout)
    except subprocess.TimeoutExpired:
        rc = "timeout"
    finally:
        t_end = time.time()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if poller:
            poller.stop()
        if sampler:
            sampler.stop()
        if memory:
            memory.stop()
        recorder.join(timeout=10)
        if spec.kind in ("kit", "script") and spec.launch == "cold":
            kill_tree(processes_mentioning(str(d / "r")))  # leftovers of a crashed run's Ray
    launch = {"kit": spec.launch, "script": "ray-app run", "ray": "ray.init"}.get(spec.kind, "torchrun")
    result = {"label": label, "kind": spec.kind, "launch": launch,
              "workers": spec.workers, "dir": str(d), "rc": rc, "t0": t0, "t_end": t_end,
              "wall_s": round(t_end - t0, 3), "load1": load1}
    if spec.kind == "kit":
        _kit_figures(result, spec, ctx, d, recorder, poller, t0, t_end, t_kill)
    elif spec.kind == "ray":
        _ray_alone_figures(result, recorder, t0)
    else:
        _twin_figures(result, d, recorder, t0, t_kill, "loop.jsonl" if spec.kind == "loop" else "twin.jsonl")
    if t_kill is None and spec.kill:
        result["recovery_s"] = None
    if sampler:
        result["cpu_in_run"] = sampler.report(t_end, t0)
        if result.get("first_step_unix"):
            result["cpu_before_first_step"] = sampler.report(result["first_step_unix"], t0)
    if memory:
        _rank_memory_figures(result, memory, spec, ctx, d, run_uri)
    (d / "result.json").write_text(json.dumps(result, default=str))  # kept with the run's logs (--keep)
    return result


def _summary(d: Path) -> dict:
    try:
        return json.loads((d / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def _kit_figures(res, spec, ctx, d, recorder, poller, t0, t_end, t_kill) -> None:
    summary = _summary(d)
    res["summary"] = summary
    rows = parse.progress_lines(recorder.text())
    res["losses"] = parse.loss_trace(rows)
    # steady-state rate: the summary's own figure when the kit reports it, else its progress lines
    if summary.get("steady_samples_per_second"):
        res["steady_sps"], res["steady_source"] = summary["steady_samples_per_second"], "summary"
    else:
        res["steady_sps"] = parse.steady_from_progress(rows, spec.global_batch, SKIP_STEPS)
        res["steady_source"] = "progress lines"
    timeline = summary.get("timeline") or {}
    first = (timeline.get("first_step_unix") or summary.get("first_step_unix")) if not spec.kill else None
    source = "summary"
    if first is None and poller is not None:
        first, source = poller.first_step, "exporter poll (20 Hz)"
    res["first_step_unix"] = first
    res["first_step_s"] = round(first - t0, 3) if first else None
    res["first_step_source"] = source if first else None
    _kit_checkpoint_figures(res, summary, poller)
    # a GPU run: rank 0's peak CUDA memory, as its exporter last showed it (None on a CPU or without an exporter)
    res["gpu_peak_bytes"] = (poller.last if poller else {}).get("ray_app_gpu_memory_max_allocated_bytes")
    if spec.storage == "s3" and summary.get("checkpoint"):
        res["ckpt_bytes"] = _s3_bytes(ctx, summary["checkpoint"])
    logs = _kit_logs(spec, ctx, d)
    log_events = {}
    if logs is not None:
        if spec.launch == "cold":
            sessions = sorted(logs.parent.parent.glob("session_2*"))
            log_events["ray_session"] = parse.session_start(sessions[0]) if sessions else None
        log_events["driver_connected"] = parse.driver_connected(logs, t0)
        records = parse.train_log_records(logs, t0, t_end)
        log_events.update(parse.train_events(records))
        if t_kill:
            restart = parse.restart_events(records, t_kill)
            res["restart_events_s"] = {k: round(v - t_kill, 3) for k, v in restart.items()}
    events = parse.kit_events(t0, log_events, timeline, first)
    table = parse.KIT_COLD_PHASES if spec.launch == "cold" else parse.KIT_WARM_PHASES
    res["breakdown"] = parse.phases(events, table)
    if spec.kill:
        # the summary's timeline is the last worker group's: its first step is the first after the resume
        from_summary = timeline.get("first_step_unix") if summary.get("resumed_from_step") else None
        resume = from_summary or (poller.resume_step if poller else None)
        res["recovery_s"] = round(resume - t_kill, 3) if resume and t_kill else None
        res["recovery_source"] = ("summary" if from_summary else "exporter poll (20 Hz)") if resume else None
        res["resumed_from_step"] = summary.get("resumed_from_step")


def _kit_checkpoint_figures(res, summary, poller) -> None:
    if summary.get("checkpoint_blocked_seconds") is not None and summary.get("checkpoints_written"):
        res["ckpt_blocked_s"] = summary["checkpoint_blocked_seconds"] / summary["checkpoints_written"]
        res["ckpt_blocked_source"] = "summary"
    elif poller is not None and poller.last.get("ray_app_checkpoint_blocked_seconds_count"):
        m = poller.last
        count = m["ray_app_checkpoint_blocked_seconds_count"]
        res["ckpt_blocked_s"] = m["ray_app_checkpoint_blocked_seconds_sum"] / count
        res["ckpt_blocked_source"] = f"exporter ({int(m['ray_app_checkpoint_blocked_seconds_count'])} checkpoints seen)"


def _s3_bytes(ctx: Context, uri: str) -> int:
    """Total size of the objects under a checkpoint URI on the bench's S3 server."""
    prefix = uri[len(f"s3://{ctx.s3.bucket}/"):].rstrip("/") + "/"
    pages = ctx.s3.client().get_paginator("list_objects_v2").paginate(Bucket=ctx.s3.bucket, Prefix=prefix)
    return sum(o["Size"] for page in pages for o in page.get("Contents", []))


def _kit_logs(spec: Spec, ctx: Context, d: Path) -> Path | None:
    if spec.launch == "warm":
        return ctx.cluster.logs()
    sessions = sorted((d / "r" / "ray").glob("session_2*"))
    return sessions[-1] / "logs" if sessions else None


def _ray_alone_figures(res, recorder, t0) -> None:
    """bench/ray_alone.py's one JSON line: its phases (s), and when its train function was entered."""
    phases = {}
    for line in recorder.text():  # the output's lines
        if line.startswith("{"):
            try:
                phases = json.loads(line)
            except ValueError:
                continue
    res["summary"], res["losses"] = phases, []
    entered = phases.get("train_fn_unix")
    res["first_step_unix"] = entered
    res["first_step_s"] = round(entered - t0, 3) if entered else None
    res["first_step_source"] = "ray_alone.py: its train function entered" if entered else None
    res["breakdown"] = {k: v for k, v in phases.items() if isinstance(v, (int, float)) and k != "train_fn_unix"}


def _twin_figures(res, d, recorder, t0, t_kill, jsonl: str = "twin.jsonl") -> None:
    """The twin's figures (and those of the kit's loop alone, ``loop.jsonl``: the same shape)."""
    lines = []
    try:
        lines = [json.loads(x) for x in (d / jsonl).read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        pass
    rows = parse.progress_lines(recorder.text())
    res["losses"] = parse.loss_trace(rows)
    first = lines[0] if lines else {}
    res["summary"] = first
    source = ("twin" if jsonl == "twin.jsonl" else "loop_alone") + " (in process)"
    res["steady_sps"], res["steady_source"] = first.get("steady_samples_per_second"), source
    res["steady_step_sps"] = first.get("steady_step_samples_per_second")
    fs = res["first_step_unix"] = first.get("first_step_unix")
    res["first_step_s"] = round(fs - t0, 3) if fs else None
    res["first_step_source"] = source if fs else None
    stamps = dict(first.get("stamps", {}), t0=t0)
    res["breakdown"] = parse.phases(stamps, parse.TWIN_PHASES)
    if t_kill:
        resumed = [x for x in lines if x.get("attempt", 0) >= 1]
        fs2 = resumed[-1].get("first_step_unix") if resumed else None
        res["recovery_s"] = round(fs2 - t_kill, 3) if fs2 else None
        res["recovery_source"] = "twin (in process)" if fs2 else None
        res["resumed_from_step"] = resumed[-1].get("resumed_from_step") if resumed else None
        if resumed:
            s = resumed[-1].get("stamps", {})
            res["restart_phases_s"] = {k: round(v - t_kill, 3) for k, v in s.items() if v}


def _rank_memory_figures(res, memory: RankMemory, spec, ctx, d, run_uri: str) -> None:
    """``rank_peak_mib``: each training rank's peak resident memory (MiB), in rank order (the kit's ranks from
    Ray Train's log of this run: which pid is which rank)."""
    ranks = {}
    if spec.kind == "kit":
        logs = _kit_logs(spec, ctx, d)
        if logs is not None:
            found = parse.worker_pids(parse.train_log_records(logs, 0, float("inf")), run_uri.rsplit("/", 1)[-1])
            ranks = {pid: rank for rank, pid in found.items()}
    warm_unknown = spec.kind == "kit" and spec.launch == "warm" and not ranks  # the cluster's other jobs' too
    res["rank_peak_mib"] = [] if warm_unknown else memory.by_rank(ranks)
    res["rank_peak_source"] = "VmHWM at 4 Hz" + ("; ranks from Ray Train's log" if ranks else "")
