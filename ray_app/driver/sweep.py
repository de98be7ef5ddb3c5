"""``ray-app sweep``: many runs of the kit under Ray Tune, early stopping, resumable.

A sweep is a space file (config keys and their search domains, the metric and its mode, the number of
trials, how many run at once, a scheduler) over a run config. Each trial is one run of the kit: its own
run name (``trial-000``, ...) under the sweep's folder ``{run.storage}/{run.name}/``, the driver's own
``TorchTrainer`` (``ray_app.driver.launcher.build_trainer``), checkpoints, resume, exact eval and failure handling.

- The space (``ray_app.driver.sweep_space``, no Ray, no torch: a bad space exits 2 well before a second): checked
  against the config's own keys and types, every trial's values drawn up front from ``run.seed``, each
  trial's whole config validated as ``ray-app train`` validates one, before Ray starts.
- The record: ``{run.storage}/{run.name}/sweep.json`` (the space, every trial's values, state, metrics at
  each evaluation, newest checkpoint), written atomically through the kit's storage by the sweep's driver
  alone, which holds the sweep's lease (``ray_app.shared.lease``) as a training driver holds its run's.
  ``ray-app sweep show`` reads it and takes no lease.
- The driver (``run_sweep``): the sweep's lease, then Ray Tune's ``Tuner`` over the indices of the trials
  not done yet, ASHA (``ASHAScheduler``, epochs done as its time) or FIFO, Tune's own state in
  ``{sweep}/tune/attempt-N/``. The same command again resumes a sweep: what resumes it is the record, not
  Tune's experiment state (``Tuner.restore`` would rerun trials Tune had not yet saved as done): done trials
  are not run again, the others run again and the kit resumes each from its newest checkpoint; ASHA is
  given the recorded results first (``_replay``). A SIGTERM to the driver is Tune's Ctrl-C.
- A trial (``run_trial``, in Tune's trial actor): the kit's preflight, the run's lease, the
  ``TorchTrainer`` on a thread of its own, each of the run's reports (every epoch's exact eval) relayed to
  Tune by the trial's thread (``ReportRelay``); the scheduler stops a trial after such a report, its
  checkpoints kept.
- Ray beyond its public API, in one place each: Ray Train V2's ``WorkerGroupCallback`` and worker-group
  state, and Ray's key-value store (``placement_group_recorder``): a stopped trial's placement group.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import sys
import tempfile
import time

from ray_app.driver.sweep_space import Space, draw_trials, trial_name
from ray_app.shared import failures
from ray_app.shared.config import Config, config_from_dict
from ray_app.shared.errors import RunInterrupted, RunStopped, StorageError, TrainingFailed, UserError, first_line

RECORD = "sweep.json"
TUNE_DIR = "tune"  # Tune's experiment state, under the sweep's folder
FORMAT = 1
STATES = ("pending", "running", "finished", "stopped", "failed")  # stopped: early, by the scheduler
DONE_STATES = ("finished", "stopped", "failed")


# ---------------------------------------------------------------- the record: sweep.json

def sweep_uri(cfg: Config) -> str:
    """The sweep's folder, ``{run.storage}/{run.name}``: the trials' runs live under it."""
    from ray_app.shared.storage import open_storage

    return open_storage(cfg.run.storage).uri(cfg.run.name)


def exit_code_of(record: dict) -> int:
    """0 when some trial has a checkpoint with the metric; else the failure table's code of bad input if a trial
    failed for it, else its code of a failed training."""
    if best_trial(record) is not None:
        return failures.EXIT_OK
    failed = [t for t in record["trials"] if t["state"] == "failed"]
    first = failed[0]["error"] if failed else "no trial reported the metric"
    print(f"ray-app: error: no trial of sweep {record['uri']} has a checkpoint with {record['metric']}; "
          f"first failure: {first}", file=sys.stderr)
    bad_input, failed_training = failures.kind_at_driver(UserError), failures.kind_at_driver(TrainingFailed)
    return bad_input.exit_code if any(t.get("exit") == bad_input.exit_code for t in failed) else failed_training.exit_code


def new_record(name: str, uri: str, space: Space, base: Config, configs: list[Config]) -> dict:
    draws = draw_trials(space, base.run.seed)
    return {"format": FORMAT, "sweep": name, "uri": uri, "metric": space.metric, "mode": space.mode,
            "scheduler": space.scheduler, "concurrent": space.concurrent, "seed": base.run.seed,
            "space": space.text, "base_metrics_port": base.metrics.port, "created": time.time(), "updated": time.time(), "resumes": 0,
            "trials": [{"trial": trial_name(i), "params": draws[i], "state": "pending", "starts": 0,
                        "epoch": 0, "global_step": 0, "metric": None, "checkpoint": None, "checkpoint_metric": None,
                        "history": [], "error": None, "exit": None, "config": configs[i].to_dict()}
                       for i in range(len(configs))]}


def read_record(storage, name: str) -> dict | None:
    """The sweep's record, or None when there is none."""
    if RECORD not in storage.list_files(name):
        return None
    try:
        record = json.loads(storage.read_bytes(f"{name}/{RECORD}"))
    except ValueError:
        raise StorageError(f"{storage.uri(name, RECORD)} is not valid JSON; restore it or use another run.name") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT or not isinstance(record.get("trials"), list):
        raise StorageError(f"{storage.uri(name, RECORD)} is not a sweep record of this version; use another run.name")
    return record


