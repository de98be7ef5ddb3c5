"""The driver side of Ray: preflight, Ray, the ``TorchTrainer``, for train, eval and a script.

Connect to ``RAY_ADDRESS`` (or start a local Ray sized to the machine), check the cluster can hold the
workers, build Scaling / Run / Failure / Checkpoint configs around ``ray_app.worker.entry.worker_main``, run,
and turn rank 0's result into the summary: ``run_training`` (``ray-app train``), ``run_eval``
(``ray-app eval``) and ``run_script`` (``ray-app run``) enter through the same ``launch``.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import signal
import sys
import threading
import time
import uuid

from ray_app.shared import failures, ray_seam
from ray_app.shared.config import Config, config_from_dict, deprecated_keys_note, strategy_keys_note
from ray_app.shared.errors import ConfigError, TrainingFailed, UserError, first_line
from ray_app.worker.entry import ResultSlot, worker_main


def _process_start_unix() -> float:
    try:
        import psutil  # a Ray dependency

        return psutil.Process().create_time()
    except Exception:
        return time.time()


DRIVER_START_UNIX = _process_start_unix()  # when `ray-app train` was started


def _quiet_ray_env() -> None:
    # keep the driver's output readable: progress lines, not a wall of Ray internals
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")


_quiet_ray_env()  # at import: Ray reads some of these when it is first imported


ELASTIC_START_TIMEOUT_S = 20.0


def poll_interval_s(num_workers: int) -> float:
    """How often Ray Train's controller polls the worker group (Ray's default: every 2 s). Each poll takes
    the workers' reports, and a report waits until the controller has taken the previous one: with one
    checkpoint an epoch, the digits demo's 10 checkpoints blocked training 2.4 s in all at 0.5 s, 0.2 s
    at 0.1 s; the end of training reaches the driver a poll later too. Each poll is one call per worker:
    0.1 s for small groups, up to 0.5 s for 50 workers and more."""
    return min(0.5, max(0.1, num_workers / 100))


class BusyPolling:
    """How often Ray Train's controller polls a training run's workers: every ``fast_s`` (``poll_interval_s``)
    while they report or finish, for ``window_s`` after the last poll that brought a report, a finished
    worker or an error; else every ``slow_s``. A checkpoint's report waits until the controller has taken
    the previous one, so reports want the fast poll; in between, each poll is a call into every worker and
    about 4 ms of the controller's CPU: at 0.1 s, 2 % of a 2-core machine that also trains (bench/RESULTS.md),
    at 0.5 s a fifth of that. A dead worker or the end of a run without reports is seen up to ``slow_s`` later."""

    def __init__(self, fast_s: float, slow_s: float = 0.5, window_s: float = 3.0):
        self.fast_s, self.slow_s, self.window_s = fast_s, max(slow_s, fast_s), window_s
        self._fast_until = 0.0

    def after(self, statuses, now: float | None = None) -> float:
        """The interval before the next poll, given this poll's worker statuses (Ray Train's WorkerStatus:
        ``running``, ``error``, ``training_report``)."""
        now = time.monotonic() if now is None else now
        if any(s.training_report is not None or s.error is not None or not s.running for s in statuses):
            self._fast_until = now + self.window_s
        return self.fast_s if now < self._fast_until else self.slow_s


def busy_polling(num_workers: int) -> BusyPolling | None:
    """The kit's controller poll for a training run, or None (Ray's fixed interval) where
    RAY_TRAIN_HEALTH_CHECK_INTERVAL_S was set to another value than the kit's."""
    fast = poll_interval_s(num_workers)
    if os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", f"{fast:g}") != f"{fast:g}":
        return None
    return BusyPolling(fast)


