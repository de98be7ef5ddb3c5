"""Rank 0's experiment tracking: an MLflow run and TensorBoard event files, behind the loop's ``MetricsSink``.

The loop knows nothing of either: it calls the same small sink it calls for Prometheus
(``ray_app.worker.loop.MetricsSink``), and ``rank0_sink`` fans those calls out to Prometheus and the trackers.

- ``MlflowSink``: the resolved config as params, train loss / lr / samples per second and every eval
  metric at their steps, tags, and each committed checkpoint's URI, through MLflow's own client. The
  training thread only appends to a bounded buffer; a background thread sends it in batches, retries
  while the server is unreachable (one line when it goes, one when it is back) and drops the oldest
  values beyond ``tracking.buffer``. A resumed run continues the same MLflow run: its id (and the key the
  run was created with) is checkpoint state, and a value is sent only for a step after the newest step
  the run already has for that key, so a worker-group restart never logs a step twice.
- ``TensorBoardSink``: the same scalars as event files in ``{run.storage}/{run.name}/tensorboard``
  (on S3: written locally, uploaded after each committed checkpoint; each writer's file has its own
  name, so the earlier ones stay beside it; a resumed writer purges the steps after the checkpoint, so
  the curve has each step once).
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import re
import tempfile
import threading
import time
from pathlib import Path

from ray_app.shared.errors import first_line

PROGRESS_KEYS = ("train_loss", "lr", "samples_per_second")  # what on_progress logs, under these names
OPTIONAL_PROGRESS_KEYS = ("tokens_per_second", "mfu")  # logged when the loop has them (a token task; a known peak)
IMAGE_ENV = "RAY_APP_IMAGE"  # the image a pod runs, when the manifests say (a tag on the MLflow run)
MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value
UNSENT_IN_CHECKPOINT = 10_000  # values not sent yet that a checkpoint keeps (the newest)
BATCH = 1000  # MLflow's log_batch takes at most 1000 metrics, 100 params and 100 tags


def progress_values(train_loss, lr, samples_per_second, tokens_per_second, mfu) -> list[tuple[str, float]]:
    """(name, value) of what a progress step logs: ``PROGRESS_KEYS``, and those of ``OPTIONAL_PROGRESS_KEYS`` given."""
    optional = [(k, v) for k, v in zip(OPTIONAL_PROGRESS_KEYS, (tokens_per_second, mfu)) if v is not None]
    return [*zip(PROGRESS_KEYS, (train_loss, lr, samples_per_second)), *optional]


def mlflow_uri(cfg) -> str:
    """``tracking.mlflow_uri``, else ``MLFLOW_TRACKING_URI`` from the environment; empty: MLflow is off."""
    return cfg.tracking.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI", "")


def shown_uri(uri: str) -> str:
    """The URI without user:password@, for log lines."""
    return re.sub(r"//[^/@]*@", "//", uri)


def flat_params(tree: dict, prefix: str = "") -> dict[str, str]:
    """A config tree as MLflow params: ``section.key`` -> its value (dicts of plug-in args flattened too)."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_params(value, f"{name}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            out[name] = text[:MAX_PARAM_CHARS]
    return out


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {first_line(exc)}"


class FanOutSink:
    """Rank 0's sink: every call goes to each sink in turn (Prometheus first, then the trackers)."""

    serving_port = None

    def __init__(self, sinks: list):
        self.sinks = sinks
        self.serving_port = next((s.serving_port for s in sinks if getattr(s, "serving_port", None)), None)

    def start(self, **info) -> None:
        for s in self.sinks:
            s.start(**info)

    def on_step(self, step_seconds: float) -> None:
        for s in self.sinks:
            s.on_step(step_seconds)

    def on_progress(self, **values) -> None:
        for s in self.sinks:
            s.on_progress(**values)

    def on_eval(self, values) -> None:
        for s in self.sinks:
            s.on_eval(values)

    def on_checkpoint(self, *, blocked_seconds) -> None:
        for s in self.sinks:
            s.on_checkpoint(blocked_seconds=blocked_seconds)

    def on_gpu_memory(self, *, allocated, max_allocated) -> None:
        for s in self.sinks:
            s.on_gpu_memory(allocated=allocated, max_allocated=max_allocated)

    def on_rank_pace(self, rows) -> None:
        for s in self.sinks:
            s.on_rank_pace(rows)

    def checkpoint_state(self) -> dict:
        out: dict = {}
        for s in self.sinks:
            out.update(s.checkpoint_state())
        return out

    def on_checkpoint_committed(self, uri: str, global_step: int) -> None:
        for s in self.sinks:
            committed = getattr(s, "on_checkpoint_committed", None)
            if committed is not None:
                committed(uri, global_step)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


