"""Builds and runs the Ray Train ``TorchTrainer`` around the loop.

Driver side: connect to ``RAY_ADDRESS`` (or start a local Ray sized to the
machine), check the cluster can hold the workers, build Scaling / Run /
Failure / Checkpoint configs, run, and turn the result into the summary.
Worker side: ``worker_main`` (train, eval, and a script for `ray-app run`) enters the user's project folder,
builds the runtime, checkpointer and metrics sink the loop is given, and turns an
exception in the user's code into one the driver shows once.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from pathlib import Path

from ray_app.config import Config, ConfigError, config_from_dict

log = logging.getLogger("ray_app.launch")


def _process_start_unix() -> float:
    try:
        import psutil  # a Ray dependency

        return psutil.Process().create_time()
    except Exception:
        return time.time()


DRIVER_START_UNIX = _process_start_unix()  # when `ray-app train` was started


class UserError(RuntimeError):
    """Bad input found at launch time (exit code 2)."""


# ---------------------------------------------------------------- worker side

class RayRuntime:
    """Topology and Ray Train calls, read in one place."""

    def __init__(self, storage, run: str, upload_mode: str):
        import ray.train
        import ray.train.torch

        self._train, self._torch = ray.train, ray.train.torch
        ctx = ray.train.get_context()
        self.rank, self.world_size = ctx.get_world_rank(), ctx.get_world_size()
        self.device = ray.train.torch.get_device()
        self.storage, self.run = storage, run
        self.upload_mode = (ray.train.CheckpointUploadMode.ASYNC if upload_mode == "async"
                            else ray.train.CheckpointUploadMode.SYNC)

    def prepare_model(self, model, bucket_cap_mb: int = 25):
        return self._torch.prepare_model(model, parallel_strategy_kwargs={
            "bucket_cap_mb": bucket_cap_mb, "gradient_as_bucket_view": True})

    def report(self, metrics: dict, local_dir=None, dir_name=None, upload=None) -> None:
        """Every rank calls this the same number of times (ray.train.report is a barrier). A checkpoint's
        report names the same ``dir_name`` on every rank, the writer's, though only the writer has ``local_dir``
        (Ray Train takes rank 0's name for all)."""
        if local_dir is None:
            self._train.report(metrics, checkpoint_dir_name=dir_name)
            return
        from ray_app.checkpoint import cleanup_local

        def upload_fn(checkpoint, name):
            upload(Path(checkpoint.path), name)
            path, fs = self.storage.ray_checkpoint_location(f"{self.run}/{name}")
            return self._train.Checkpoint(path, filesystem=fs)

        self._train.report(metrics, checkpoint=self._train.Checkpoint.from_directory(str(local_dir)),
                           checkpoint_dir_name=dir_name, checkpoint_upload_mode=self.upload_mode,
                           checkpoint_upload_fn=upload_fn, delete_local_checkpoint_after_upload=True)
        if self.upload_mode == self._train.CheckpointUploadMode.SYNC:
            cleanup_local(local_dir)


def _quiet_report_log() -> None:
    """Ray Train logs every report of every rank at INFO on a logger named by its file path
    (so LoggingConfig does not reach it); keep it in Ray's log files, off the console."""
    try:
        from ray.train.v2._internal.execution import context as train_context

        logging.getLogger(train_context.__file__).setLevel(logging.WARNING)
    except Exception:  # a Ray refactor must never break training
        pass


class _ShownByTheDriver(logging.Filter):
    """Ray Train logs every worker's exception on every attempt; the errors the driver shows itself
    (bad input, the user's own exception with its traceback) are shown there once instead."""

    active = False

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.active and record.getMessage().startswith("Error in training function"))


_SHOWN_BY_THE_DRIVER = _ShownByTheDriver()


def _worker_logging() -> None:
    try:
        from ray.train.v2._internal import util as train_util

        logging.getLogger(train_util.__name__).addFilter(_SHOWN_BY_THE_DRIVER)
    except Exception:  # a Ray refactor must never break training
        pass
    app_log = logging.getLogger("ray_app")
    if not app_log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        app_log.addHandler(handler)
        app_log.setLevel(logging.INFO)
        app_log.propagate = False
    _quiet_report_log()