def write_record(storage, name: str, record: dict) -> None:
    """Atomically: a local folder's rename, one S3 PUT."""
    record["updated"] = time.time()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(record, f, indent=1, default=str)
        tmp = f.name
    try:
        storage.upload_file(tmp, f"{name}/{RECORD}")
    finally:
        os.unlink(tmp)


def best_trial(record: dict) -> dict | None:
    """The trial whose newest checkpoint has the best metric (its checkpoint is what the sweep hands on)."""
    scored = [t for t in record["trials"] if t.get("checkpoint") and _finite(t.get("checkpoint_metric"))]
    if not scored:
        return None
    pick = max if record["mode"] == "max" else min
    return pick(scored, key=lambda t: t["checkpoint_metric"])


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def summary_of(record: dict, storage=None) -> dict:
    """The sweep's last JSON line: every trial, the best one (its values, whole config as YAML, checkpoint)."""
    import yaml

    best = best_trial(record)
    out = {"sweep": record["sweep"], "uri": record["uri"], "metric": record["metric"], "mode": record["mode"],
           "scheduler": record["scheduler"],
           "counts": {s: sum(t["state"] == s for t in record["trials"]) for s in STATES},
           "trials": [{k: t.get(k) for k in ("trial", "params", "state", "metric", "epoch", "global_step",
                                             "checkpoint", "checkpoint_metric", "starts", "error")}
                      for t in record["trials"]],
           "best": None}
    if best is not None:
        config = copy.deepcopy(best.get("config"))
        if config:  # as a config of its own: run.name and run.storage are the user's to choose
            for key in ("name", "storage"):
                config.get("run", {}).pop(key, None)
            if isinstance(record.get("base_metrics_port"), int):
                config.setdefault("metrics", {})["port"] = record["base_metrics_port"]
        out["best"] = {"trial": best["trial"], "params": best["params"], record["metric"]: best["checkpoint_metric"],
                       "checkpoint": best["checkpoint"],
                       "config_yaml": yaml.safe_dump(config, sort_keys=False) if config else None}
    return out


def table_of(record: dict) -> str:
    """The trials as a table: values, metric (at the newest checkpoint), state, epochs, steps."""
    keys = list(record["trials"][0]["params"]) if record["trials"] else []
    head = ["trial", *keys, record["metric"], "state", "epochs", "steps"]
    rows = [head]
    for t in record["trials"]:
        metric = t.get("checkpoint_metric")
        rows.append([t["trial"], *[_short(t["params"].get(k)) for k in keys],
                     f"{metric:.4f}" if _finite(metric) else "-", t["state"], str(t.get("epoch", 0)),
                     str(t.get("global_step", 0))])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= 24 else text[:21] + "..."


def show(summary: dict, record: dict, out=sys.stdout) -> None:
    """What the sweep prints at its end and ``ray-app sweep show`` prints later (the JSON line is the CLI's)."""
    print(table_of(record), file=out)
    best = summary["best"]
    if best is None:
        print(f"no trial has a checkpoint with {record['metric']} yet", file=out)
        return
    print(f"best: {best['trial']} {record['metric']} {best[record['metric']]:.6g} checkpoint {best['checkpoint']}",
          file=out)
    if best.get("config_yaml"):
        print(f"best config (ray-app train --config FILE):\n{best['config_yaml'].rstrip()}", file=out)
    out.flush()


