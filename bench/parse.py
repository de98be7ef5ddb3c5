"""Pure parsing for the bench: progress lines, Prometheus text, Ray Train's logs, start-up phases.

No processes are started here (tests/bench/test_bench_parse.py covers it).
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import statistics
from pathlib import Path

# "epoch 0 step 20/64 loss 2.3012 lr 0.05 1,234 samples/s eta 0:00:03" (kit); the twin stops after the loss
PROGRESS = re.compile(r"epoch (\d+) step (\d+)/(\d+) loss (\S+)(?: lr \S+ ([\d,.]+) samples/s)?")
PROM_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
SESSION_DIR = re.compile(r"session_(\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2})_(\d{6})_\d+$")
CORE_LOG_TIME = re.compile(r"^\[(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}),(\d{3})")

# Ray Train V2 "sys" log messages (logs/train/ray-train-sys-*.log, JSON, written at DEBUG whatever
# the run's LoggingConfig) -> event name; "first" keeps the earliest match, "last" the latest.
TRAIN_EVENTS = (
    ("Attempting to start training worker group", "group_requested", "first"),
    ("worker actors created", "workers_created", "first"),
    ("Train context initialized on workers", "context_ready", "first"),
    ("Setting up process group", "pg_setup", "first"),
    ("Launching training function", "train_fn_launched", "last"),
    ("Moving model to device", "model_built", "last"),
    ("Wrapping provided model in DistributedDataParallel", "ddp_wrapping", "last"),
)


# ---------------------------------------------------------------- progress lines

def progress_lines(lines: list[str]) -> list[dict]:
    """Every progress line (kit or twin) as {epoch, step, total, loss, sps}; sps is None for the twin."""
    out = []
    for line in lines:
        m = PROGRESS.search(line)
        if not m:
            continue
        sps = float(m.group(5).replace(",", "")) if m.group(5) else None
        out.append({"epoch": int(m.group(1)), "step": int(m.group(2)), "total": int(m.group(3)),
                    "loss": float(m.group(4)), "sps": sps})
    return out


def steady_from_progress(rows: list[dict], global_batch: int, skip_steps: int) -> float | None:
    """Global samples/s over the logging intervals that start after ``skip_steps`` (kit progress lines).

    Each line reports its interval's rate; the interval's samples are (steps since the previous line)
    x global batch, so its duration is samples / rate. Lines of a resumed attempt (step going back) end it.
    """
    samples = seconds = 0.0
    prev = 0
    for r in rows:
        if r["step"] <= prev:
            break
        n = (r["step"] - prev) * global_batch
        if prev >= skip_steps and r["sps"]:
            samples += n
            seconds += n / r["sps"]
        prev = r["step"]
    return samples / seconds if seconds else None


def loss_trace(rows: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in rows]


def same_losses(a: list[tuple[int, float]], b: list[tuple[int, float]], tol: float = 1e-4) -> bool | None:
    """Do two runs log the same loss at the same steps (the kit and its twin do identical work)?"""
    common = dict(a).keys() & dict(b).keys()
    if not common:
        return None
    da, db = dict(a), dict(b)
    return all(abs(da[s] - db[s]) <= tol * max(1.0, abs(da[s])) for s in common)


# ---------------------------------------------------------------- Prometheus text

def parse_prom(text: str) -> dict[str, float]:
    """Prometheus text format -> {name: value} (labels dropped; the exporter has one series per name)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = PROM_LINE.match(line)
        if m and not m.group(1).endswith("_bucket"):
            try:
                out[m.group(1)] = float(m.group(3))
            except ValueError:
                pass
    return out


# ---------------------------------------------------------------- Ray logs

def _local_ts(text: str, fmt: str = "%Y-%m-%d %H:%M:%S", micros: int = 0) -> float:
    """Ray writes local time without a zone; this machine's zone turns it into unix time."""
    return _dt.datetime.strptime(text, fmt).replace(microsecond=micros).timestamp()


