"""The worker side of Ray: the entry point every Ray Train worker runs, for train, eval and a script.

``worker_main`` enters the user's project folder, builds the runtime (topology and Ray Train's calls,
read in one place), the checkpointer and the metrics sink the loop is given, runs the job's mode
(``train``: the loop; ``eval``: one exact evaluation of a checkpoint; ``script``: the user's own script,
``ray_app.script``), and turns an exception in the user's code into one the driver shows once.
The driver side is ``ray_app.driver.launcher``.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from ray_app.shared import failures, ray_seam
from ray_app.shared.config import Config, config_from_dict
from ray_app.shared.errors import ConfigError


class ResultSlot:
    """Where rank 0 leaves its result for the driver: one key in Ray's key-value store (the GCS), named for
    one launch. Ray Train's own ``Result.metrics`` are those of the last report with a checkpoint: stale
    after a resume that trains nothing, empty with checkpoints off or in eval. (It replaced a Ray queue
    actor: one process less to start before the first step.)"""

    def __init__(self, launch_key: str):
        self.key = f"ray_app:result:{launch_key}".encode()

    def put(self, result: dict) -> None:
        import pickle

        ray_seam.kv_put(self.key, pickle.dumps(result))

    def take(self) -> dict | None:
        """The result rank 0 left (the last one, after restarts), removed; None if there is none."""
        import pickle

        raw = ray_seam.kv_get(self.key)
        if raw is None:
            return None
        ray_seam.kv_del(self.key)
        return pickle.loads(raw)


class RayRuntime:
    """Topology and Ray Train calls, read in one place."""

    def __init__(self, storage, run: str, upload_mode: str, ddp_options: dict | None = None):
        import ray.train
        import ray.train.torch

        self._train, self._torch = ray.train, ray.train.torch
        ctx = ray.train.get_context()
        self.rank, self.world_size = ctx.get_world_rank(), ctx.get_world_size()
        self.device = ray.train.torch.get_device()
        self.node_id = ray.get_runtime_context().get_node_id()  # HSDP's mesh groups ranks by it (worker.mesh)
        self.storage, self.run = storage, run
        self.ddp_options = dict(ddp_options or {})  # train.find_unused_parameters, train.static_graph
        self.upload_mode = (ray.train.CheckpointUploadMode.ASYNC if upload_mode == "async"
                            else ray.train.CheckpointUploadMode.SYNC)

    def prepare_model(self, model, bucket_cap_mb: int = 25):
        return self._torch.prepare_model(model, parallel_strategy_kwargs={
            "bucket_cap_mb": bucket_cap_mb, "gradient_as_bucket_view": True, **self.ddp_options})

    def report(self, metrics: dict, local_dir=None, dir_name=None, upload=None) -> None:
        """Every rank calls this the same number of times (ray.train.report is a barrier). A checkpoint's
        report names the same ``dir_name`` on every rank, the writer's, though only the writer has ``local_dir``
        (Ray Train takes rank 0's name for all)."""
        from ray_app.worker.collectives import entered

        if local_dir is None:
            with entered("ray.train.report"):  # sync point: Ray Train's barrier
                self._train.report(metrics, checkpoint_dir_name=dir_name)
            return
        from ray_app.worker.checkpoint import cleanup_local

        def upload_fn(checkpoint, name):
            upload(Path(checkpoint.path), name)
            path, fs = self.storage.ray_checkpoint_location(f"{self.run}/{name}")
            return self._train.Checkpoint(path, filesystem=fs)

        with entered("ray.train.report (checkpoint)"):  # sync point: Ray Train's barrier
            self._train.report(metrics, checkpoint=self._train.Checkpoint.from_directory(str(local_dir)),
                               checkpoint_dir_name=dir_name, checkpoint_upload_mode=self.upload_mode,
                               checkpoint_upload_fn=upload_fn, delete_local_checkpoint_after_upload=True)
        if self.upload_mode == self._train.CheckpointUploadMode.SYNC:
            cleanup_local(local_dir)


def rank0_say(rank: int):
    """Rank 0's one line to the run's output (a checkpoint skipped), None on the other ranks."""
    return (lambda line: print(line, flush=True)) if rank == 0 else None


def ddp_options(cfg: Config) -> dict:
    """DDP's keyword arguments from the config (``train.find_unused_parameters``, ``train.static_graph``)."""
    return {"find_unused_parameters": cfg.train.find_unused_parameters, "static_graph": cfg.train.static_graph}


_SHOWN_BY_THE_DRIVER = ray_seam.SHOWN_BY_THE_DRIVER  # Ray Train's log of an error the driver shows itself is left out


def _worker_logging() -> None:
    ray_seam.quiet_train_loggers()
    app_log = logging.getLogger("ray_app")
    if not app_log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        app_log.addHandler(handler)
        app_log.setLevel(logging.INFO)
        app_log.propagate = False
    logging.getLogger("botocore.credentials").setLevel(logging.WARNING)  # "Found credentials ..." per worker


def enter_project(folder: str) -> None:
    """Run the user's code as from the folder ray-app started in, where this node has it (a local run, or
    a cluster whose nodes share it). Elsewhere the code comes with the job's working_dir or the image."""
    from ray_app.shared.plugins import add_project_to_path

    if folder and os.path.isdir(folder):
        os.chdir(folder)  # relative paths in the user's args mean what they mean on the user's command line
        add_project_to_path(folder)


def _train(cfg: Config, runtime: RayRuntime, stats, job: dict) -> tuple[dict, object]:
    from ray_app.worker.checkpoint import Checkpointer
    from ray_app.worker.loop import Trainer
    from ray_app.worker.metrics import NullMetrics, PrometheusMetrics
    from ray_app.worker.parts import build_parts
    from ray_app.worker.tracking import FanOutSink, rank0_sink

    checkpointer = Checkpointer(runtime.storage, cfg.run.name, runtime.report, every_epochs=cfg.checkpoint.every_epochs,
                                every_steps=cfg.checkpoint.every_steps, resume_from=cfg.run.resume_from,
                                staged=cfg.checkpoint.upload == "async", writer=cfg.checkpoint.async_writer,
                                retry_s=cfg.failure.storage_retry_s,
                                wait_s=cfg.failure.hang_timeout_s, said=job.get("said", ()),
                                warn=rank0_say(runtime.rank))
    if job.get("lease_token"):  # no commit once another driver holds the run (this one's was killed)
        from ray_app.shared.lease import fence

        checkpointer.before_commit = fence(runtime.storage, cfg.run.name, job["lease_token"])
    metrics = NullMetrics()
    hosts = gather_hosts(runtime.world_size)  # sync point: every rank, once per attempt (the journal's)
    if runtime.rank == 0:  # Prometheus, the trackers (MLflow, TensorBoard) and the run journal behind one sink
        prometheus = PrometheusMetrics(cfg.metrics.port) if cfg.metrics.enabled else None
        metrics = FanOutSink([rank0_sink(cfg, runtime.storage, job.get("tracking_key", cfg.run.name),
                                         prometheus=prometheus),
                              *journal_sink(cfg, runtime.storage, job, hosts, prometheus,
                                            started=stats.timeline.get("worker_start_unix"))])
        checkpointer.on_commit = metrics.on_checkpoint_committed
    watchdog = hang_watchdog(cfg, runtime, job)
    try:
        parts = build_parts(cfg, runtime)
        stats.mark("model_ready_unix")
        trainer = Trainer(cfg, runtime, parts, checkpointer, metrics, stats, preemption_agreement(cfg))
        return trainer.fit(), trainer
    finally:
        if watchdog is not None:
            watchdog.stop()


def hang_watchdog(cfg: Config, runtime: RayRuntime, job: dict):
    """The thread that writes this rank's hang report under ``{run}/reports/`` (``ray_app.worker.watchdog``), started
    by every rank of a group of two or more; its storage gives up soon: the report must land before the
    group is torn down."""
    import torch.distributed as dist

    from ray_app.shared.reports import margin_s
    from ray_app.shared.storage import open_storage
    from ray_app.worker.watchdog import start_watchdog

    if not job.get("launch") or not dist.is_initialized() or runtime.world_size < 2:
        return None
    budget = min(cfg.failure.storage_retry_s, margin_s(cfg.failure.hang_timeout_s) / 2)
    storage = open_storage(cfg.run.storage, retry_s=budget, then="the report is left out", budget=(
        "the hang report's: the lesser of failure.storage_retry_s and half of failure.hang_timeout_s's margin"))
    return start_watchdog(storage, cfg.run.name, job["launch"], cfg.failure.hang_timeout_s, runtime.rank,
                               runtime.world_size, attempt_key=job.get("attempt_key", "").encode() or None,
                               stale_alone=cfg.scaling.use_gpu)  # nccl: a collective returns once queued


def gather_hosts(world_size: int) -> list[str]:
    """Every rank's host name, in rank order (one ``all_gather_object``; every rank calls it)."""
    import socket

    import torch.distributed as dist

    host = socket.gethostname()
    if world_size <= 1 or not dist.is_initialized():
        return [host]
    hosts: list = [None] * world_size
    dist.all_gather_object(hosts, host)
    return [str(h) for h in hosts]


def journal_sink(cfg: Config, storage, job: dict, hosts: list[str], prometheus, started: float | None = None) -> list:
    """Rank 0's share of the run journal (``ray_app.shared.journal``): this attempt, its first step (and its
    seconds from ``started``, this worker's entry), its checkpoints, the outages it waits out; and
    ``ray_app_goodput_ratio`` on ``prometheus`` when metrics are on. None (an empty list) with the journal off."""
    import os
    import socket

    from ray_app.shared import journal

    if not journal.enabled():
        return []
    w = journal.writer(storage, cfg.run.name, source=f"rank0-{socket.gethostname()}-{os.getpid()}")
    if w is not None:
        journal.record_outages(w)
    return [journal.JournalSink(w, storage, cfg.run.name, launch=job.get("launch_id", ""), hosts=hosts,
                                goodput=prometheus, started=started)]


def preemption_agreement(cfg: Config):
    """The per-step flag of ``ray_app.worker.preemption`` on a gloo group: the default one on CPU, its own
    next to nccl (made here, by every rank)."""
    import torch.distributed as dist

    from ray_app.worker.preemption import Agreement

    enabled = cfg.failure.preemption_checkpoint and dist.is_initialized()
    group = dist.new_group(backend="gloo") if enabled and cfg.scaling.use_gpu else None
    return Agreement(group, enabled=enabled)


def _eval(cfg: Config, runtime: RayRuntime, stats, checkpoint: str, said=()) -> tuple[dict, object]:
    """Build the checkpoint's data, model and task, load its weights, evaluate exactly."""
    from ray_app.shared.errors import CheckpointError
    from ray_app.worker.checkpoint import load_uri
    from ray_app.worker.loop import Trainer
    from ray_app.worker.metrics import NullMetrics
    from ray_app.worker.parts import build_parts

    parts = build_parts(cfg, runtime)
    try:  # the driver read only the config: a damaged file is found here, and is bad input (exit 2)
        loaded = load_uri(checkpoint, rank=None, model_only=True, retry_s=cfg.failure.storage_retry_s,
                          say=rank0_say(runtime.rank), said=set(said))
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from None
    loaded.load_into(parts.model)  # consolidated (model_only): the whole state, each rank's part cut from it
    trainer = Trainer(cfg, runtime, parts, checkpointer=None, metrics=NullMetrics(), stats=stats)
    result = dict(trainer.evaluate(), checkpoint=loaded.uri, global_step=loaded.global_step)
    runtime.report(result)
    return result, trainer


def _run_mode(job: dict, cfg: Config, runtime: RayRuntime, stats) -> dict:
    if job["mode"] == "script":
        from ray_app.worker.script import run_in_worker

        return run_in_worker(job, runtime)  # the script's own errors come back as UserCodeError
    if job["mode"] == "eval":
        return _eval(cfg, runtime, stats, job["checkpoint"], job.get("said", ()))[0]
    return _train(cfg, runtime, stats, job)[0]


def _as_failure(exc: Exception, cfg: Config, rank: int, stats) -> Exception | None:
    """``exc`` as a row of the failure table (``ray_app.shared.failures.wrap``), shown once by the driver (or by the
    failure policy's restart line) and so left out of Ray Train's worker log; None: raised as it is."""
    from ray_app.shared.plugins import plugin_roots
    from ray_app.worker import preemption

    wrapped = failures.wrap(exc, rank=rank, step=stats.global_step, roots=plugin_roots(cfg),
                            leaving=preemption.NOTICE.is_set())
    if wrapped is not None:
        _SHOWN_BY_THE_DRIVER.active = True
        if getattr(wrapped, "step", None) is None:  # where it was raised, for the restart's journal event (the failure policy's)
            wrapped.step = stats.global_step
    return wrapped


def worker_main(job: dict, results=None) -> None:
    """Entry point of every Ray Train worker, for ``train``, ``eval`` and ``run`` (mode ``script``: the
    user's own script, see ``ray_app.script``). Rank 0 puts its result on ``results`` (a ``ResultSlot``).
    An exception is raised as its row of the failure table says (``ray_app.shared.failures``): the user's with
    their traceback and a fingerprint that carries the global step where it was raised."""
    from ray_app.shared.storage import open_storage
    from ray_app.worker.progress import RunStats

    stats = RunStats()
    _worker_logging()
    enter_project(job.get("project_dir", ""))
    cfg = config_from_dict(job["config"])
    storage = open_storage(cfg.run.storage, retry_s=cfg.failure.storage_retry_s)
    runtime = RayRuntime(storage, cfg.run.name, cfg.checkpoint.upload, ddp_options(cfg))
    try:
        result = _run_mode(job, cfg, runtime, stats)
    except Exception as exc:
        failure = _as_failure(exc, cfg, runtime.rank, stats)
        if failure is None or failure is exc:
            raise
        raise failure from None
    if results is not None and runtime.rank == 0:
        results.put(result)
