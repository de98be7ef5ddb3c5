"""Rank 0's trackers (ray_app.worker.tracking) against a hand-written MLflow client and TensorBoard's own reader.

The fake client keeps runs in memory and can be "down" (every call raises, as an unreachable server makes
MLflow's client raise); a test checks it still takes MLflow's own parameters. The real server is in
tests/integration/test_tracking_mlflow.py.
"""

from __future__ import annotations

import json
import threading
import time
import types

import pytest

from ray_app.shared.config import load_config
from ray_app.shared.storage import LocalStorage
from ray_app.worker.tracking import FanOutSink, MlflowSink, TensorBoardSink, flat_params, rank0_sink
from tests.support.stand_ins import assert_stands_in_for

pytestmark = pytest.mark.timeout(60)


class FakeMlflowClient:
    """MLflow's client for one in-memory server; ``down = True`` makes every call fail like a refused connection."""

    def __init__(self, tracking_uri=None, registry_uri=None, workspace_store_uri=None):
        self.down = False
        self.experiments: dict[str, str] = {}
        self.runs: dict[str, dict] = {}
        self.calls = 0
        self.lock = threading.Lock()

    def _call(self):
        with self.lock:
            self.calls += 1
        if self.down:
            raise ConnectionError("Connection refused")

    def get_experiment_by_name(self, name):
        self._call()
        eid = self.experiments.get(name)
        return None if eid is None else types.SimpleNamespace(experiment_id=eid)

    def create_experiment(self, name, artifact_location=None, tags=None):
        self._call()
        self.experiments[name] = str(len(self.experiments) + 1)
        return self.experiments[name]

    def create_run(self, experiment_id, start_time=None, tags=None, run_name=None):
        self._call()
        rid = f"run{len(self.runs)}"
        self.runs[rid] = {"exp": experiment_id, "status": "RUNNING", "tags": dict(tags or {}), "params": {},
                          "metrics": {}, "name": run_name}
        return self.get_run(rid)

    def get_run(self, run_id):
        self._call()
        r = self.runs[run_id]
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id=run_id, status=r["status"]),
                                     data=types.SimpleNamespace(params=dict(r["params"]),
                                                                metrics={k: v[-1][1] for k, v in r["metrics"].items()}))

    def search_runs(self, experiment_ids, filter_string="", run_view_type=1, max_results=1000, order_by=None,
                    page_token=None):
        self._call()
        key = filter_string.split("'")[1]
        return [self.get_run(rid) for rid, r in self.runs.items()
                if r["exp"] in experiment_ids and r["tags"].get("ray_app.key") == key][:max_results]

    def update_run(self, run_id, status=None, name=None):
        self._call()
        self.runs[run_id]["status"] = status

    def get_metric_history(self, run_id, key):
        self._call()
        return [types.SimpleNamespace(key=key, step=s, value=v) for s, v in self.runs[run_id]["metrics"][key]]

    def log_batch(self, run_id, metrics=(), params=(), tags=(), synchronous=None):
        self._call()
        r = self.runs[run_id]
        for p in params:
            assert p.key not in r["params"], f"param {p.key} logged twice"
            r["params"][p.key] = p.value
        for t in tags:
            r["tags"][t.key] = t.value
        for m in metrics:
            r["metrics"].setdefault(m.key, []).append((m.step, m.value))

    def set_terminated(self, run_id, status=None, end_time=None):
        self._call()
        self.runs[run_id]["status"] = status


def test_the_fake_client_takes_mlflows_own_parameters():
    mlflow = pytest.importorskip("mlflow")
    assert_stands_in_for(FakeMlflowClient, mlflow.MlflowClient, own={"down", "experiments", "runs", "calls", "lock"})


START = dict(run="r1", model="digits_cnn", dataset="digits", task="classification", version="0.1",
             world_size=2, resumed_from_step=0)


def _sink(client, lines=None, **kw):
    kw = {"experiment": "exp", "run_name": "r1", "params": {"train.lr": "0.1"}, "key": "k1", **kw}
    sink = MlflowSink("http://user:secret@127.0.0.1:1", client=client,
                      say=(lines.append if lines is not None else print), **kw)
    sink.RETRY_S = (0.01, 0.05)
    return sink


def _progress(sink, step, loss=None):
    sink.on_progress(epoch=0, global_step=step, lr=0.1, train_loss=loss if loss is not None else 1.0 / step,
                     samples=64, samples_per_second=100.0 + step)