def show_sweep(uri: str) -> tuple[dict, dict]:
    """``ray-app sweep show SWEEP_URI``: read the record (no lease); (summary, record)."""
    from ray_app.driver.launcher import retry_budget
    from ray_app.shared.catalog import AT_START, locate

    storage, name, _ = locate(uri, retry_budget([]), then=AT_START)
    record = read_record(storage, name)
    if record is None:
        raise StorageError(f"{uri}: no sweep there ({RECORD} not found); pass {{run.storage}}/{{run.name}} of a sweep")
    return summary_of(record), record


# ---------------------------------------------------------------- a trial (in Tune's trial actor)

def run_trial(tune_config: dict, plan: dict) -> None:
    """One trial: a run of the kit, its reports forwarded to Tune; the run's end reported once more with
    ``sweep_finished``, or its error with ``sweep_error`` (one line) and ``sweep_exit`` (the exit code)."""
    from ray import tune

    index = tune_config["trial"]
    os.environ.update(plan["env"])  # what the sweep's driver set for Ray Train (timeouts, binding)
    project = plan["project_dir"]
    if project and os.path.isdir(project):
        os.chdir(project)  # Tune's trial actor starts in a folder of its own
    try:
        cfg = config_from_dict(plan["configs"][index])
        final = _train_trial(cfg, plan, tracking_key=f"{plan['key']}-{trial_name(index)}")
    except Exception as exc:
        code = failures.exit_code(exc)
        if code is None:
            raise
        tune.report({"sweep_error": first_line(exc), "sweep_exit": code})
        raise
    tune.report(dict(final, sweep_finished=True))


def _train_trial(cfg: Config, plan: dict, tracking_key: str) -> dict:
    """``ray-app train``'s path for one run, in a process that did not start Ray: the preflight, the run's
    lease, the driver's ``launch`` with Tune's report relay, the driver's one line for a failure."""
    from ray_app.driver.launcher import launch, preflight_run
    from ray_app.shared.lease import held_run

    storage = preflight_run(cfg)
    storage_path, fs = storage.ray_storage()
    if plan.get("mlflow_parent"):
        mlflow_child(cfg, plan["mlflow_parent"], tracking_key, f"{plan['name']}/{cfg.run.name}")
    # each trial's run has one writer, as a run does; its workers commit only while this lease holds
    with held_run(storage, cfg.run.name, cfg.run.lease_stale_s) as lease:
        job = {"mode": "train", "project_dir": plan["project_dir"], "tracking_key": tracking_key,
               "lease_token": lease.token}
        final = launch(cfg, job, cfg.run.name, storage_path, fs,
                       trial=Trial(plan["local_ray"], placement_group_key(plan["key"], cfg.run.name)))
    keep = ("epoch", "epochs", "global_step", "train_loss", "checkpoint", "resumed_from_step", "train_seconds")
    return {**{k: final.get(k) for k in keep}, **{k: v for k, v in final.items() if k.startswith("eval_")}}


class Trial:
    """What a trial adds to ``launch``: every report of rank 0 relayed to Tune (``ReportRelay``), each worker
    group's placement group recorded (``placement_group_recorder``), the trainer fitted on a thread of its own."""

    def __init__(self, local_ray: bool, placement_group_key: bytes):
        self.local_ray = local_ray
        self.relay = ReportRelay()
        self.recorder = placement_group_recorder(placement_group_key)

    def callbacks(self) -> list:
        return [cb for cb in (self.relay.callback(), self.recorder) if cb is not None]

    def fit(self, trainer):
        return self.relay.fit(trainer)