def init_ray(cfg: Config) -> None:
    """Join the cluster at RAY_ADDRESS, else start a local Ray sized to this machine."""
    import ray

    address = os.environ.get("RAY_ADDRESS")
    # Ray Train copies these from the driver's environment to its controller and workers;
    # no runtime_env is needed (a job-level runtime_env would bypass Ray's pre-started workers).
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")  # workers' print() goes to stdout as written, not through a logger
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")  # one actor less to start
    os.environ.update(hang_env(cfg.failure.hang_timeout_s))
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", f"{poll_interval_s(cfg.scaling.num_workers):g}")
    if cfg.scaling.min_workers and cfg.scaling.min_workers < cfg.scaling.num_workers:
        # elastic: a group is sized to the workers Ray's resource view has ready, and placing it takes a
        # moment. Just after a node is lost that view still counts it (until Ray's health checks find the
        # node dead and the autoscaling coordinator's next tick, every 20 s): the group asked for is then
        # one worker too big, and Ray Train waits its start timeout (60 s) before asking again.
        os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", f"{ELASTIC_START_TIMEOUT_S:g}")
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        # what the kit binds itself stays on this machine; the workers of the Ray started here inherit it
        os.environ.update(local_bind_env(os.environ))
        # Ray Train needs no dashboard; starting one (a head process and its ~10 module processes, each
        # importing Ray) made ray.init wait ~5 s longer on 2 cores. RAY_APP_DASHBOARD=1 starts it, on 127.0.0.1.
        dashboard = local_dashboard(os.environ)
        # no autoscaler monitor, and without the dashboard no API server (ray_app.shared.ray_seam.lean_local_ray)
        with ray_seam.lean_local_ray(api_server=dashboard):
            ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=dashboard,
                     dashboard_host="127.0.0.1", logging_level=logging.WARNING)
    _check_capacity(cfg, ray.cluster_resources(), bool(address))


DASHBOARD_ENV = "RAY_APP_DASHBOARD"


def local_dashboard(environ) -> bool:
    """Whether a local Ray started by the kit runs Ray's dashboard (``RAY_APP_DASHBOARD=1``; off by default)."""
    return environ.get(DASHBOARD_ENV, "").strip().lower() in ("1", "true", "yes")


def import_in_background(*modules: str) -> threading.Thread:
    """Import ``modules`` on a thread while the main thread waits on something else (``ray.init`` waits
    on the processes it starts): torch and Ray Train take ~3.5 s of the driver's start-up on 2 cores.
    An import that fails here is left to the main thread's own import, which raises it there."""
    def run() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except BaseException:  # noqa: B036 - the main thread's import reports it
                return

    thread = threading.Thread(target=run, name="ray-app-imports", daemon=True)
    thread.start()
    return thread


def local_bind_env(environ) -> dict[str, str]:
    """A local run listens on loopback where the kit chooses: rank 0's exporter binds 127.0.0.1
    (``ray_app.worker.metrics.BIND_ENV``) and gloo binds the loopback interface (``GLOO_SOCKET_IFNAME``; by default
    gloo binds the address the host name resolves to, often the machine's address on its network).
    A value the user set is kept. Set before ``ray.init``: the raylet and the workers it starts inherit
    the driver's environment. Ray's own servers are Ray's choice (README, "What a local run listens on")."""
    from ray_app.worker.metrics import BIND_ENV

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