def _wait(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_params_metrics_tags_and_checkpoints_reach_the_run_at_their_steps():
    client = FakeMlflowClient()
    sink = _sink(client)
    sink.start(**START)
    for step in (5, 10):
        _progress(sink, step)
    sink.on_eval({"accuracy": 0.9, "loss": 0.3})
    sink.on_checkpoint_committed("s3://b/runs/r1/checkpoint_10", 10)
    sink.close()
    (run,) = client.runs.values()
    assert run["params"] == {"train.lr": "0.1"}
    assert run["metrics"]["train_loss"] == [(5, 0.2), (10, 0.1)]
    assert run["metrics"]["samples_per_second"] == [(5, 105.0), (10, 110.0)]
    assert run["metrics"]["eval_accuracy"] == [(10, 0.9)]
    assert run["tags"]["ray_app.world_size"] == "2" and run["tags"]["ray_app.model"] == "digits_cnn"
    assert run["tags"]["checkpoint.step_10"] == "s3://b/runs/r1/checkpoint_10"
    assert run["status"] == "FINISHED"
    assert sink.checkpoint_state() == {"mlflow_run_id": "run0", "mlflow_key": "k1", "mlflow_unsent": []}


def test_values_not_sent_by_a_checkpoint_are_in_its_state_and_sent_by_the_resumed_run():
    client = FakeMlflowClient()
    first = _sink(client)
    first.start(**START)
    _progress(first, 1)
    _wait(lambda: client.runs and client.runs["run0"]["metrics"])
    client.down = True
    for step in (2, 3):
        _progress(first, step)
    state = json.loads(json.dumps(first.checkpoint_state()))  # state.json: the worker then dies
    assert [i[3] for i in state["mlflow_unsent"] if i[1] == "train_loss"] == [2, 3]
    first._closing = True  # its thread gives up at its next failed try: what it holds dies with it
    first._wake.set()
    first._thread.join(10)
    assert not first._thread.is_alive()
    client.down = False
    second = _sink(client, key="another-launch")
    second.start(**dict(START, global_step=3), tracking=state)
    _progress(second, 4)
    second.close()
    assert [s for s, _ in client.runs["run0"]["metrics"]["train_loss"]] == [1, 2, 3, 4]


def test_a_down_server_never_blocks_a_step_and_says_so_once_each_way():
    client = FakeMlflowClient()
    client.down = True
    lines: list[str] = []
    sink = _sink(client, lines)
    sink.start(**START)
    t0 = time.perf_counter()
    for step in range(1, 501):
        _progress(sink, step)
    per_call = (time.perf_counter() - t0) / 500
    assert per_call < 0.002, f"{per_call * 1e3:.3f} ms per on_progress with the server down"
    _wait(lambda: client.calls > 5)  # retrying, with backoff
    assert [ln for ln in lines if "unreachable" in ln] == [lines[0]] and len(lines) == 1
    assert "secret" not in lines[0] and "127.0.0.1:1" in lines[0]
    client.down = False
    _wait(lambda: len(lines) == 2)
    sink.close()
    assert "reachable again" in lines[1]
    (run,) = client.runs.values()
    assert [s for s, _ in run["metrics"]["train_loss"]] == list(range(1, 501))


def test_a_down_server_is_tried_again_after_the_backoff_not_at_each_logged_step():
    client = FakeMlflowClient()
    client.down = True
    sink = _sink(client)
    sink.RETRY_S = (0.2, 0.2)
    sink.start(**START)
    t0, step = time.monotonic(), 0
    while time.monotonic() - t0 < 1.0:  # a step's values every 5 ms for 1 s
        step += 1
        _progress(sink, step)
        time.sleep(0.005)
    tries = client.calls
    sink.close()
    assert 1 <= tries <= 7, f"{tries} tries in 1 s with a 0.2 s backoff ({step} steps logged)"


def test_the_buffer_is_bounded_and_drops_the_oldest_and_counts_them():
    client = FakeMlflowClient()
    client.down = True
    lines: list[str] = []
    sink = _sink(client, lines, buffer=300)
    sink.start(**START)
    for step in range(1, 201):  # 3 values a step: 600 offered, 300 held
        _progress(sink, step)
    assert len(sink._items) == 300 and sink.dropped == 300
    client.down = False
    _wait(lambda: not sink._items and not sink.down)
    sink.close()
    (run,) = client.runs.values()
    assert [s for s, _ in run["metrics"]["train_loss"]] == list(range(101, 201))
    assert any("600 metric values not logged" in ln or "300 metric values not logged" in ln for ln in lines)


def test_a_resume_continues_the_run_of_its_checkpoint_and_skips_steps_it_has():
    client = FakeMlflowClient()
    first = _sink(client)
    first.start(**START)
    for step in range(1, 13):  # the checkpoint was at step 8; 9..12 were logged, then the worker died
        _progress(first, step)
    _wait(lambda: client.runs and len(client.runs["run0"]["metrics"].get("lr", [])) == 12)
    state = first.checkpoint_state()
    second = _sink(client, key="another-launch")
    second.start(**dict(START, resumed_from_step=8, global_step=8), tracking=state)
    for step in range(9, 16):
        _progress(second, step, loss=0.5)
    second.close()
    assert list(client.runs) == ["run0"]
    steps = [s for s, _ in client.runs["run0"]["metrics"]["train_loss"]]
    assert steps == list(range(1, 16))  # each step once, in order
    assert client.runs["run0"]["tags"]["ray_app.resumed_from_step"] == "8"


def test_a_restart_before_the_first_checkpoint_finds_the_run_by_its_launch_key():
    client = FakeMlflowClient()
    first = _sink(client)
    first.start(**START)
    _progress(first, 1)
    _wait(lambda: client.runs and client.runs["run0"]["metrics"])
    second = _sink(client)  # same launch key, no checkpoint state
    second.start(**START)
    _progress(second, 1)
    _progress(second, 2)
    second.close()
    assert list(client.runs) == ["run0"]
    assert [s for s, _ in client.runs["run0"]["metrics"]["train_loss"]] == [1, 2]


def test_changed_params_on_resume_become_tags_not_errors():
    client = FakeMlflowClient()
    first = _sink(client)
    first.start(**START)
    first.close()
    second = _sink(client, params={"train.lr": "0.05", "train.epochs": "4"})
    second.start(**START, tracking=first.checkpoint_state())
    second.close()
    run = client.runs["run0"]
    assert run["params"] == {"train.lr": "0.1", "train.epochs": "4"}
    assert run["tags"]["resumed_with.train.lr"] == "0.05"


def test_config_becomes_flat_params():
    cfg = load_config(None, ["model.args={'width': 8}"])
    params = flat_params(cfg.to_dict())
    assert params["train.lr"] == str(cfg.train.lr) and params["model.args.width"] == "8"
    assert params["run.name"] == cfg.run.name and params["data.args"] == "{}"


def test_the_rank0_sink_fans_out_and_is_plain_without_trackers(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config(None, [f"run.storage={tmp_path}"])
    prom = object()
    assert rank0_sink(cfg, LocalStorage(str(tmp_path)), "k", prometheus=prom) is prom
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    cfg = load_config(None, [f"run.storage={tmp_path}", "tracking.tensorboard=true", "metrics.enabled=false"])
    sink = rank0_sink(cfg, LocalStorage(str(tmp_path)), "k")
    assert isinstance(sink, FanOutSink)
    assert [type(s) for s in sink.sinks] == [MlflowSink, TensorBoardSink]


# ---------------------------------------------------------------- TensorBoard

def _scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_events_read_back_with_tensorboards_reader_after_a_resume(tmp_path):
    pytest.importorskip("tensorboard")
    storage = LocalStorage(str(tmp_path))
    first = TensorBoardSink(storage, "r1")
    first.start(**START)
    for step in range(1, 13):
        _progress(first, step)
        if step in (8, 12):
            first.on_eval({"accuracy": step / 16})
    first.on_checkpoint_committed(storage.uri("r1", "checkpoint_8"), 8)
    first.writer.flush()  # then the worker dies at step 12; the run resumes from step 8
    second = TensorBoardSink(storage, "r1")
    second.start(**dict(START, global_step=8))
    for step in range(9, 16):
        _progress(second, step, loss=0.5)
    second.close()
    got = _scalars(tmp_path / "r1" / "tensorboard")
    want = [(s, pytest.approx(1.0 / s)) for s in range(1, 9)] + [(s, 0.5) for s in range(9, 16)]
    assert got["train_loss"] == want
    assert got["eval_accuracy"] == [(8, 0.5)]  # the eval at step 12 came after the checkpoint: purged
    assert [s for s, _ in got["lr"]] == list(range(1, 16))


class RemoteStorage:
    """An object store as the TensorBoard sink sees S3 (no local root): files go up by name."""

    def __init__(self, folder):
        self._local = LocalStorage(str(folder))

    def uri(self, *parts):
        return "s3://bucket/" + "/".join(parts)

    def upload_file(self, local, rel):
        self._local.upload_file(local, rel)


def test_on_object_storage_event_files_go_up_with_each_checkpoint_and_a_resume_adds_to_one_log(tmp_path):
    pytest.importorskip("tensorboard")
    storage = RemoteStorage(tmp_path / "bucket")
    first = TensorBoardSink(storage, "r1")
    first.start(**START)
    for step in range(1, 13):
        _progress(first, step)
        if step == 8:
            first.on_checkpoint_committed("s3://bucket/r1/checkpoint_8", 8)  # uploads what is written so far
    second = TensorBoardSink(storage, "r1")  # another pod: the first one's local files are gone
    assert second.logdir != first.logdir
    second.start(**dict(START, global_step=8))
    for step in range(9, 16):
        _progress(second, step, loss=0.5)
    second.close()
    got = _scalars(tmp_path / "bucket" / "r1" / "tensorboard")
    assert [s for s, _ in got["train_loss"]] == list(range(1, 16))
    assert [v for s, v in got["train_loss"] if s > 8] == [0.5] * 7