def session_start(session: Path) -> float | None:
    """Unix time encoded in a Ray session directory name (when the node started)."""
    m = SESSION_DIR.search(session.name)
    return _local_ts(m.group(1), "%Y-%m-%d_%H-%M-%S", int(m.group(2))) if m else None


def _core_log_first(path: Path) -> float | None:
    try:
        with open(path, errors="replace") as f:
            m = CORE_LOG_TIME.match(f.readline())
    except OSError:
        return None
    return _local_ts(m.group(1), micros=int(m.group(2)) * 1000) if m else None


def driver_connected(logs: Path, after: float) -> float | None:
    """First line of the earliest driver core-worker log written after ``after`` (ray.init connected)."""
    times = [t for t in (_core_log_first(p) for p in logs.glob("python-core-driver-*.log")) if t and t >= after]
    return min(times) if times else None


def train_log_records(logs: Path, after: float, before: float) -> list[dict]:
    """Ray Train sys-log records (controller and workers) with after <= time <= before, oldest first."""
    records = []
    for path in (logs / "train").glob("ray-train-sys-*.log"):
        for line in path.read_text(errors="replace").splitlines():
            try:
                d = json.loads(line)
            except ValueError:
                continue
            t = d.get("timestamp_ns", 0) / 1e9
            if after <= t <= before:
                records.append({"t": t, "msg": d.get("message", ""), "component": d.get("component", ""),
                                "process": d.get("process"), "run": d.get("run_name")})
    return sorted(records, key=lambda r: r["t"])


WORKER_PID = re.compile(r"pid=(\d+)\) world_rank=(\d+)")


def worker_pids(records: list[dict], run_name: str) -> dict[int, int]:
    """{world rank: pid} of the newest worker group Ray Train started for ``run_name``."""
    groups = [r["msg"] for r in records if r.get("run") == run_name and "Started training worker group" in r["msg"]]
    return {int(rank): int(pid) for pid, rank in WORKER_PID.findall(groups[-1])} if groups else {}


def train_events(records: list[dict]) -> dict[str, float]:
    """The start-up events of the *first* worker group in ``records`` (see TRAIN_EVENTS)."""
    ev: dict[str, float] = {}
    controller = [r["t"] for r in records if r["component"] == "controller"]
    if controller:
        ev["controller_up"] = controller[0]
    started = [r["t"] for r in records if "Started training worker group" in r["msg"]]
    horizon = started[0] + 120 if started else float("inf")  # a later group (restart) is not start-up
    for needle, name, which in TRAIN_EVENTS:
        hits = [r["t"] for r in records if needle in r["msg"] and r["t"] <= horizon]
        if hits and name in ("group_requested", "workers_created", "context_ready", "pg_setup"):
            ev[name] = hits[0]
        elif hits:
            # per-rank events: the slowest rank of the first group decides
            first_group = [t for t in hits if t <= hits[0] + 60]
            ev[name] = max(first_group) if which == "last" else min(first_group)
    return ev


def restart_events(records: list[dict], t_kill: float) -> dict[str, float]:
    """Events of the worker group started after a kill at ``t_kill``."""
    later = [r for r in records if r["t"] >= t_kill]
    ev = {}
    for needle, name in (("Attempting to start training worker group", "group_requested"),
                         ("worker actors created", "workers_created"),
                         ("Train context initialized on workers", "context_ready"),
                         ("Launching training function", "train_fn_launched")):
        hits = [r["t"] for r in later if needle in r["msg"]]
        if hits:
            ev[name] = hits[0]
    return ev


# ---------------------------------------------------------------- start-up phases

_KIT_TAIL = (  # (label, from event, to event)
    ("TorchTrainer + controller actor", "ray_ready", "controller_up"),
    ("placement + worker processes", "controller_up", "workers_created"),
    ("train context on workers", "workers_created", "context_ready"),
    ("process group", "context_ready", "train_fn_launched"),
    ("train_func set-up (storage, exporter)", "train_fn_launched", "fit_start"),
    ("data + model + DDP", "fit_start", "model_ready"),
    ("restore + first step", "model_ready", "first_step"),
)
KIT_COLD_PHASES = (
    ("CLI + imports + config + preflight", "t0", "ray_session"),
    ("Ray start (ray.init)", "ray_session", "ray_ready"),
    *_KIT_TAIL,
)
KIT_WARM_PHASES = (
    ("job submit -> driver connected to Ray", "t0", "ray_ready"),
    *_KIT_TAIL,
)