class ReportRelay:
    """Rank 0's reports, from Ray Train's controller to the trial's own thread, which alone hands them to Tune.

    Ray's ``TuneReportCallback`` puts them in a queue that the trial actor's main thread takes from and
    reports itself, into the one-slot queue it also takes Tune's results from; the trial's thread reports
    into that slot too (the trial's final result, and the one Tune adds when the function returns). When
    both land at once the main thread waits on a slot only it can empty, and the trial hangs for good (seen
    on 2 loaded cores with S3 storage, where a report first syncs the trial's files). Here the trainer runs
    on a thread of its own and the trial's thread reports each item as it comes, as any Tune function does."""

    POLL_S = 0.5

    def __init__(self):
        from ray.util.queue import Queue

        self.queue = Queue(actor_options={"num_cpus": 0})  # unbounded: training never waits on Tune

    def callback(self):
        from ray.train import UserCallback

        queue = self.queue

        class RelayReports(UserCallback):
            def after_report(self, run_context, metrics, checkpoint):
                item = dict(metrics[0]) if metrics else {}
                if checkpoint is not None:
                    item["checkpoint_path"] = checkpoint.path
                queue.put(item)

        return RelayReports()

    def fit(self, trainer):
        """``trainer.fit()``, each report relayed to Tune from this thread as it comes; its result, or its error."""
        import threading

        from ray import tune
        from ray.util.queue import Empty

        outcome: dict = {}

        def run() -> None:
            try:
                outcome["result"] = trainer.fit()
            except BaseException as exc:  # noqa: B036 - raised again on the trial's thread
                outcome["error"] = exc

        fitting = threading.Thread(target=run, name="ray-app-trial-fit", daemon=True)
        fitting.start()
        while True:
            done = not fitting.is_alive()  # the controller's puts are synchronous: none comes after fit returns
            try:
                item = self.queue.get(block=not done, timeout=None if done else self.POLL_S)
            except Empty:
                if done:
                    break
                continue
            tune.report(item)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]


def placement_group_key(sweep: str, trial: str) -> bytes:
    """Where a trial's worker groups' placement groups are named, in Ray's key-value store."""
    return f"ray_app:sweep-pg:{sweep}:{trial}".encode()


def placement_group_recorder(key: bytes):
    """A Ray Train callback, run in the trial's controller: the id of each worker group's placement group,
    under ``key``. The scheduler ends a trial by ending its process; the controller and the workers end with
    it, but a placement group lives as long as the job (the sweep's driver): the driver removes a stopped
    trial's (``release_placement_groups``). Ray Train V2's WorkerGroupCallback and worker-group state, as in
    Ray 2.60 (the interface ``ray_app.worker.preemption``'s callback uses too); without them nothing is recorded, and a
    stopped trial's workers' CPUs stay reserved until the sweep ends."""
    from ray_app.shared import ray_seam

    base = ray_seam.worker_group_callback_base()
    if base is None:  # without Ray Train's worker-group callbacks: nothing is recorded
        return None

    class PlacementGroupRecorder(base):
        def after_worker_group_start(self, worker_group):
            try:
                pg = ray_seam.placement_group_of(worker_group)
                seen = ray_seam.kv_get(key) or b""
                ray_seam.kv_put(key, seen + pg.id.hex().encode() + b"\n")
            except Exception:  # a Ray refactor must never stop a trial
                pass

    return PlacementGroupRecorder()


def release_placement_groups(key: bytes) -> int:
    """Remove the placement groups recorded under ``key`` (a trial that ended without its controller's own
    shut-down); how many were removed."""
    import ray
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    from ray_app.shared import ray_seam

    removed = 0
    try:
        ids = (ray_seam.kv_get(key) or b"").decode().split()
        for hex_id in ids:
            state = placement_group_table(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(hex_id)))).get("state")
            if state in ("CREATED", "PENDING", "RESCHEDULING"):
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(hex_id))))
                removed += 1
    except Exception:  # Ray going away, or its internals changed: the end of the sweep frees them
        pass
    return removed


def _release_later(key: bytes, seconds: float = 60.0, every_s: float = 2.0) -> None:
    """Once the stopped trial's process is gone (Tune ends it right after its decision), its placement groups;
    looked at for ``seconds``, in case its controller started another group meanwhile."""
    import threading

    def run():
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(every_s)
            release_placement_groups(key)

    threading.Thread(target=run, name="ray-app-sweep-pg", daemon=True).start()


# ---------------------------------------------------------------- MLflow: one parent run per sweep, a child per trial

def _mlflow_client(uri: str, client=None):
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # a server that is down costs one line, not minutes
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    if client is not None:
        return client
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _experiment_id(client, name: str) -> str:
    exp = client.get_experiment_by_name(name)
    return exp.experiment_id if exp is not None else client.create_experiment(name)