def enter_project(folder: str) -> None:
    """Run the user's code as from the folder ray-app started in, where this node has it (a local run, or
    a cluster whose nodes share it). Elsewhere the code comes with the job's working_dir or the image."""
    from ray_app.plugins import add_project_to_path

    if folder and os.path.isdir(folder):
        os.chdir(folder)  # relative paths in the user's args mean what they mean on the user's command line
        add_project_to_path(folder)


def _train(cfg: Config, runtime: RayRuntime, stats) -> tuple[dict, object]:
    from ray_app.checkpoint import Checkpointer
    from ray_app.loop import Trainer, build_parts
    from ray_app.metrics import NullMetrics, PrometheusMetrics

    checkpointer = Checkpointer(runtime.storage, cfg.run.name, runtime.report, every_epochs=cfg.checkpoint.every_epochs,
                                every_steps=cfg.checkpoint.every_steps, resume_from=cfg.run.resume_from,
                                staged=cfg.checkpoint.upload == "async",
                                warn=lambda m: print(f"WARNING: {m}", flush=True) if runtime.rank == 0 else None)
    metrics = NullMetrics()
    if runtime.rank == 0 and cfg.metrics.enabled:
        metrics = PrometheusMetrics(cfg.metrics.port)
    parts = build_parts(cfg, runtime)
    stats.mark("model_ready_unix")
    trainer = Trainer(cfg, runtime, parts, checkpointer, metrics, stats, preemption_agreement(cfg))
    return trainer.fit(), trainer


def preemption_agreement(cfg: Config):
    """The per-step flag of ``ray_app.preemption`` on a gloo group: the default one on CPU, its own
    next to nccl (made here, by every rank)."""
    import torch.distributed as dist

    from ray_app.preemption import Agreement

    enabled = cfg.failure.preemption_checkpoint and dist.is_initialized()
    group = dist.new_group(backend="gloo") if enabled and cfg.scaling.use_gpu else None
    return Agreement(group, enabled=enabled)


def _eval(cfg: Config, runtime: RayRuntime, stats, checkpoint: str) -> tuple[dict, object]:
    """Build the checkpoint's data, model and task, load its weights, evaluate exactly."""
    from ray_app.checkpoint import CheckpointError, load_verified, resolve_checkpoint_uri
    from ray_app.loop import Trainer, build_parts
    from ray_app.metrics import NullMetrics

    parts = build_parts(cfg, runtime)
    try:  # the driver read only the config: a damaged file is found here, and is bad input (exit 2)
        loaded = load_verified(*resolve_checkpoint_uri(checkpoint), rank=None, model_only=True)
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from None
    parts.module.load_state_dict(loaded.model)
    trainer = Trainer(cfg, runtime, parts, checkpointer=None, metrics=NullMetrics(), stats=stats)
    result = dict(trainer.evaluate(), checkpoint=loaded.uri, global_step=loaded.state.get("global_step"))
    runtime.report(result)
    return result, trainer


def worker_main(job: dict, results=None) -> None:
    """Entry point of every Ray Train worker, for ``train``, ``eval`` and ``run`` (mode ``script``: the
    user's own script, see ``ray_app.script``). Rank 0 puts its result on ``results`` (a Ray queue on the
    driver's node).

    An exception raised in the user's plug-in code is re-raised as a ``UserCodeError`` that carries its
    traceback (from the user's first frame) and a fingerprint, so the driver shows it once and the
    failure policy (``ray_app.failure_policy``) stops when the same error recurs after a restart.
    """
    from ray_app.loop import RunStats
    from ray_app.plugins import UserCodeError, plugin_roots
    from ray_app.preemption import Preempted, Stopped
    from ray_app.storage import open_storage

    stats = RunStats()
    _worker_logging()
    enter_project(job.get("project_dir", ""))
    cfg = config_from_dict(job["config"])
    storage = open_storage(cfg.run.storage, retry_s=cfg.failure.storage_retry_s)
    runtime = RayRuntime(storage, cfg.run.name, cfg.checkpoint.upload)
    trainer = None
    try:
        if job["mode"] == "script":
            from ray_app.script import run_in_worker

            result = run_in_worker(job, runtime)  # the script's own errors come back as UserCodeError
        elif job["mode"] == "eval":
            result, trainer = _eval(cfg, runtime, stats, job["checkpoint"])
        else:
            result, trainer = _train(cfg, runtime, stats)
    except Exception as exc:
        if isinstance(exc, (ConfigError, UserCodeError, Preempted, Stopped)):
            _SHOWN_BY_THE_DRIVER.active = True  # shown once by the driver, or (Preempted) a restart
            raise
        pos = getattr(trainer, "pos", None)
        wrapped = UserCodeError.from_exception(exc, runtime.rank, getattr(pos, "global_step", -1), plugin_roots(cfg))
        if wrapped is None:
            raise
        _SHOWN_BY_THE_DRIVER.active = True
        raise wrapped from None
    if results is not None and runtime.rank == 0:
        results.put(result)


