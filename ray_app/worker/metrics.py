"""Rank-0 Prometheus exporter, and the null sink every other rank gets.

The train loop only calls the methods of a *metrics sink*; it never imports
prometheus_client. Each exporter uses its own ``CollectorRegistry`` so a new
worker group (after a restart) never trips over "Duplicated timeseries".
The names below are the contract: README, alert rules and the Grafana
dashboard use only these.

Evaluation: a task reports any number of metrics by name (``loss``,
``accuracy``, ``mse``, ``perplexity``, a user task's own names); each one is
the series ``ray_app_eval_metric{name="<name>"}``. ``ray_app_eval_loss`` and
``ray_app_eval_accuracy`` stay, set when the task reports ``loss`` /
``accuracy`` (NaN otherwise), so dashboards and rules written against them
keep working.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger("ray_app.worker.metrics")

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
CKPT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# name -> (type, help). Histograms and counters expose the usual suffixes.
METRICS = {
    "ray_app_info": ("gauge", "Run information (labels run, model, dataset, task, version); value is always 1."),
    "ray_app_train_loss": ("gauge", "Training loss, sample-weighted global mean over all ranks, last logging interval."),
    "ray_app_samples_processed_total": ("counter", "Training samples processed by all ranks."),
    "ray_app_samples_per_second": ("gauge", "Global training throughput over the last logging interval."),
    "ray_app_tokens_per_second": ("gauge", "Global training tokens per second over the last logging interval, "
                                  "for a task that counts tokens (causal_lm); NaN otherwise."),
    "ray_app_mfu": ("gauge", "Model FLOP utilization over the last logging interval: FLOPs per step (counted once) "
                    "x steps / seconds / the device's peak; NaN until counted and without a known peak."),
    "ray_app_step_seconds": ("histogram", "Wall time of one optimizer step on rank 0."),
    "ray_app_epoch": ("gauge", "Current epoch (0-based)."),
    "ray_app_global_step": ("gauge", "Optimizer steps taken since the run started."),
    "ray_app_learning_rate": ("gauge", "Current learning rate."),
    "ray_app_eval_metric": ("gauge", "Eval metric the task reports, by label name (loss, mse, ...): mean over the distinct eval samples of all ranks."),
    "ray_app_eval_loss": ("gauge", "Eval loss (exact, all ranks reduced): ray_app_eval_metric{name=\"loss\"}; NaN if the task reports no loss."),
    "ray_app_eval_accuracy": ("gauge", "Eval accuracy (exact, all ranks reduced): ray_app_eval_metric{name=\"accuracy\"}; NaN if the task reports none."),
    "ray_app_checkpoint_blocked_seconds": ("histogram", "Time training was blocked by writing a checkpoint."),
    "ray_app_last_checkpoint_timestamp_seconds": ("gauge", "Unix time of the last checkpoint handed to storage."),
    "ray_app_world_size": ("gauge", "Number of training workers."),
    "ray_app_resumed_from_step": ("gauge", "Global step this worker group resumed from (0 = fresh start)."),
    "ray_app_worker_group_starts_total": ("counter", "Worker-group starts in this rank-0 process (restarts show as resets plus resumed_from_step)."),
    "ray_app_goodput_ratio": ("gauge", "Share of the run's wall time in productive training, over the whole run (earlier attempts included)."),
    "ray_app_gpu_memory_allocated_bytes": ("gauge", "CUDA memory allocated by rank 0 (GPU runs only)."),
    "ray_app_gpu_memory_max_allocated_bytes": ("gauge", "Peak CUDA memory allocated by rank 0 (GPU runs only)."),
    "ray_app_rank_step_seconds": ("gauge", "Each rank's own seconds per optimizer step over the last logging interval "
                                  "(data wait, forward, backward, optimizer; time waiting for other ranks left out)."),
    "ray_app_rank_data_wait_seconds": ("gauge", "Each rank's seconds per optimizer step waiting for its next batch "
                                       "over the last logging interval."),
}

# name -> its label names (README and docs/metrics.md list them); every other metric has none.
METRIC_LABELS = {
    "ray_app_info": ("run", "model", "dataset", "task", "version"),
    "ray_app_eval_metric": ("name",),
    "ray_app_rank_step_seconds": ("rank", "host"),
    "ray_app_rank_data_wait_seconds": ("rank", "host"),
}

# The single-metric eval gauges from before tasks named their metrics: the task's
# metric name -> the gauge that repeats ray_app_eval_metric{name=...} for it.
LEGACY_EVAL_GAUGES = {"loss": "ray_app_eval_loss", "accuracy": "ray_app_eval_accuracy"}


# Discovery for the cluster of containers (docs/metrics.md): when this is set,
# rank 0 announces its endpoint in a Prometheus file_sd file in that folder.
SD_DIR_ENV = "RAY_APP_METRICS_SD_DIR"
# A run's last values (a short job's resumed step, its final loss) must not end before Prometheus reads
# them: on a clean close, an exporter someone watches (a scrape seen, or a file_sd target announced)
# keeps serving until one scrape after its last update, for at most this many seconds (0: close at once).
FINAL_SCRAPE_ENV = "RAY_APP_METRICS_FINAL_SCRAPE_S"
FINAL_SCRAPE_S = 20.0  # Prometheus' default scrape interval is 15 s; file_sd refreshes every 5 s
# The host Prometheus should scrape (default: the bound address, or this host's IP address).
ADVERTISE_HOST_ENV = "RAY_APP_METRICS_HOST"
# The address the exporter binds: all interfaces unless set. A local run (the kit starts Ray itself)
# sets 127.0.0.1 before Ray starts, and its workers inherit it (ray_app.driver.launcher.local_bind_env);
# on a cluster it is read from the worker's own environment (the container's, the pod's).
BIND_ENV = "RAY_APP_METRICS_BIND"
ALL_INTERFACES = ("", "0.0.0.0", "::")


def bind_address() -> str:
    """$RAY_APP_METRICS_BIND, else 0.0.0.0: Prometheus on another host scrapes rank 0."""
    return os.environ.get(BIND_ENV, "").strip() or "0.0.0.0"


def advertised_host(bind: str = "0.0.0.0") -> str:
    """$RAY_APP_METRICS_HOST, else the address bound when it is one address (127.0.0.1 on a local run),
    else the IP this host name resolves to (a container's own IP)."""
    host = os.environ.get(ADVERTISE_HOST_ENV, "").strip()
    if host:
        return host
    if bind not in ALL_INTERFACES:
        return bind
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.gethostname()


class FileSDTarget:
    """One Prometheus file_sd file, ``ray-app-<run>.json``, naming this exporter.

    Written atomically once the port is bound (a restarted worker group's new
    rank 0 overwrites it) and deleted on a clean close, so Prometheus scrapes
    exactly the current rank 0 and never lists idle workers as down targets.
    """

    def __init__(self, directory: str, run: str, address: str):
        self.path = Path(directory) / f"ray-app-{run}.json"
        self.content = json.dumps([{"targets": [address], "labels": {}}])

    def write(self) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(self.content)
        os.chmod(tmp, 0o644)  # Prometheus runs as another user
        os.replace(tmp, self.path)  # atomic: Prometheus never reads a half-written file

    def remove(self) -> None:
        """Delete the file unless a newer rank 0 has already replaced it."""
        try:
            if self.path.read_text() == self.content:
                self.path.unlink()
        except OSError:
            pass


class NullMetrics:
    """What non-zero ranks (and runs with metrics.enabled=false) get."""

    serving_port = None

    # The same signatures as PrometheusMetrics (a unit test compares them), so a
    # call the exporter would reject fails on every rank, not only on rank 0.
    def start(self, *, run, model, dataset, task, version, world_size, resumed_from_step, global_step=0, epoch=0,
              use_gpu=False, last_checkpoint_unix=0.0, tracking=None) -> None: ...
    def on_step(self, step_seconds: float) -> None: ...
    def on_progress(self, *, epoch, global_step, lr, train_loss, samples, samples_per_second,
                    tokens=None, tokens_per_second=None, mfu=None) -> None: ...
    def on_eval(self, values: Mapping[str, float]) -> None: ...
    def on_checkpoint(self, *, blocked_seconds) -> None: ...
    def on_gpu_memory(self, *, allocated, max_allocated) -> None: ...
    def on_goodput(self, ratio: float) -> None: ...
    def on_rank_pace(self, rows) -> None: ...
    def checkpoint_state(self) -> dict:
        return {}
    def close(self) -> None: ...


class PrometheusMetrics(NullMetrics):
    """prometheus-client exporter served by rank 0 on ``port``, bound to ``bind`` (default: ``bind_address()``)."""

    def __init__(self, port: int, bind: str | None = None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        class ScrapedRegistry(CollectorRegistry):
            """Notes when a scrape has read every series."""

            scraped_at: float | None = None

            def collect(self):
                yield from super().collect()
                self.scraped_at = time.monotonic()

        self.port, self.bind = port, bind or bind_address()
        self.registry = reg = ScrapedRegistry(auto_describe=True)
        self.updated_at = time.monotonic()
        self._server = self._thread = self._sd_target = None
        self.serving_port = None
        h = {k: v[1] for k, v in METRICS.items()}
        g = lambda name, labels=(): Gauge(name, h[name], labels, registry=reg)  # noqa: E731
        self.info = g("ray_app_info", METRIC_LABELS["ray_app_info"])
        self.train_loss = g("ray_app_train_loss")
        self.samples = Counter("ray_app_samples_processed", h["ray_app_samples_processed_total"], registry=reg)
        self.samples_per_second = g("ray_app_samples_per_second")
        # NaN (a gap in Grafana, never a fake 0) for a task that counts no tokens, and until MFU is known
        self.tokens_per_second = g("ray_app_tokens_per_second")
        self.mfu = g("ray_app_mfu")
        self.tokens_per_second.set(float("nan"))
        self.mfu.set(float("nan"))
        self.step_seconds = Histogram("ray_app_step_seconds", h["ray_app_step_seconds"], buckets=STEP_BUCKETS, registry=reg)
        self.epoch = g("ray_app_epoch")
        self.global_step = g("ray_app_global_step")
        self.lr = g("ray_app_learning_rate")
        # One series per metric name the task reports; none before this worker group's first eval.
        self.eval_metric = g("ray_app_eval_metric", METRIC_LABELS["ray_app_eval_metric"])
        # NaN until the first eval (and for good if the task reports no such metric):
        # dashboards show a gap, not a fake 0% accuracy.
        self.legacy_eval = {name: g(gauge) for name, gauge in LEGACY_EVAL_GAUGES.items()}
        for gauge in self.legacy_eval.values():
            gauge.set(float("nan"))
        self.ckpt_blocked = Histogram(
            "ray_app_checkpoint_blocked_seconds", h["ray_app_checkpoint_blocked_seconds"], buckets=CKPT_BUCKETS, registry=reg
        )
        self.last_ckpt = g("ray_app_last_checkpoint_timestamp_seconds")
        self.world_size = g("ray_app_world_size")
        self.resumed_from = g("ray_app_resumed_from_step")
        self.group_starts = Counter("ray_app_worker_group_starts", h["ray_app_worker_group_starts_total"], registry=reg)
        self.goodput = g("ray_app_goodput_ratio")
        self.gpu_alloc = g("ray_app_gpu_memory_allocated_bytes")
        self.gpu_max = g("ray_app_gpu_memory_max_allocated_bytes")
        # one series per rank of this worker group (a restarted group's rank 0 has a registry of its own)
        self.rank_step = g("ray_app_rank_step_seconds", METRIC_LABELS["ray_app_rank_step_seconds"])
        self.rank_data_wait = g("ray_app_rank_data_wait_seconds", METRIC_LABELS["ray_app_rank_data_wait_seconds"])

    def start(self, *, run, model, dataset, task, version, world_size, resumed_from_step, global_step=0, epoch=0,
              use_gpu=False, last_checkpoint_unix=0.0, tracking=None) -> None:
        # model / dataset / task are config names or import paths ("acme.model:Net"): any string is a label value.
        self.info.labels(run=run, model=model, dataset=dataset, task=task, version=version).set(1)
        if last_checkpoint_unix:  # after a resume, checkpoint age counts from the checkpoint resumed from
            self.last_ckpt.set(last_checkpoint_unix)
        self.world_size.set(world_size)
        self.resumed_from.set(resumed_from_step)
        self.global_step.set(global_step)
        self.epoch.set(epoch)
        self.group_starts.inc()
        self.updated_at = time.monotonic()
        if not use_gpu:  # GPU gauges only appear on GPU runs
            self.registry.unregister(self.gpu_alloc)
            self.registry.unregister(self.gpu_max)
        self._serve()
        if self.serving_port is not None:
            self._announce(run)  # compose: a file_sd target naming only rank 0
            from ray_app.worker.podlabel import label_own_pod_as_metrics_target

            label_own_pod_as_metrics_target()  # Kubernetes: the PodMonitor selects this pod (no-op elsewhere)

    def _serve(self, attempts: int = 50, delay: float = 0.2) -> None:
        """Bind the port; a just-killed predecessor may hold it for a moment."""
        from prometheus_client import start_http_server

        for i in range(attempts):
            try:
                self._server, self._thread = start_http_server(self.port, addr=self.bind, registry=self.registry)
                self.serving_port = self.port
                log.info("metrics served on %s:%d/metrics (bound to %s)", socket.gethostname(), self.port, self.bind)
                return
            except OSError as exc:
                if i == attempts - 1:
                    log.warning("metrics port %d unavailable (%s); training continues without metrics", self.port, exc)
                    return
                time.sleep(delay)

    def _announce(self, run: str) -> None:
        """Write the file_sd target when $RAY_APP_METRICS_SD_DIR is set (compose path)."""
        directory = os.environ.get(SD_DIR_ENV, "").strip()
        if not directory or self.serving_port is None:
            return
        host = advertised_host(self.bind)
        address = f"[{host}]:{self.serving_port}" if ":" in host else f"{host}:{self.serving_port}"  # IPv6: [::1]:9500
        target = FileSDTarget(directory, run, address)
        try:
            target.write()
            self._sd_target = target
            log.info("metrics target announced in %s", target.path)
        except OSError as exc:
            log.warning("cannot write the Prometheus target file in %s (%s); metrics are served but not announced", directory, exc)

    def on_step(self, step_seconds: float) -> None:
        self.step_seconds.observe(step_seconds)

    def on_progress(self, *, epoch, global_step, lr, train_loss, samples, samples_per_second,
                    tokens=None, tokens_per_second=None, mfu=None) -> None:
        self.epoch.set(epoch)
        self.global_step.set(global_step)
        self.lr.set(lr)
        self.train_loss.set(train_loss)
        self.samples.inc(samples)
        self.samples_per_second.set(samples_per_second)
        if tokens_per_second is not None:
            self.tokens_per_second.set(tokens_per_second)
        if mfu is not None:
            self.mfu.set(mfu)
        self.updated_at = time.monotonic()

    def on_eval(self, values: Mapping[str, float]) -> None:
        """``values``: {metric name: mean over the distinct eval samples}, names without the ``eval_`` prefix."""
        for name, value in values.items():
            value = float(value)
            self.eval_metric.labels(name=name).set(value)
            if name in self.legacy_eval:
                self.legacy_eval[name].set(value)
        self.updated_at = time.monotonic()

    def on_checkpoint(self, *, blocked_seconds) -> None:
        self.ckpt_blocked.observe(blocked_seconds)
        self.last_ckpt.set(time.time())
        self.updated_at = time.monotonic()

    def on_gpu_memory(self, *, allocated, max_allocated) -> None:
        self.gpu_alloc.set(allocated)
        self.gpu_max.set(max_allocated)

    def on_goodput(self, ratio: float) -> None:
        """The run's goodput so far (``ray_app.shared.journal.account``), set by rank 0's journal."""
        self.goodput.set(ratio)
        self.updated_at = time.monotonic()

    def on_rank_pace(self, rows) -> None:
        """``rows``: every rank's ``ray_app.worker.pace.RankPace`` over the last logging interval."""
        for p in rows:
            labels = {"rank": str(p.rank), "host": p.host}
            self.rank_step.labels(**labels).set(p.step_seconds)
            self.rank_data_wait.labels(**labels).set(p.data_wait_seconds)
        self.updated_at = time.monotonic()

    def final_scrape(self) -> bool:
        """Wait, if someone watches this exporter, until a scrape read the last update (at most
        $RAY_APP_METRICS_FINAL_SCRAPE_S, default FINAL_SCRAPE_S); whether that scrape came."""
        if self._server is None or (self.registry.scraped_at is None and self._sd_target is None):
            return False  # nobody scrapes: nothing to wait for
        try:
            window = float(os.environ.get(FINAL_SCRAPE_ENV, FINAL_SCRAPE_S))
        except ValueError:
            window = FINAL_SCRAPE_S
        deadline = time.monotonic() + window
        while (self.registry.scraped_at or 0) <= self.updated_at:
            if time.monotonic() >= deadline:
                log.info("metrics: no scrape within %.0f s of the last update; closing", window)
                return False
            time.sleep(0.1)
        return True

    def close(self) -> None:
        self.final_scrape()
        if self._sd_target is not None:
            self._sd_target.remove()
            self._sd_target = None
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
            self.serving_port = None