def _run_by_tag(client, exp_id: str, tag: str, value: str):
    found = client.search_runs([exp_id], filter_string=f"tags.`{tag}` = '{value}'", max_results=1)
    return found[0] if found else None


def mlflow_parent(cfg: Config, space: Space, key: str, client=None) -> str | None:
    """The sweep's parent run (made once, found again on a resume by the sweep's key); None when tracking is
    off, MLflow is not installed or the server does not answer (one line: the sweep goes on without it)."""
    import importlib.util

    from ray_app.worker.tracking import mlflow_uri

    uri = mlflow_uri(cfg)
    if not uri or (client is None and importlib.util.find_spec("mlflow") is None):
        return None
    try:
        client = _mlflow_client(uri, client)
        exp_id = _experiment_id(client, cfg.tracking.experiment)
        run = _run_by_tag(client, exp_id, "ray_app.sweep", key)
        if run is None:
            run = client.create_run(exp_id, run_name=cfg.run.name, tags={"ray_app.sweep": key, "ray_app.run": cfg.run.name})
            for name, value in {"metric": space.metric, "mode": space.mode, "trials": space.trials,
                                "concurrent": space.concurrent, "scheduler": space.scheduler,
                                **{f"space.{d.key}": json.dumps({d.kind: d.values}) for d in space.domains}}.items():
                client.log_param(run.info.run_id, name, str(value)[:6000])
        return run.info.run_id
    except Exception as exc:
        print(f"WARNING: tracking: MLflow at {uri} did not answer ({type(exc).__name__}); the sweep goes on "
              "without its parent run", file=sys.stderr, flush=True)
        return None


def mlflow_child(cfg: Config, parent: str, key: str, name: str, client=None) -> None:
    """The trial's MLflow run, made as a child of the sweep's before its workers start: rank 0's tracker finds
    it by its key (``ray_app.worker.tracking``) and logs the run into it."""
    from ray_app.worker.tracking import mlflow_uri

    try:
        client = _mlflow_client(mlflow_uri(cfg), client)
        exp_id = _experiment_id(client, cfg.tracking.experiment)
        if _run_by_tag(client, exp_id, "ray_app.key", key) is None:
            client.create_run(exp_id, run_name=name, tags={"ray_app.key": key, "mlflow.parentRunId": parent,
                                                         "ray_app.sweep_trial": name})
    except Exception as exc:  # the trial's own tracker says more when the server is down
        print(f"WARNING: tracking: could not make {name}'s MLflow run under the sweep's ({type(exc).__name__})",
              file=sys.stderr, flush=True)


def mlflow_close(cfg: Config, parent: str | None, summary: dict, client=None) -> None:
    """The sweep's end on its parent run: the best trial, its metric and checkpoint."""
    from ray_app.worker.tracking import mlflow_uri

    if not parent:
        return
    try:
        client = _mlflow_client(mlflow_uri(cfg), client)
        best = summary.get("best")
        if best:
            client.log_metric(parent, f"best_{summary['metric']}", best[summary["metric"]])
            client.set_tag(parent, "ray_app.best_trial", best["trial"])
            client.set_tag(parent, "ray_app.best_checkpoint", best["checkpoint"])
        for state, count in summary["counts"].items():
            client.log_metric(parent, f"trials_{state}", count)
        client.set_terminated(parent, "FINISHED")
    except Exception as exc:
        print(f"WARNING: tracking: could not close the sweep's MLflow run ({type(exc).__name__})", file=sys.stderr,
              flush=True)


# ---------------------------------------------------------------- the driver (Tune)