# ---------------------------------------------------------------- driver side

def _quiet_ray_env() -> None:
    # keep the driver's output readable: progress lines, not a wall of Ray internals
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    # Ray Train's controller polls the worker group every 2 s by default; 0.5 s ends a finished run
    # sooner and notices a dead worker sooner (bench case v, variant "ray-poll", measures the difference)
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


_quiet_ray_env()  # at import: Ray reads some of these when it is first imported


def init_ray(cfg: Config) -> None:
    """Join the cluster at RAY_ADDRESS, else start a local Ray sized to this machine."""
    import ray

    address = os.environ.get("RAY_ADDRESS")
    # Ray Train copies these from the driver's environment to its controller and workers;
    # no runtime_env is needed (a job-level runtime_env would bypass Ray's pre-started workers).
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")  # workers' print() goes to stdout as written, not through a logger
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")  # one actor less to start
    os.environ.update(hang_env(cfg.failure.hang_timeout_s))
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        # what the kit binds itself stays on this machine; the workers of the Ray started here inherit it
        os.environ.update(local_bind_env(os.environ))
        # the dashboard (on 127.0.0.1 only) serves the State API Ray Train's controller polls
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=True, dashboard_host="127.0.0.1",
                 logging_level=logging.WARNING)
    _check_capacity(cfg, ray.cluster_resources(), bool(address))


def local_bind_env(environ) -> dict[str, str]:
    """A local run listens on loopback where the kit chooses: rank 0's exporter binds 127.0.0.1
    (``ray_app.metrics.BIND_ENV``) and gloo binds the loopback interface (``GLOO_SOCKET_IFNAME``; by default
    gloo binds the address the host name resolves to, often the machine's address on its network).
    A value the user set is kept. Set before ``ray.init``: the raylet and the workers it starts inherit
    the driver's environment. Ray's own servers are Ray's choice (README, "What a local run listens on")."""
    from ray_app.metrics import BIND_ENV

    env = {}
    if not environ.get("GLOO_SOCKET_IFNAME", "").strip():
        env["GLOO_SOCKET_IFNAME"] = loopback_interface()
    if not environ.get(BIND_ENV, "").strip():
        env[BIND_ENV] = "127.0.0.1"
    return env


def loopback_interface() -> str:
    """The name of the interface holding 127.0.0.1: ``lo`` on Linux, ``lo0`` on macOS."""
    try:
        import psutil  # a Ray dependency

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address == "127.0.0.1" for a in addrs):
                return name
    except Exception:
        pass
    return "lo"


def hang_env(hang_timeout_s: float) -> dict[str, str]:
    """How long Ray Train waits on a rank that makes no progress (``failure.hang_timeout_s``; the process
    group's collective timeout is set with it in ``build_trainer``): a worker whose process answers no
    health check (stopped, or its interpreter wedged), and its barriers (``ray.train.report``). Ray Train
    copies these to its controller and workers. Tearing down a group with a stopped worker waits on
    its process group's shutdown: 5 s instead of 30 (read where Ray runs: a local Ray started here)."""
    seconds = f"{hang_timeout_s:g}"
    return {"RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S": seconds, "RAY_TRAIN_COLLECTIVE_TIMEOUT_S": seconds,
            "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S": "5"}