def launch_stamp(unix: float | None = None) -> str:
    """The driver's launch as a folder name that sorts in time order (UTC)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if unix is None else unix))


def hang_env(hang_timeout_s: float) -> dict[str, str]:
    """How long Ray Train waits on a rank that makes no progress (``failure.hang_timeout_s``; the process
    group's collective timeout is set with it in ``build_trainer``): a worker whose process answers no
    health check (stopped, or its interpreter wedged), and its barriers (``ray.train.report``). Ray Train
    copies these to its controller and workers. (Tearing down a group with a stopped or orphaned rank
    waits ``KitTorchConfig.shutdown_timeout_s`` on its process group, wherever Ray runs.)"""
    seconds = f"{hang_timeout_s:g}"
    return {"RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S": seconds, "RAY_TRAIN_COLLECTIVE_TIMEOUT_S": seconds}


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
    """``TorchTrainer`` without the callbacks in ``LEAN_DROPPED_CALLBACKS``, with the kit's failure policy
    (``ray_app.controller.failure_policy``), and, where ``without_autoscaler`` is set on it, without Ray's autoscaling
    coordinator (``ray_app.controller.scaling_policy``); the private hooks it overrides are the seam's
    (``ray_app.shared.ray_seam.trainer_class``). Built on first use: importing ray.train.torch imports torch,
    which the CLI does not need for other commands."""
    from ray_app.controller.failure_policy import KitFailurePolicy
    from ray_app.controller.scaling_policy import controller_scaling_policy

    return ray_seam.trainer_class(LEAN_DROPPED_CALLBACKS, KitFailurePolicy, controller_scaling_policy)


def build_trainer(cfg: Config, job: dict, results, run_name: str, storage_path: str, fs=None):
    """The one TorchTrainer of ``train`` and ``eval``: resources, backend, failure handling, logging."""
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig

    from ray_app.controller.backend import KitTorchConfig
    from ray_app.controller.hang_verdict import HangReports
    from ray_app.shared.reports import margin_s
    from ray_app.worker import preemption

    resources = {"CPU": cfg.scaling.cpus_per_worker}
    if cfg.scaling.use_gpu:
        resources["GPU"] = cfg.scaling.gpus_per_worker
    if job["mode"] == "train":  # hang reports: {run}/reports/{launch}-attempt-{n}/ (ray_app.shared.reports)
        job = dict(job, launch=launch_stamp(), attempt_key=f"ray_app:attempt:{uuid.uuid4().hex}")
    trainer = lean_trainer_class()(
        functools.partial(worker_main, results=results),
        train_loop_config=job,
        # elastic (scaling.min_workers): Ray Train starts with what the cluster has room for, restarts a
        # group that lost workers with fewer, and grows it back; the loop re-shards at each new world size
        scaling_config=ScalingConfig(num_workers=_num_workers(cfg), use_gpu=cfg.scaling.use_gpu,
                                     resources_per_worker=resources,
                                     elastic_resize_monitor_interval_s=cfg.scaling.resize_interval_s),
        # every collective (gloo and nccl alike) gives up after failure.hang_timeout_s: a stopped or
        # deadlocked rank holds the others that long, not torch's 30 minutes; Ray Train's controller
        # sets the group up without importing torch (ray_app/controller/backend.py)
        torch_config=KitTorchConfig(backend="nccl" if cfg.scaling.use_gpu else "gloo",
                                    timeout_s=int(cfg.failure.hang_timeout_s)),
        run_config=RunConfig(
            name=run_name, storage_path=storage_path, storage_filesystem=fs,
            failure_config=FailureConfig(max_failures=cfg.failure.max_failures),
            # the notice only means something to the kit's own loop: a script or an evaluation keeps Ray's exit
            callbacks=[cb for cb in [preemption.worker_callback()] if cb is not None]
            if cfg.failure.preemption_checkpoint and job["mode"] == "train" else [],
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
            # Ray Train's own INFO lines (every report, every rank) drown the progress lines
            logging_config=LoggingConfig(log_level=os.environ.get("RAY_APP_RAY_TRAIN_LOG_LEVEL", "WARNING")),
        ),
    )
    if job["mode"] == "train":  # the failure policy reads them before a restart and says who did not arrive
        trainer.poll_when_busy = busy_polling(cfg.scaling.num_workers)
        trainer.failure_policy_kwargs = {"hang_reports": HangReports(
            cfg.run.storage, cfg.run.name, job["launch"], retry_s=min(cfg.failure.storage_retry_s, 5.0),
            max_age_s=2 * cfg.failure.hang_timeout_s + 60, wait_s=margin_s(cfg.failure.hang_timeout_s))}
    return trainer


def _num_workers(cfg: Config):
    low, high = min_workers(cfg), cfg.scaling.num_workers
    return (low, high) if low < high else high


def validate_before_ray(cfg: Config) -> None:
    """The plug-ins (import, attribute, arguments) and, where the driver shares the workers' files
    (local Ray), the data folder. Torch is not imported for the built-ins."""
    from ray_app.shared.plugins import (
        HF_TARGET,
        SHARDS_TARGET,
        TEXT_TARGET,
        add_project_to_path,
        check_shard_set,
        loader_workers_note,
        target,
        validate,
        validate_local_data,
    )

    add_project_to_path(os.getcwd())
    validate(cfg)
    if not os.environ.get("RAY_ADDRESS"):
        validate_local_data(cfg)
    elif target("data", cfg.data.name) == SHARDS_TARGET and cfg.data.path.startswith("s3://"):
        check_shard_set(cfg)  # the store the workers read: reachable from here too
    model_config = None
    if target("model", cfg.model.name) == HF_TARGET:  # a pretrained model's folder: config, index, shards
        from ray_app.shared.hf import check_pretrained

        model_config = check_pretrained(cfg.model.args, retry_s=cfg.failure.storage_retry_s)
        if cfg.model.lora:  # its targets against the model made on meta (its config read, no weights)
            from ray_app.worker.lora import check_targets

            check_targets(cfg.model.args, cfg.model.lora, retry_s=cfg.failure.storage_retry_s)
    if target("data", cfg.data.name) == TEXT_TARGET:  # the text and the tokenizer, against the model's config
        from ray_app.shared.text import check_text

        check_text(cfg.data.args, model_config, retry_s=cfg.failure.storage_retry_s)
    for note in (deprecated_keys_note(cfg), loader_workers_note(cfg), strategy_keys_note(cfg)):
        if note:
            print(note, file=sys.stderr, flush=True)


def preflight_run(cfg: Config):
    """Everything that can be checked before a worker starts. Returns the storage."""
    return preflight_train(cfg)[0]


CHOSEN_FILES = ("config.json", "metrics.json")  # what the driver keeps of the checkpoint it chose


def say_skipped(line: str) -> None:
    """The driver's one line for a checkpoint the selection skipped (``ray_app.shared.catalog.good``)."""
    print(line, file=sys.stderr, flush=True)


def preflight_train(cfg: Config):
    """``preflight_run``'s checks, and what they found: (storage, the run's newest checkpoint that verifies or
    None, the names of the checkpoints said to be skipped: the workers do not say them again)."""
    from ray_app.shared.catalog import AT_START, choose
    from ray_app.shared.errors import CheckpointError, StorageError
    from ray_app.shared.storage import open_storage, preflight

    validate_before_ray(cfg)
    # the driver's own reads, the preflight's included, wait an outage out for failure.storage_retry_s (a
    # resume's store may be down a moment); an answer that will not change (access denied) fails at once
    storage = open_storage(cfg.run.storage, retry_s=cfg.failure.storage_retry_s, then=AT_START)
    preflight(storage)
    said: set = set()
    newest = _check_resume(cfg, storage, said)
    if cfg.run.resume_from:
        try:  # it verifies (every file read; the config kept); an outage is waited out for failure.storage_retry_s
            found = choose(cfg.run.resume_from, keep=CHOSEN_FILES.__contains__, retry_s=cfg.failure.storage_retry_s,
                           then=AT_START, say=say_skipped, said=said)
        except (CheckpointError, StorageError) as exc:
            raise UserError(f"config key run.resume_from: {exc}") from None
        from ray_app.shared.config import resume_conflicts

        model_changes = [c for c in resume_conflicts(found.config, cfg) if c.startswith("model.")]
        if model_changes:
            raise UserError(f"config key run.resume_from: {found.uri} holds another model "
                            f"({', '.join(model_changes)}); its weights cannot be loaded into this one")
    return storage, newest, said


def _check_resume(cfg: Config, storage, said: set):
    """A run resumes only with the config its checkpoints depend on (config.RESUME_MUST_MATCH): that of the
    checkpoint it resumes from, its newest that verifies (returned; None for a new run)."""
    from ray_app.shared.catalog import newest_good
    from ray_app.shared.config import resume_conflicts

    found = newest_good(storage, cfg.run.name, keep=CHOSEN_FILES.__contains__, say=say_skipped, said=said)
    if found is None:
        return None
    conflicts = resume_conflicts(found.config, cfg)
    if conflicts:
        raise UserError(f"run {cfg.run.name} in {storage.uri('')} has checkpoints ({found.uri}) made with another "
                        f"{'; '.join(conflicts)}: its checkpoints cannot continue with this config; use another "
                        f"run.name for a new run (add run.resume_from={storage.uri(cfg.run.name)} to warm-start it "
                        "from this one), or set these keys back")
    return found


class WorkerLogs:
    """When Ray last streamed worker output to this driver. A worker's last lines (a script's final print,
    the last epoch line) travel from its log file through Ray's log monitor (which looks every 0.1 s) and
    GCS to the driver; ``ray.shutdown`` stops that stream, and what is still on its way is lost. ``drain``
    waits until the stream has been quiet for ``quiet_s`` (at most ``most_s``) before the driver shuts Ray
    down. Through the seam's ``WorkerLogStream``; without it, ``drain`` waits ``quiet_s``."""

    HANDLER = ray_seam.WorkerLogStream.HANDLER

    def __init__(self):
        self.last = time.monotonic()
        self._stream = ray_seam.WorkerLogStream(self._seen)

    def _seen(self, data) -> None:
        self.last = time.monotonic()

    def drain(self, quiet_s: float = 0.3, most_s: float = 2.0) -> None:
        start = time.monotonic()
        while time.monotonic() - start < most_s and time.monotonic() - max(self.last, start) < quiet_s:
            time.sleep(0.02)
        self._stream.close()


def launch(cfg: Config, job: dict, run_name: str, storage_path: str, fs=None, trial=None) -> dict:
    """Start Ray (or join it), run the worker group, return rank 0's result.

    Ray Train V2's Result.metrics are those of the last report *with a checkpoint*: stale after a
    resume that trains nothing, empty with checkpoints off or in eval. Rank 0 hands over its result
    through Ray's key-value store instead (``ray_app.worker.entry.ResultSlot``).

    ``trial``: a sweep's trial (``ray_app.driver.sweep.Trial``), launched inside Ray Tune's trial actor: Ray
    is up already (this process neither starts nor stops it), the trial's callbacks join the trainer's and
    the trial fits it (relaying rank 0's reports to Tune). Everything else is the same path as ``ray-app train``.
    """
    own_ray = trial is None
    ray_ready = None
    if own_ray:
        # the driver's own torch and Ray Train imports run while ray.init waits on the processes it starts
        imports = import_in_background("torch", "ray.train.torch", "ray_app.controller.failure_policy",
                                       "ray_app.controller.scaling_policy")
        init_ray(cfg)
        ray_ready = time.time()
        imports.join()
    import ray
    from ray.train import TrainingFailedError

    from ray_app.driver.signals import stop_on_sigterm

    launch_key = uuid.uuid4().hex
    results = ResultSlot(launch_key)
    # tracking_key: the same for every worker-group restart of this launch (its MLflow run, before a
    # checkpoint has its id); a trial brings its own, and its project folder
    job = {"project_dir": os.getcwd(), "tracking_key": launch_key, **job, "config": cfg.to_dict()}
    trainer = build_trainer(cfg, job, results, run_name, storage_path, fs)
    # a Ray started here (or by the sweep's driver, on this machine) runs without the autoscaler
    trainer.without_autoscaler = trial.local_ray if trial is not None else not os.environ.get("RAY_ADDRESS")
    if trial is not None:
        trainer.run_config.callbacks.extend(trial.callbacks())
    if job.get("launch_id"):  # the failure policy writes each restart into the run journal
        trainer.failure_policy_kwargs = {**trainer.failure_policy_kwargs, "journal_of": (cfg.run.storage, run_name, job["launch_id"])}
    signals: list[int] = []
    logs = WorkerLogs() if own_ray else None
    try:
        # the driver's SIGTERM (`ray job stop`, `docker stop`) or SIGINT (Ctrl-C): the workers checkpoint,
        # then the run stops
        with stop_on_sigterm(own_ray and cfg.failure.preemption_checkpoint and job["mode"] == "train") as signals:
            trainer.kit_handles_sigint = own_ray and threading.current_thread() is threading.main_thread() and \
                cfg.failure.preemption_checkpoint and job["mode"] == "train"
            result = trainer.fit() if own_ray else trial.fit(trainer)
        error = result.error
    except TrainingFailedError as exc:
        error = exc
    except ray.exceptions.RayActorError as exc:  # Ray Train's controller died (its storage set-up gave up)
        if own_ray:
            logs.drain()
            ray.shutdown()
        raise failures.controller_died(exc) from None
    final = results.take() if error is None else None
    if own_ray:
        logs.drain()  # the workers' last lines, still on their way
        ray.shutdown()  # stop streaming worker logs so the summary really is the last line
    if error is not None:
        raise_worker_failure(error, interrupted=bool(signals) and signals[0] == signal.SIGINT)
    if final is None:
        raise TrainingFailed(f"{run_name}: the workers finished but rank 0 returned no result")
    return dict(final, ray_ready_unix=ray_ready)


def resume_command() -> str:
    """The command line that resumes this run: the same one (a run resumes from its newest checkpoint)."""
    import shlex

    return shlex.join(["ray-app", *sys.argv[1:]])


def raise_worker_failure(error, interrupted: bool = False) -> None:
    """The exception the failure table gives a run that ended on ``error`` (``ray_app.shared.failures.at_driver``),
    its row's exit code and line: bad input, the user's bug (their traceback once), a run stopped at the
    driver's SIGTERM or SIGINT (with the command that resumes it), any other failure."""
    raise failures.at_driver(error, interrupted=interrupted, resume_command=resume_command())


def run_training(cfg: Config) -> dict:
    """Preflight, train, return the summary dict."""
    from ray_app.shared.lease import held_run

    storage, newest, said = preflight_train(cfg)
    done = completed_run(cfg, newest)
    if done is not None:  # nothing left to train: no Ray, no workers
        return dict(done, restarts=[], wall_seconds=wall_seconds())
    storage_path, fs = storage.ray_storage()
    # one writer per run, before Ray starts; holding it, the driver sweeps what earlier writes left uncommitted
    with held_run(storage, cfg.run.name, cfg.run.lease_stale_s) as lease:
        journal = open_journal(storage, cfg, lease)
        try:
            # the workers commit a checkpoint only while the lease holds this driver's token
            m = launch(cfg, {"mode": "train", "lease_token": lease.token, "launch_id": journal.context["launch"],
                             "said": sorted(said)}, cfg.run.name, storage_path, fs)
        except BaseException as exc:
            close_journal(journal, exc)
            raise
        close_journal(journal, None, m.get("global_step"))
    restarts = launch_restarts(storage, cfg.run.name, journal.context["launch"])
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
        "wall_seconds": wall_seconds(),  # from the driver's start: preflight, its waits and Ray's start included
        "resumed_from_step": m.get("resumed_from_step", 0),
        # this launch's worker-group restarts and preemptions, each {kind, cause, rank, step} (None where not known);
        # the train_loss above is still the whole last epoch's (its loss sums travel in the checkpoints)
        "restarts": restarts,
        "skipped_steps": m.get("skipped_steps", 0),  # non-finite steps dropped (train.nonfinite=skip)
        "world_size": m.get("world_size", cfg.scaling.num_workers),  # the last worker group's (elastic: may be fewer)
        "steady_samples_per_second": m.get("steady_samples_per_second"),
        # a token task's tokens (train_tokens, steady_tokens_per_second); FLOPs per step and MFU where a peak is
        # known (flops_per_step, steady_mfu): left out when there is no such figure (never a fake 0)
        **{k: m[k] for k in THROUGHPUT_KEYS if m.get(k) is not None},
        # this worker group's checkpoints and the time training waited for them
        "checkpoints_written": m.get("checkpoints_written"),
        "checkpoint_blocked_seconds": m.get("checkpoint_blocked_seconds"),
        # start-up timeline (unix seconds): driver start, Ray ready, worker entry, model ready, first step
        "timeline": {"driver_start_unix": DRIVER_START_UNIX, "ray_ready_unix": m.get("ray_ready_unix"),
                     **{k: m.get(k) for k in ("worker_start_unix", "model_ready_unix", "first_step_unix")}},
    }