class Recorder:
    """Tune's callbacks on the sweep's driver: each trial's start, results and errors into the record."""

    def __init__(self, storage, name: str, record: dict, metric: str, say=None, on_stopped=None):
        self.storage, self.name, self.record, self.metric = storage, name, record, metric
        self.say = say or (lambda m: print(m, flush=True))
        self.on_stopped = on_stopped or (lambda trial: None)  # a trial stopped early, or failed

    def trial(self, trial) -> dict:
        return self.record["trials"][trial.config["trial"]]

    def on_trial_start(self, trial) -> None:
        t = self.trial(trial)
        t["state"], t["starts"] = "running", t.get("starts", 0) + 1
        self.save()

    def on_trial_result(self, trial, result: dict) -> None:
        t = self.trial(trial)
        if "sweep_error" in result:
            t["state"], t["error"], t["exit"] = "failed", result["sweep_error"], result.get("sweep_exit")
            self.say(f"ray-app: {t['trial']} failed: {t['error']}")
        elif result.get("sweep_finished"):
            self._take(t, result)
            t["state"], t["resumed_from_step"] = "finished", result.get("resumed_from_step")
            if self.metric not in result:
                found = sorted(k for k in result if k.startswith("eval_"))
                t["state"], t["exit"] = "failed", 2
                t["error"] = (f"space key metric: the task reports {', '.join(found) or 'no eval metric'}, not "
                              f"{self.metric}; set metric to one of them")
                self.say(f"ray-app: {t['trial']}: {t['error']}")
            else:
                self.say(f"ray-app: {t['trial']} finished: {self.metric} {result[self.metric]:.6g} "
                         f"after {t['epoch']} epochs")
        else:
            self._take(t, result)
            if result.get("done"):  # the scheduler's decision after this report: stop here
                t["state"] = "stopped"
                self.on_stopped(t["trial"])
                self.say(f"ray-app: {t['trial']} stopped early by the scheduler after epoch {t['epoch']}: "
                         f"{self.metric} {t['metric']:.6g}" if _finite(t["metric"]) else
                         f"ray-app: {t['trial']} stopped early by the scheduler after epoch {t['epoch']}")
        self.save()

    def _take(self, t: dict, result: dict) -> None:
        for key in ("epoch", "global_step"):
            if isinstance(result.get(key), int):
                t[key] = result[key]
        value = result.get(self.metric)
        if _finite(value):
            t["metric"] = value
            point = [result.get("epoch"), result.get("global_step"), value]
            if point not in t["history"]:
                t["history"].append(point)
        if result.get("checkpoint"):
            t["checkpoint"], t["checkpoint_metric"] = result["checkpoint"], value if _finite(value) else None

    def on_trial_error(self, trial) -> None:
        t = self.trial(trial)
        if t["state"] != "failed":
            t["state"], t["error"] = "failed", t.get("error") or "the trial's process failed (see Ray's logs)"
            self.say(f"ray-app: {t['trial']} failed: {t['error']}")
        self.on_stopped(t["trial"])
        self.save()

    def save(self) -> None:
        write_record(self.storage, self.name, self.record)


def _tune_callback(recorder: Recorder):
    from ray import tune

    class RecorderCallback(tune.Callback):
        def __init__(self, recorder: Recorder):
            self.recorder = recorder

        def __getstate__(self):  # Tune pickles its run config (tuner.pkl): the record's writer stays in this driver
            return {"recorder": None}

        def on_trial_start(self, iteration, trials, trial, **info):
            if self.recorder is not None:
                self.recorder.on_trial_start(trial)

        def on_trial_result(self, iteration, trials, trial, result, **info):
            if self.recorder is not None:
                self.recorder.on_trial_result(trial, result)

        def on_trial_error(self, iteration, trials, trial, **info):
            if self.recorder is not None:
                self.recorder.on_trial_error(trial)

    return RecorderCallback(recorder)


def sweep_key(uri: str) -> str:
    """A short stable name for the sweep (its trials' MLflow runs are found by it)."""
    return "sweep-" + hashlib.sha256(uri.encode()).hexdigest()[:16]


def _reconcile(record: dict, space: Space, base: Config, storage, name: str) -> None:
    """A sweep that exists resumes only with the same space and seed (its trials' values come from them)."""
    if record.get("space") != space.text or record.get("seed") != base.run.seed:
        what = "space file" if record.get("space") != space.text else f"run.seed ({record.get('seed')})"
        raise UserError(f"sweep {storage.uri(name)} was started with another {what}: its trials cannot continue "
                        "with this one; use another run.name for a new sweep, or pass the sweep's own")