def min_workers(cfg: Config) -> int:
    """The fewest workers the run trains with: scaling.min_workers when elastic, else num_workers."""
    return cfg.scaling.min_workers or cfg.scaling.num_workers


def _check_capacity(cfg: Config, resources: dict, remote: bool) -> None:
    s = cfg.scaling
    need_cpu = min_workers(cfg) * s.cpus_per_worker
    have_cpu = resources.get("CPU", 0)
    where = "the Ray cluster" if remote else "this machine"
    if need_cpu > have_cpu and not s.use_gpu:
        raise UserError(f"config key scaling.num_workers={s.num_workers} x scaling.cpus_per_worker={s.cpus_per_worker} "
                        f"needs {need_cpu:g} CPUs but {where} has {have_cpu:g}; lower them or add nodes")
    if s.use_gpu:
        need_gpu, have_gpu = min_workers(cfg) * s.gpus_per_worker, resources.get("GPU", 0)
        if need_gpu > have_gpu:
            raise UserError(f"config key scaling.use_gpu=true needs {need_gpu:g} GPUs but {where} has {have_gpu:g}; "
                            "lower scaling.num_workers or add GPU nodes")


# Ray Train V2 default controller callbacks the kit leaves out; each starts one more Ray actor (one more
# Python process importing Ray) while the worker group starts, so on a small machine each costs start-up
# time:
# - DatasetsCallback: a DatasetManager actor per run, for Ray Datasets passed to the trainer; the kit passes
#   none (its loaders are plain torch DataLoaders), so it is dropped only when there are no datasets.
# - PlacementGroupCleanerCallback: a detached actor per run that removes the worker group's placement group
#   if the controller dies while its driver lives on. The kit's driver waits on the controller and exits
#   with it, and Ray removes the placement groups of a finished job itself.
LEAN_DROPPED_CALLBACKS = ("DatasetsCallback", "PlacementGroupCleanerCallback")


@functools.cache
def lean_trainer_class():
    """``TorchTrainer`` without the callbacks in ``LEAN_DROPPED_CALLBACKS`` and with the kit's failure policy
    (``ray_app.failure_policy``). Built on first use: importing ray.train.torch imports torch, which the
    CLI does not need for other commands."""
    from ray.train.torch import TorchTrainer

    from ray_app.failure_policy import KitFailurePolicy

    class LeanTorchTrainer(TorchTrainer):
        def _create_default_callbacks(self):
            callbacks = super()._create_default_callbacks()
            drop = set(LEAN_DROPPED_CALLBACKS) - ({"DatasetsCallback"} if self.datasets else set())
            return [cb for cb in callbacks if type(cb).__name__ not in drop]

        def _initialize_and_run_controller(self, **kwargs):
            kwargs["failure_policy"] = KitFailurePolicy(self.run_config.failure_config)
            return super()._initialize_and_run_controller(**kwargs)

    if not callable(getattr(TorchTrainer, "_create_default_callbacks", None)):
        return TorchTrainer  # a Ray without this hook: its defaults, unchanged
    return LeanTorchTrainer


def build_trainer(cfg: Config, job: dict, results, run_name: str, storage_path: str, fs=None):
    """The one TorchTrainer of ``train`` and ``eval``: resources, backend, failure handling, logging."""
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    from ray_app import preemption

    resources = {"CPU": cfg.scaling.cpus_per_worker}
    if cfg.scaling.use_gpu:
        resources["GPU"] = cfg.scaling.gpus_per_worker
    return lean_trainer_class()(
        functools.partial(worker_main, results=results),
        train_loop_config=job,
        # elastic (scaling.min_workers): Ray Train starts with what the cluster has room for, restarts a
        # group that lost workers with fewer, and grows it back; the loop re-shards at each new world size
        scaling_config=ScalingConfig(num_workers=_num_workers(cfg), use_gpu=cfg.scaling.use_gpu,
                                     resources_per_worker=resources,
                                     elastic_resize_monitor_interval_s=cfg.scaling.resize_interval_s),
        # every collective (gloo and nccl alike) gives up after failure.hang_timeout_s: a stopped or
        # deadlocked rank holds the others that long, not torch's 30 minutes
        torch_config=TorchConfig(backend="nccl" if cfg.scaling.use_gpu else "gloo",
                                 timeout_s=int(cfg.failure.hang_timeout_s)),
        run_config=RunConfig(
            name=run_name, storage_path=storage_path, storage_filesystem=fs,
            failure_config=FailureConfig(max_failures=cfg.failure.max_failures),
            # the notice only means something to the kit's own loop: a script or an evaluation keeps Ray's exit
            callbacks=[preemption.worker_callback()] if cfg.failure.preemption_checkpoint and job["mode"] == "train"
            else [],
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
            # Ray Train's own INFO lines (every report, every rank) drown the progress lines
            logging_config=LoggingConfig(log_level=os.environ.get("RAY_APP_RAY_TRAIN_LOG_LEVEL", "WARNING")),
        ),
    )