class _TrackerBase:
    """What a tracker does not need of the sink protocol."""

    serving_port = None

    def on_step(self, step_seconds: float) -> None: ...

    def on_checkpoint(self, *, blocked_seconds) -> None: ...

    def on_gpu_memory(self, *, allocated, max_allocated) -> None: ...

    def on_rank_pace(self, rows) -> None: ...

    def checkpoint_state(self) -> dict:
        return {}

    def on_checkpoint_committed(self, uri: str, global_step: int) -> None: ...


class MlflowSink(_TrackerBase):
    """Rank 0's MLflow run, fed from a bounded buffer by a background thread (see the module's docstring).

    ``client``: an ``mlflow.MlflowClient`` (a fake in unit tests); None: MLflow's own, made on the thread.
    """

    RETRY_S = (0.5, 5.0)  # backoff while the server is unreachable: first wait, longest wait
    CLOSE_WAIT_S = 30.0  # at the end, how long the thread may take to send what is buffered (server up)

    def __init__(self, uri: str, *, experiment: str, run_name: str, params: dict[str, str], key: str,
                 buffer: int = 100_000, client=None, say=print):
        # MLflow's client retries a request for minutes by default: the buffer does the retrying here
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self.uri, self.experiment, self.run_name, self.params, self.key = uri, experiment, run_name, params, key
        self.say = say
        self.client = client
        self.run_id: str | None = None
        self.tags: dict[str, str] = {}
        self.step = 0  # the step eval values belong to (the newest step the loop reported)
        self.logged_to: dict[str, int] = {}  # key -> newest step the MLflow run has for it
        self.dropped = 0
        self.down = False
        self._items: collections.deque = collections.deque(maxlen=buffer)
        self._sending: list = []  # taken from _items by the thread, not yet confirmed by the server
        self._lock = threading.Lock()
        self._wake = threading.Event()  # set by each value put, and at close: something to send
        self._stop = threading.Event()  # set at close only: ends a wait between tries
        self._closing = False
        self._ready = False
        self._thread = threading.Thread(target=self._run, name="ray-app-mlflow", daemon=True)

    # ------------------------------------------------------------ the training thread's side (never blocks)
    def start(self, *, run, model, dataset, task, version, world_size, resumed_from_step, global_step=0,
              epoch=0, use_gpu=False, last_checkpoint_unix=0.0, tracking=None) -> None:
        resumed = tracking or {}
        self.run_id = resumed.get("mlflow_run_id") or None
        self.key = resumed.get("mlflow_key") or self.key
        self.step = global_step
        # what the checkpoint's sink had not sent yet (the rest of its steps died with it): sent first
        self._items.extend(tuple(item) for item in resumed.get("mlflow_unsent", []))
        self.tags = {"ray_app.run": run, "ray_app.world_size": str(world_size), "ray_app.version": version,
                     "ray_app.model": model, "ray_app.data": dataset, "ray_app.task": task,
                     "ray_app.resumed_from_step": str(resumed_from_step)}
        if os.environ.get(IMAGE_ENV):
            self.tags["ray_app.image"] = os.environ[IMAGE_ENV]
        self._thread.start()

    def _put(self, items: list) -> None:
        with self._lock:
            room = self._items.maxlen - len(self._items)
            self.dropped += max(0, len(items) - room)  # the deque drops the oldest itself
            self._items.extend(items)
        self._wake.set()

    def on_progress(self, *, epoch, global_step, lr, train_loss, samples, samples_per_second,
                    tokens=None, tokens_per_second=None, mfu=None) -> None:
        self.step = global_step
        ms = int(time.time() * 1000)
        self._put([("metric", k, float(v), global_step, ms)
                   for k, v in progress_values(train_loss, lr, samples_per_second, tokens_per_second, mfu)])

    def on_eval(self, values) -> None:
        ms = int(time.time() * 1000)
        self._put([("metric", f"eval_{k}", float(v), self.step, ms) for k, v in values.items()])

    def on_checkpoint_committed(self, uri: str, global_step: int) -> None:
        self._put([("tag", f"checkpoint.step_{global_step}", uri), ("tag", "ray_app.last_checkpoint", uri)])

    def checkpoint_state(self) -> dict:
        """Saved in each checkpoint, given back to ``start`` on resume: the run to continue, and the values of
        the checkpoint's steps not sent yet (a resume does not train those steps again; capped)."""
        with self._lock:
            unsent = [*self._sending, *self._items][-UNSENT_IN_CHECKPOINT:]
        return {"mlflow_run_id": self.run_id, "mlflow_key": self.key, "mlflow_unsent": unsent}

    def close(self) -> None:
        self._closing = True
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0 if self.down else self.CLOSE_WAIT_S)
        left = len(self._items) + len(self._sending)
        if left or self.dropped:
            self.say(f"WARNING: tracking: {left + self.dropped} metric values not logged to MLflow at "
                     f"{shown_uri(self.uri)} (unreachable at the end of the run or beyond tracking.buffer)")

    # ------------------------------------------------------------ the background thread
    def _run(self) -> None:
        wait = self.RETRY_S[0]
        while True:
            try:
                if not self._ready:
                    self._resolve()
                    self._ready = True
                if not self._sending:
                    self._take()
                if self._sending:
                    self._send(self._sending)
                    with self._lock:
                        self._sending = []
                self._back()
                wait = self.RETRY_S[0]
            except Exception as exc:  # the server's state must never reach training
                self._gone(exc)
                # a request that timed out may still be carried out by a server that hung: read back what the
                # run has before sending the batch again, so no step is logged twice
                self._ready = False
                if self._closing:
                    return
                # the backoff: values logged meanwhile wait in the buffer (waiting on _wake, a step's values
                # cut every wait short: a server that was down was tried again at each logged step)
                self._stop.wait(wait)
                wait = min(wait * 2, self.RETRY_S[1])
                continue
            if self._closing and not self._items:
                self._finish()
                return
            if not self._items:
                self._wake.wait(1.0)
                self._wake.clear()

    def _take(self) -> None:
        with self._lock:
            self._sending = [self._items.popleft() for _ in range(min(BATCH, len(self._items)))]

    def _gone(self, exc: BaseException) -> None:
        if not self.down:
            self.down = True
            self.say(f"WARNING: tracking: MLflow at {shown_uri(self.uri)} unreachable ({_one_line(exc)}); "
                     "buffering metrics, training continues")

    def _back(self) -> None:
        if self.down:
            self.down = False
            self.say(f"tracking: MLflow at {shown_uri(self.uri)} reachable again; buffered metrics sent")

    def _mlflow(self):
        if self.client is None:
            from mlflow import MlflowClient

            self.client = MlflowClient(tracking_uri=self.uri)
        return self.client

    def _resolve(self) -> None:
        """The MLflow run to log into: the checkpoint's, else the one made with this key (a restart before
        the first checkpoint), else a new one. Then what it already has: params, and each key's newest step."""
        client = self._mlflow()
        run = client.get_run(self.run_id) if self.run_id else None
        if run is None:
            exp = client.get_experiment_by_name(self.experiment)
            exp_id = exp.experiment_id if exp is not None else client.create_experiment(self.experiment)
            found = client.search_runs([exp_id], filter_string=f"tags.`ray_app.key` = '{self.key}'", max_results=1)
            run = found[0] if found else client.create_run(exp_id, run_name=self.run_name,
                                                           tags={"ray_app.key": self.key})
        self.run_id = run.info.run_id
        if run.info.status != "RUNNING":
            client.update_run(self.run_id, status="RUNNING")
        self.logged_to = {k: max(m.step for m in client.get_metric_history(self.run_id, k))
                          for k in run.data.metrics}
        self._log_params(run.data.params)

    def _log_params(self, existing: dict) -> None:
        from mlflow.entities import Param, RunTag

        new = [Param(k, v) for k, v in self.params.items() if k not in existing]
        changed = [RunTag(f"resumed_with.{k}", v) for k, v in self.params.items() if k in existing and existing[k] != v]
        tags = [RunTag(k, v) for k, v in self.tags.items()] + changed
        for i in range(0, max(len(new), len(tags)), 100):
            self.client.log_batch(self.run_id, params=new[i:i + 100], tags=tags[i:i + 100])

    def _send(self, items: list) -> None:
        from mlflow.entities import Metric, RunTag

        metrics, tags = [], {}
        for item in items:
            if item[0] == "tag":
                tags[item[1]] = item[2]
            elif item[3] > self.logged_to.get(item[1], -1):  # a step the run does not have yet
                metrics.append(Metric(item[1], item[2], item[4], item[3]))
        if metrics or tags:
            self.client.log_batch(self.run_id, metrics=metrics, tags=[RunTag(k, v) for k, v in tags.items()])
        for m in metrics:
            self.logged_to[m.key] = max(self.logged_to.get(m.key, -1), m.step)

    def _finish(self) -> None:
        try:
            self.client.set_terminated(self.run_id, status="FINISHED")
        except Exception as exc:
            self._gone(exc)