def run_sweep(cfg: Config, space: Space, configs: list[Config]) -> tuple[dict, dict]:
    """Preflight, the sweep's lease, Tune; returns (summary, record)."""
    from ray_app.shared.lease import held_run
    from ray_app.shared.storage import open_storage, preflight

    storage = open_storage(cfg.run.storage, retry_s=cfg.failure.storage_retry_s)  # the preflight waits an outage out too
    preflight(storage)
    name = cfg.run.name
    if any(d.startswith("ckpt-") for d in storage.list_dirs(name)):
        raise UserError(f"run.name {name}: {storage.uri(name)} holds a training run's checkpoints; use another "
                        "run.name for the sweep")
    with held_run(storage, name, cfg.run.lease_stale_s):  # one writer per sweep, taken before Ray starts
        record = read_record(storage, name)
        if record is None:
            record = new_record(name, storage.uri(name), space, cfg, configs)
        else:
            _reconcile(record, space, cfg, storage, name)
            record["resumes"] = record.get("resumes", 0) + 1
        for t, c in zip(record["trials"], configs):
            t["config"] = c.to_dict()
            if t["state"] == "running":
                t["state"] = "pending"  # its driver is gone: it runs again, from its newest checkpoint
        write_record(storage, name, record)
        interrupted = _tune(cfg, space, configs, storage, name, record)
        write_record(storage, name, record)
    summary = summary_of(record)
    left = [t["trial"] for t in record["trials"] if t["state"] not in DONE_STATES]
    if interrupted or left:
        how = f"{sum(t['state'] in DONE_STATES for t in record['trials'])} of {len(record['trials'])} trials done"
        from ray_app.driver.launcher import resume_command

        show(summary, record, out=sys.stderr)
        if interrupted == "SIGTERM":
            raise RunStopped(f"sweep {storage.uri(name)} stopped ({how}); resume with: {resume_command()}")
        raise RunInterrupted(f"sweep {storage.uri(name)} interrupted ({how}); resume with: {resume_command()}")
    return summary, record


def _plan(configs: list[Config], key: str) -> dict:
    """What every trial needs, handed to Tune once (``tune.with_parameters``)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(("RAY_TRAIN_", "GLOO_SOCKET_IFNAME", "RAY_APP_"))}
    return {"configs": [c.to_dict() for c in configs], "project_dir": os.getcwd(),
            "local_ray": not os.environ.get("RAY_ADDRESS"), "env": env, "key": key}


def _tune(cfg: Config, space: Space, configs: list[Config], storage, name: str, record: dict) -> str | None:
    """Start (or join) Ray and run a Tuner over the trials not done yet; returns the signal that interrupted
    it, if any. What resumes a sweep is its record, not Tune's experiment state: each driver runs a Tuner
    of its own (``{sweep}/tune/attempt-N``) over the trials left, and ASHA is given the results already
    recorded (``_replay``), so its rungs are those of an uninterrupted sweep."""
    import signal

    from ray_app.driver.launcher import WorkerLogs, import_in_background, init_ray

    left = [i for i, t in enumerate(record["trials"]) if t["state"] not in DONE_STATES]
    if not left:
        return None
    imports = import_in_background("ray.tune", "torch", "ray.train.torch")
    os.environ.setdefault("TUNE_DISABLE_STRICT_METRIC_CHECKING", "1")  # a failed trial's report has no metric
    import logging

    # Tune's result grid looks for its own per-trial result files, which the kit does not write (sweep.json is it)
    logging.getLogger("ray.tune.analysis.experiment_analysis").setLevel(logging.ERROR)
    widest = max(configs, key=lambda c: c.scaling.num_workers * c.scaling.cpus_per_worker)
    init_ray(widest)
    _check_concurrency(space, widest)
    imports.join()
    import ray
    from ray import tune

    from ray_app.shared import ray_seam

    ray_seam.tune_without_credential_copies()  # no S3 keys in Ray's logs and process arguments
    if record.get("resumes"):
        print(f"ray-app: resuming sweep {storage.uri(name)}: {len(left)} of {len(record['trials'])} trials to run "
              f"({', '.join(trial_name(i) for i in left)})", flush=True)
    plan = _plan(configs, sweep_key(record["uri"]))
    plan["name"] = name
    plan["mlflow_parent"] = mlflow_parent(cfg, space, plan["key"])
    # the trial's own process reserves (almost) nothing: its workers reserve their CPUs (GPUs) themselves, in
    # Ray Train's placement group; ``concurrent`` bounds how many trials run at once
    trainable = tune.with_resources(tune.with_parameters(run_trial, plan=plan), {"CPU": 0, "memory": 1})
    sweep_storage = _sweep_storage(storage, name, cfg)
    storage_path, fs = sweep_storage.ray_storage()
    tune_path = f"{storage_path.rstrip('/')}/{TUNE_DIR}"
    callback = _tune_callback(Recorder(storage, name, record, space.metric,
                                       on_stopped=lambda trial: _release_later(placement_group_key(plan["key"], trial))))
    tuner = tune.Tuner(trainable, param_space={"trial": tune.grid_search(left)},
                       tune_config=tune.TuneConfig(num_samples=1, max_concurrent_trials=space.concurrent,
                                                   scheduler=_scheduler_of(space, configs, record)),
                       run_config=tune.RunConfig(name=f"attempt-{record.get('resumes', 0)}", storage_path=tune_path,
                                                 storage_filesystem=fs, failure_config=tune.FailureConfig(max_failures=0),
                                                 callbacks=[callback], verbose=0))
    received: list[int] = []
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):  # as Ctrl-C to Tune: it saves its state and stops the trials, then returns
        received.append(signum)
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler) and handler is not signal.default_int_handler:
            handler(signal.SIGINT, frame)
        else:
            raise KeyboardInterrupt

    logs = WorkerLogs()
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        tuner.fit()
    finally:
        signal.signal(signal.SIGTERM, previous)
        logs.drain()
        ray.shutdown()
    if any(t["state"] not in DONE_STATES for t in record["trials"]):
        return "SIGTERM" if received else "SIGINT"
    mlflow_close(cfg, plan["mlflow_parent"], summary_of(record))
    return None


def _sweep_storage(storage, name: str, cfg: Config):
    """The sweep's folder as a storage of its own (Tune's state goes under it)."""
    from ray_app.shared.storage import open_storage

    return open_storage(storage.uri(name), retry_s=cfg.failure.storage_retry_s)


def _scheduler_of(space: Space, configs: list[Config], record: dict):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    if space.scheduler == "fifo":
        return FIFOScheduler()
    # the kit reports after every epoch's eval; "epoch" is the epochs done. A trial that reaches its last epoch
    # is not stopped there (stop_last_trials=False): it ends as a run does, with its summary
    asha = ASHAScheduler(time_attr="epoch", metric=space.metric, mode=space.mode,
                         max_t=max(c.train.epochs for c in configs), grace_period=space.grace_period,
                         reduction_factor=space.reduction_factor, stop_last_trials=False)
    _replay(asha, record)
    return asha


class _Recorded:
    """A trial of an earlier driver, as the scheduler's calls see one: its id."""

    def __init__(self, trial_id: str):
        self.trial_id = trial_id