def kit_events(t0: float, logs_events: dict, timeline: dict, first_step: float | None) -> dict:
    """Merge Ray's log events with the kit's own timeline (summary ``timeline``, when it has one)."""
    ev = {"t0": t0, "first_step": first_step, **logs_events}
    ev["ray_ready"] = timeline.get("ray_ready_unix") or logs_events.get("driver_connected")
    ev["fit_start"] = timeline.get("worker_start_unix") or logs_events.get("train_fn_launched")
    ev["model_ready"] = timeline.get("model_ready_unix") or logs_events.get("ddp_wrapping")
    return ev


TWIN_PHASES = (
    ("torchrun + python start", "t0", "script"),
    ("imports (torch, model/data code)", "script", "imports"),
    ("process group", "imports", "process_group"),
    ("data", "process_group", "data"),
    ("model + DDP", "data", "model"),
    ("first step", "model", "first_step"),
)


def phases(events: dict[str, float], table) -> dict[str, float]:
    """Seconds per phase where both ends are known."""
    out = {}
    for label, a, b in table:
        if events.get(a) is not None and events.get(b) is not None:
            out[label] = round(events[b] - events[a], 3)
    return out


# ---------------------------------------------------------------- statistics

def median(values) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---------------------------------------------------------------- CPU by process

def process_role(cmdline: list[str]) -> str:
    """A short name for a process from its command line: a Ray worker's title ("ray::RayTrainWorker"),
    a binary ("raylet"), a Python script or module ("dashboard.py", "-m ray_app", "ray job")."""
    if not cmdline:
        return ""
    first = cmdline[0].split()[0] if cmdline[0].startswith("ray::") else cmdline[0]
    if first.startswith("ray::"):
        return first.split(".")[0]
    exe = Path(first).name
    if not exe.startswith("python"):
        return exe
    args = cmdline[1:]
    while args and args[0].startswith("-") and args[0] not in ("-m", "-c"):
        args = args[1:]
    if not args:
        return exe
    if args[0] in ("-m", "-c"):  # a module, or the first statement of a program (a multiprocessing helper)
        return f"{args[0]} {args[1].split(';')[0][:60]}" if len(args) > 1 else exe
    script = Path(args[0]).name
    return f"{script} {args[1]}" if script == "ray" and len(args) > 1 else script


def _cpu_at(points: list[tuple[float, float]], t: float) -> float:
    """CPU seconds at time ``t``, linear between the samples around it (the last sample after it ended)."""
    before = [p for p in points if p[0] <= t]
    after = [p for p in points if p[0] > t]
    if not before:
        return 0.0
    (ta, ca) = before[-1]
    if not after:
        return ca
    tb, cb = after[0]
    return ca + (cb - ca) * (t - ta) / (tb - ta)


def cpu_by_role(procs: dict[int, dict], until: float, t0: float) -> dict:
    """CPU seconds each role used between ``t0`` and ``until`` (a process that existed before ``t0``
    counts from its first sample), summed over its processes: {"total": s, "roles": {role: [n, s]}}."""
    roles: dict[str, list] = {}
    for rec in procs.values():
        pts = sorted(rec["points"])
        if not pts or rec["created"] > until:
            continue
        base = pts[0][1] if rec["created"] < t0 else 0.0
        used = max(0.0, _cpu_at(pts, until) - base)
        if used < 0.005:
            continue
        n_s = roles.setdefault(rec["role"] or "?", [0, 0.0])
        n_s[0] += 1
        n_s[1] = round(n_s[1] + used, 3)
    total = round(sum(s for _, s in roles.values()), 3)
    return {"total": total, "roles": dict(sorted(roles.items(), key=lambda kv: -kv[1][1]))}