class TensorBoardSink(_TrackerBase):
    """Event files of the same scalars in ``{run}/tensorboard`` of the run's storage (see the module's docstring).

    ``SummaryWriter`` writes its events on its own thread; the training thread only hands them over.
    """

    def __init__(self, storage, run: str, say=print):
        self.storage, self.rel, self.say = storage, f"{run}/tensorboard", say
        self.local = hasattr(storage, "root")  # a local run folder: written in place
        self.logdir = Path(storage.uri(self.rel)) if self.local else Path(tempfile.mkdtemp(prefix="ray-app-tb-"))
        self.writer = None
        self.step = 0

    def start(self, *, global_step=0, **_info) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.step = global_step
        # a resumed run replays the steps after its checkpoint: the reader drops the earlier events of those
        self.writer = SummaryWriter(str(self.logdir), purge_step=global_step + 1 if global_step else None)

    def on_progress(self, *, epoch, global_step, lr, train_loss, samples, samples_per_second,
                    tokens=None, tokens_per_second=None, mfu=None) -> None:
        self.step = global_step
        for k, v in progress_values(train_loss, lr, samples_per_second, tokens_per_second, mfu):
            self.writer.add_scalar(k, float(v), global_step)

    def on_eval(self, values) -> None:
        for k, v in values.items():
            self.writer.add_scalar(f"eval_{k}", float(v), self.step)

    def on_checkpoint_committed(self, uri: str, global_step: int) -> None:
        self.writer.flush()
        if not self.local:
            self._upload()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            if not self.local:
                self._upload()

    def _upload(self) -> None:
        try:
            for f in sorted(self.logdir.iterdir()):
                self.storage.upload_file(str(f), f"{self.rel}/{f.name}")
        except Exception as exc:  # the next checkpoint uploads them again
            self.say(f"WARNING: tracking: TensorBoard files not uploaded to {self.storage.uri(self.rel)} "
                     f"({_one_line(exc)})")


