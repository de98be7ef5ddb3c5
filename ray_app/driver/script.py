"""``ray-app run``, the driver's side: SCRIPT checked before Ray starts, the run named after it, the worker
group launched (each worker's side, and the script's ``save`` / ``load``: ``ray_app.script``)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from ray_app.driver.launcher import DRIVER_START_UNIX, launch
from ray_app.shared.config import Config, RunSection
from ray_app.shared.errors import UserError

BUILTIN_RUN_NAME = RunSection().name  # the built-in example's; a script's run is named after the script


def check_script(path: str) -> str:
    """SCRIPT as the workers will find it (relative to the folder ray-app runs in when inside it).
    UserError (exit 2, one line) for what is not a readable Python file, before Ray starts."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"SCRIPT {path}: no such file in {os.getcwd()}; pass the path of your training script, "
                        "e.g. ray-app run train.py --epochs 3")
    if not p.is_file():
        raise UserError(f"SCRIPT {path}: is a {'folder' if p.is_dir() else 'special file'}, not a script; "
                        "pass the Python file itself, e.g. ray-app run train.py")
    try:
        compile(p.read_bytes(), str(p), "exec")  # a syntax error would fail every worker the same way
    except SyntaxError as exc:
        raise UserError(f"SCRIPT {path}: SyntaxError: {exc.msg} (line {exc.lineno}); fix the script") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"SCRIPT {path}: cannot be read as Python ({type(exc).__name__}: {exc})") from None
    absolute = os.path.abspath(path)
    relative = os.path.relpath(absolute, os.getcwd())
    return absolute if relative.startswith("..") else relative


def default_run_name(script: str) -> str:
    """``train.py`` -> ``train``: two scripts run with the built-in config do not share checkpoints."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", Path(script).stem)
    return (stem if stem[:1].isalnum() else f"script-{stem}")[:128]


def run_script(cfg: Config, script: str, args: list[str]) -> dict:
    """``ray-app run``: check the storage, run SCRIPT on the worker group (``ray_app.script``), return the
    summary (``launch`` raises UserError / TrainingFailed for what the workers found)."""
    from ray_app.shared.lease import held_run
    from ray_app.shared.storage import open_storage, preflight

    if cfg.run.name == BUILTIN_RUN_NAME:
        cfg.run.name = default_run_name(script)
    storage = open_storage(cfg.run.storage, retry_s=cfg.failure.storage_retry_s)  # the preflight waits an outage out too
    preflight(storage)
    storage_path, fs = storage.ray_storage()
    t0 = time.perf_counter()
    with held_run(storage, cfg.run.name, cfg.run.lease_stale_s) as lease:
        # the script's save() commits only while the lease holds this driver's token (as train mode's checkpoints)
        m = launch(cfg, {"mode": "script", "script": script, "args": list(args), "lease_token": lease.token},
                   cfg.run.name, storage_path, fs)
    return {"run": cfg.run.name, "script": script, "world_size": cfg.scaling.num_workers,
            "checkpoint": m.get("checkpoint"), "saves": m.get("saves"), "resumed_from": m.get("resumed_from"),
            "script_seconds": m.get("script_seconds"), "wall_seconds": round(time.perf_counter() - t0, 2),
            "timeline": {"driver_start_unix": DRIVER_START_UNIX, "ray_ready_unix": m.get("ray_ready_unix"),
                         **{k: m.get(k) for k in ("worker_start_unix", "script_start_unix")}}}