def _replay(scheduler, record: dict) -> None:
    """Give a new scheduler the results recorded before a resume (each trial's metric at each epoch), through
    the scheduler's own calls (``on_trial_add``, ``on_trial_result``, ``on_trial_remove``): its rungs hold what
    an uninterrupted sweep's would, so the trials left are judged against the same cutoffs."""
    metric = record["metric"]
    for t in record["trials"]:
        if not t.get("history"):
            continue
        trial = _Recorded(f"recorded-{t['trial']}")
        scheduler.on_trial_add(None, trial)
        for epoch, _step, value in t["history"]:
            if isinstance(epoch, int):
                scheduler.on_trial_result(None, trial, {"epoch": epoch, metric: value})
        scheduler.on_trial_remove(None, trial)


def _check_concurrency(space: Space, widest: Config) -> None:
    """``concurrent`` trials of the widest trial must fit the cluster's CPUs (GPUs): else they would wait."""
    import ray

    s = widest.scaling
    have = ray.cluster_resources()
    need_cpu = space.concurrent * (s.min_workers or s.num_workers) * s.cpus_per_worker
    if need_cpu > have.get("CPU", 0) and not s.use_gpu:
        ray.shutdown()
        raise UserError(f"space key concurrent: {space.concurrent} trials x {s.num_workers} workers x "
                        f"{s.cpus_per_worker:g} CPUs need {need_cpu:g} CPUs but the cluster has "
                        f"{have.get('CPU', 0):g}; lower concurrent or scaling.num_workers")
    if s.use_gpu and space.concurrent * (s.min_workers or s.num_workers) * s.gpus_per_worker > have.get("GPU", 0):
        ray.shutdown()
        raise UserError(f"space key concurrent: {space.concurrent} trials need more GPUs than the cluster's "
                        f"{have.get('GPU', 0):g}; lower concurrent or scaling.num_workers")