THROUGHPUT_KEYS = ("train_tokens", "steady_tokens_per_second", "flops_per_step", "steady_mfu")


def wall_seconds() -> float:
    """Seconds since the driver's process started (``DRIVER_START_UNIX``)."""
    return round(time.time() - DRIVER_START_UNIX, 2)


def launch_restarts(storage, run: str, launch: str) -> list[dict] | None:
    """This launch's restarts as the failure policy journaled them (``ray_app.shared.journal.restarts_of``);
    None when they cannot be known (the journal off, its store not answering now)."""
    from ray_app.shared import journal

    try:
        return journal.restarts_of(storage, run, launch)
    except Exception:  # the run is done: a store that fails this read leaves the summary without them
        return None


def open_journal(storage, cfg: Config, lease):
    """This launch's writer of the run journal (``ray_app.shared.journal``), its first events written: the launch
    (from the driver's start) and a lease taken over. Storage outages this process waits out are events too."""
    import socket

    from ray_app.shared import journal

    w = journal.writer(storage, cfg.run.name, source=f"driver-{journal.default_source()}")
    if w is None:  # never: the kit's stores are both journaled; a stand-in that records nothing
        w = journal.JournalWriter(None, cfg.run.name)
    w.context = {"launch": uuid.uuid4().hex[:12]}
    w.record("launch", time=DRIVER_START_UNIX, mode="train", host=socket.gethostname(), pid=os.getpid(),
             world_size=cfg.scaling.num_workers)
    if lease.took_over:
        w.record("lease_taken_over", **lease.took_over)
    journal.record_outages(w)
    return w