def _num_workers(cfg: Config):
    low, high = min_workers(cfg), cfg.scaling.num_workers
    return (low, high) if low < high else high


def validate_before_ray(cfg: Config) -> None:
    """The plug-ins (import, attribute, arguments) and, where the driver shares the workers' files
    (local Ray), the data folder. Torch is not imported for the built-ins."""
    from ray_app.plugins import add_project_to_path, validate, validate_local_data

    add_project_to_path(os.getcwd())
    validate(cfg)
    if not os.environ.get("RAY_ADDRESS"):
        validate_local_data(cfg)


def preflight_run(cfg: Config):
    """Everything that can be checked before a worker starts. Returns the storage."""
    from ray_app.storage import StorageError, open_storage, preflight

    validate_before_ray(cfg)
    storage = open_storage(cfg.run.storage, retry_s=cfg.failure.storage_retry_s)  # preflight itself fails fast
    preflight(storage)
    _check_resume(cfg, storage)
    if cfg.run.resume_from:
        from ray_app.checkpoint import CheckpointError, committed_config

        try:
            uri, saved = committed_config(cfg.run.resume_from)  # its manifest and config.json only
        except (CheckpointError, StorageError) as exc:
            raise UserError(f"config key run.resume_from: {exc}") from None
        from ray_app.config import resume_conflicts

        model_changes = [c for c in resume_conflicts(saved, cfg) if c.startswith("model.")]
        if model_changes:
            raise UserError(f"config key run.resume_from: {uri} holds another model "
                            f"({', '.join(model_changes)}); its weights cannot be loaded into this one")
    return storage


CHECKPOINT_PREFIX = "ckpt-s"  # = ray_app.checkpoint.PREFIX (a unit test checks), known here without torch


def _check_resume(cfg: Config, storage) -> None:
    """A run resumes only with the config its checkpoints depend on (config.RESUME_MUST_MATCH)."""
    if not any(d.startswith(CHECKPOINT_PREFIX) for d in storage.list_dirs(cfg.run.name)):
        return  # a new run: ray_app.checkpoint (torch, seconds of the driver's start-up) is not imported
    from ray_app.checkpoint import newest_committed_config
    from ray_app.config import resume_conflicts

    found = newest_committed_config(storage, cfg.run.name)
    if found is None:
        return
    uri, saved = found
    conflicts = resume_conflicts(saved, cfg)
    if conflicts:
        raise UserError(f"run {cfg.run.name} in {storage.uri('')} has checkpoints ({uri}) made with another "
                        f"{'; '.join(conflicts)}: its checkpoints cannot continue with this config; use another "
                        f"run.name for a new run (add run.resume_from={storage.uri(cfg.run.name)} to warm-start it "
                        "from this one), or set these keys back")


def driver_node_queue():
    """A Ray queue pinned to the driver's node (0 CPUs): it must outlive any worker node's death."""
    import ray
    from ray.util.queue import Queue
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return Queue(actor_options={"num_cpus": 0, "scheduling_strategy": here})