def rank0_sink(cfg, storage, key: str, prometheus=None, say=print):
    """Rank 0's sink: Prometheus (when given) and the trackers the config turns on, behind one object."""
    sinks = [prometheus] if prometheus is not None else []
    uri = mlflow_uri(cfg)
    if uri:
        if importlib.util.find_spec("mlflow") is not None:  # imported on the sink's thread, not here
            params = flat_params(cfg.to_dict())
            params["tracking.mlflow_uri"] = shown_uri(params["tracking.mlflow_uri"])
            sinks.append(MlflowSink(uri, experiment=cfg.tracking.experiment, run_name=cfg.run.name,
                                    params=params, key=key, buffer=cfg.tracking.buffer, say=say))
        else:
            say("WARNING: tracking: MLflow is configured but not installed (pip install 'ray-app[tracking]'); "
                "training continues without it")
    if cfg.tracking.tensorboard and importlib.util.find_spec("tensorboard") is not None:
        sinks.append(TensorBoardSink(storage, cfg.run.name, say=say))
    elif cfg.tracking.tensorboard:
        say("WARNING: tracking: tracking.tensorboard is on but tensorboard is not installed "
            "(pip install 'ray-app[tracking]'); training continues without it")
    if len(sinks) == 1:
        return sinks[0]
    if not sinks:
        from ray_app.worker.metrics import NullMetrics

        return NullMetrics()
    return FanOutSink(sinks)