def close_journal(journal, error: BaseException | None, global_step=None) -> None:
    """The launch's end in the run journal, with the exit code the command ends with and its one line; then
    what is queued is written (for at most 10 s: the process ends right after)."""
    if error is None:
        code, line = failures.EXIT_OK, ""
    else:
        code = failures.exit_code(error)
        code, line = (failures.EXIT_FAILED if code is None else code), failures.one_line(error)
    journal.record("end", exit_code=code, line=first_line(line), global_step=global_step)
    journal.flush(10.0)


def completed_run(cfg: Config, found) -> dict | None:
    """The summary of a run whose newest checkpoint that verifies (``found``: ``preflight_train``'s) already
    ends it (``train.epochs`` done, or ``train.max_steps`` reached), said in one line; None when there is
    training left. Reads nothing more (no torch, no Ray)."""
    if found is None:
        return None
    manifest = found.manifest
    step, epoch = int(manifest.get("global_step") or 0), int(manifest.get("epoch") or 0)
    if epoch < cfg.train.epochs and not (cfg.train.max_steps and step >= cfg.train.max_steps):
        return None
    try:
        metrics = found.json("metrics.json")
    except Exception:  # an older checkpoint without it: the summary has no metrics
        metrics = {}
    print(complete_line(cfg, found.uri, epoch, step), file=sys.stderr, flush=True)
    return {"run": cfg.run.name, "checkpoint": found.uri, "epochs": epoch, "global_step": step,
            "train_loss": metrics.get("train_loss"), **{k: v for k, v in metrics.items() if k.startswith("eval_")},
            "train_seconds": 0.0, "wall_seconds": 0.0, "resumed_from_step": step, "complete": True}