def launch(cfg: Config, job: dict, run_name: str, storage_path: str, fs=None) -> dict:
    """Start Ray (or join it), run the worker group, return rank 0's result.

    Ray Train V2's Result.metrics are those of the last report *with a checkpoint*: stale after a
    resume that trains nothing, empty with checkpoints off or in eval. Rank 0 hands over its result
    through a queue instead.
    """
    init_ray(cfg)
    ray_ready = time.time()
    import ray
    from ray.train import TrainingFailedError

    from ray_app.preemption import stop_on_sigterm

    results = driver_node_queue()
    job = dict(job, config=cfg.to_dict(), project_dir=os.getcwd())
    trainer = build_trainer(cfg, job, results, run_name, storage_path, fs)
    try:
        # the driver's SIGTERM (`ray job stop`, `docker stop`): the workers checkpoint, then the run stops
        with stop_on_sigterm(cfg.failure.preemption_checkpoint and job["mode"] == "train"):
            result = trainer.fit()
        error = result.error
    except TrainingFailedError as exc:
        error = exc
    final = None
    while error is None and not results.empty():
        final = results.get(timeout=30)
    ray.shutdown()  # stop streaming worker logs so the summary really is the last line
    if error is not None:
        raise_worker_failure(error)
    if final is None:
        raise TrainingFailed("the workers finished but rank 0 returned no result")
    return dict(final, ray_ready_unix=ray_ready)


def raise_worker_failure(error) -> None:
    """One line for bad input found by a worker (exit 2); the user's traceback once for their bug (exit 1);
    one line for a run stopped at the driver's SIGTERM (exit 143)."""
    from ray_app.plugins import UserCodeError
    from ray_app.preemption import Stopped

    failures = getattr(error, "worker_failures", None) or {}
    by_rank = [failures[r] for r in sorted(failures)]
    if by_rank and all(isinstance(e, Stopped) for e in by_rank):
        raise RunStopped(str(by_rank[0]).strip().splitlines()[0])
    bad_input = [e for e in by_rank if isinstance(e, ConfigError)]
    if bad_input:
        raise UserError(str(bad_input[0]).strip().splitlines()[0])
    user = [e for e in by_rank if isinstance(e, UserCodeError)]
    if user:
        sys.stderr.write(f"ray-app: rank {user[0].rank} raised in your code:\n{user[0].traceback_text}")
        sys.stderr.flush()
        raise TrainingFailed(f"{user[0].summary} (rank {user[0].rank}; traceback above)")
    lines = [ln.strip() for ln in str(error).strip().splitlines() if ln.strip()]
    raise TrainingFailed((lines[-1] if lines else type(error).__name__)[:500])


def run_training(cfg: Config) -> dict:
    """Preflight, train, return the summary dict."""
    storage = preflight_run(cfg)
    t0 = time.perf_counter()
    storage_path, fs = storage.ray_storage()
    m = launch(cfg, {"mode": "train"}, cfg.run.name, storage_path, fs)
    return {
        "run": cfg.run.name,
        "checkpoint": m.get("checkpoint"),
        "epochs": m.get("epochs", m.get("epoch")),
        "global_step": m.get("global_step"),
        "train_loss": m.get("train_loss"),
        # every metric of the task (eval_loss, eval_accuracy for classification; eval_mse, eval_mae, ...)
        **{k: v for k, v in m.items() if k.startswith("eval_")},
        "num_eval_samples": m.get("num_samples"),
        "train_seconds": m.get("train_seconds"),
        "wall_seconds": round(time.perf_counter() - t0, 2),
        "resumed_from_step": m.get("resumed_from_step", 0),
        "world_size": m.get("world_size", cfg.scaling.num_workers),  # the last worker group's (elastic: may be fewer)
        "steady_samples_per_second": m.get("steady_samples_per_second"),
        # this worker group's checkpoints and the time training waited for them
        "checkpoints_written": m.get("checkpoints_written"),
        "checkpoint_blocked_seconds": m.get("checkpoint_blocked_seconds"),
        # start-up timeline (unix seconds): driver start, Ray ready, worker entry, model ready, first step
        "timeline": {"driver_start_unix": DRIVER_START_UNIX, "ray_ready_unix": m.get("ray_ready_unix"),
                     **{k: m.get(k) for k in ("worker_start_unix", "model_ready_unix", "first_step_unix")}},
    }


class TrainingFailed(RuntimeError):
    """Training failed after all retries (exit code 1)."""


class RunStopped(RuntimeError):
    """The driver was sent SIGTERM and the workers' checkpoint is committed (exit code 143 = 128 + SIGTERM)."""