def complete_line(cfg: Config, uri: str, epoch: int, step: int) -> str:
    """The one line of a complete run: the key (or keys) that ended it, ``train.max_steps`` reached or
    ``train.epochs`` done, with its value and what to raise to train on."""
    ended = [f"train.epochs={cfg.train.epochs}"] if epoch >= cfg.train.epochs else []
    if cfg.train.max_steps and step >= cfg.train.max_steps:
        ended.append(f"train.max_steps={cfg.train.max_steps}")
    keys = " and ".join(k.split("=")[0] for k in ended)
    return (f"ray-app: run {cfg.run.name} is complete: {uri} is at epoch {epoch}, step {step} ({' and '.join(ended)} "
            f"reached); nothing to train. Raise {keys} to train on, or use another run.name for a new run")


def run_eval(uri: str, overrides: list[str]) -> dict:
    """``ray-app eval``: the exact evaluation of a saved checkpoint on the workers. The data, model and task
    are rebuilt from the checkpoint's own config (``--set`` may change keys such as ``scaling.num_workers``)."""
    import tempfile

    from ray_app.shared.catalog import AT_START, choose
    from ray_app.shared.errors import CheckpointError

    said: set = set()
    try:  # it verifies (every file read once, its config kept); the workers load the one chosen; an outage is waited out
        found = choose(uri, keep=CHOSEN_FILES.__contains__, retry_s=retry_budget(overrides), then=AT_START,
                       say=say_skipped, said=said)
    except CheckpointError as exc:
        raise UserError(str(exc)) from None
    try:
        cfg = config_from_dict(found.config, overrides)
    except ConfigError as exc:
        raise ConfigError(f"--set: {exc}") from None
    validate_before_ray(cfg)
    m = launch(cfg, {"mode": "eval", "checkpoint": found.uri, "said": sorted(said)}, f"eval-{cfg.run.name}",
               tempfile.mkdtemp(prefix="ray-app-eval-"))
    return {"checkpoint": m["checkpoint"], "global_step": m["global_step"],
            **{k: v for k, v in m.items() if k.startswith("eval_")},
            "num_samples": m["num_samples"], "world_size": cfg.scaling.num_workers}


def retry_budget(overrides: list[str]) -> float:
    """``failure.storage_retry_s`` as ``--set`` gives it, else its default: the budget of a command's own
    storage reads before it has a config (``ray-app eval`` reads the checkpoint's)."""
    from ray_app.shared.config import FailureSection

    given = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].strip() == "failure.storage_retry_s"]
    try:
        return float(given[-1]) if given else FailureSection().storage_retry_s
    except ValueError:
        raise ConfigError(f"--set failure.storage_retry_s={given[-1]}: not a number of seconds") from None

