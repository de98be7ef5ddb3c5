"""The sweep's space file (``ray_app.driver.sweep_space``), its trials' values, its record, the scheduler's replay,
MLflow's parent and child runs: no Ray cluster.

What a user notices: a bad space exits 2 with one line naming the key before anything starts; the same
space and seed give the same trials; the table and the best trial come from the record.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from ray_app.driver import sweep, sweep_space
from ray_app.shared.config import Config, load_config
from ray_app.shared.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
LOCAL_YAML = str(REPO / "configs" / "local.yaml")
EXAMPLE = REPO / "configs" / "sweeps" / "digits.yaml"


def space_of(text: str, cfg: Config | None = None) -> sweep_space.Space:
    return sweep_space.parse_space(yaml.safe_load(text), cfg or Config(), "space.yaml")


def test_the_example_space_parses_and_every_trial_validates(tmp_path):
    cfg = load_config(LOCAL_YAML, [f"run.storage={tmp_path}", "run.name=s"])
    space = sweep_space.load_space(str(EXAMPLE), cfg)
    assert (space.metric, space.mode, space.trials, space.concurrent, space.scheduler) == \
        ("eval_accuracy", "max", 8, 2, "asha")
    configs = sweep_space.check_trials(space, cfg, sweep.sweep_uri(cfg))
    assert [c.run.name for c in configs] == [f"trial-{i:03d}" for i in range(8)]
    assert {c.run.storage for c in configs} == {str(tmp_path / "s")}
    assert [c.metrics.port for c in configs] == [cfg.metrics.port + i for i in range(8)]  # no two trials share one


def test_trials_are_drawn_from_the_seed_alone_and_cover_the_grid_in_turn():
    space = space_of("""
metric: eval_accuracy
trials: 6
space:
  train.lr: {loguniform: [1.0e-4, 0.1]}
  data.batch_size: {grid: [16, 32, 64]}
  model.args.width: {choice: [8, 16]}
  train.epochs: {randint: [1, 3]}
""")
    first, again, other = sweep_space.draw_trials(space, 0), sweep_space.draw_trials(space, 0), sweep_space.draw_trials(space, 1)
    assert first == again and first != other
    assert [t["data.batch_size"] for t in first] == [16, 32, 64, 16, 32, 64]
    assert all(1e-4 <= t["train.lr"] <= 0.1 and t["model.args.width"] in (8, 16) and 1 <= t["train.epochs"] <= 3
               for t in first)
    assert list(first[0]) == ["train.lr", "data.batch_size", "model.args.width", "train.epochs"]


@pytest.mark.parametrize("text, words", [
    ("metric: eval_accuracy\nspace: {train.lrr: {uniform: [0.1, 0.2]}}", "space key train.lrr: unknown config key"),
    ("metric: eval_accuracy\nspace: {bogus.lr: {uniform: [0.1, 0.2]}}", "unknown config section 'bogus'"),
    ("metric: eval_accuracy\nspace: {train.epochs: {loguniform: [1.0e-4, 0.1]}}",
     "loguniform draws numbers with fractions, but train.epochs is an integer"),
    ("metric: eval_accuracy\nspace: {train.lr: {choice: [fast, slow]}}", "train.lr: choice value 'fast'"),
    ("metric: eval_accuracy\nspace: {train.compile: {uniform: [0, 1]}}", "train.compile is true or false"),
    ("metric: eval_accuracy\nspace: {train.lr: {uniform: [-1, 0.1]}}", "below the minimum"),
    ("metric: eval_accuracy\nspace: {train.optimizer: {grid: [sgd, rmsprop]}}", "'rmsprop' is not allowed"),
    ("metric: eval_accuracy\nspace: {train.lr: {loguniform: [0, 0.1]}}", "loguniform needs low > 0"),
    ("metric: eval_accuracy\nspace: {train.lr: {uniform: [0.2, 0.1]}}", "low < high"),
    ("metric: eval_accuracy\nspace: {train.lr: {normal: [0, 1]}}", "expected one domain"),
    ("metric: eval_accuracy\nspace: {train.lr: 0.1}", "expected one domain"),
    ("metric: eval_accuracy\nspace: {train.lr.x: {choice: [1]}}", "train.lr is not a mapping of arguments"),
    ("metric: eval_accuracy\nspace: {run.name: {choice: [a, b]}}", "the sweep sets it for each trial"),
    ("metric: eval_accuracy\nspace: {data.batch_size: {grid: [16, 16]}}", "lists a value twice"),
    ("metric: eval_accuracy\ntrials: 1\nspace: {data.batch_size: {grid: [16, 32]}}", "fewer than the 2 grid points"),
    ("metric: accuracy\nspace: {train.lr: {uniform: [0.1, 0.2]}}", "not an eval metric"),
    ("metric: eval_accuracy\nmode: maximum\nspace: {train.lr: {uniform: [0.1, 0.2]}}", "use max or min"),
    ("metric: eval_accuracy\nscheduler: hyperband\nspace: {train.lr: {uniform: [0.1, 0.2]}}", "use asha"),
    ("metric: eval_accuracy\nconcurrent: 0\nspace: {train.lr: {uniform: [0.1, 0.2]}}", "concurrent"),
    ("metric: eval_accuracy\ntrails: 3\nspace: {train.lr: {uniform: [0.1, 0.2]}}", "trails: unknown key"),
])
def test_a_bad_space_is_one_config_error_naming_the_key(text, words):
    with pytest.raises(ConfigError) as info:
        space_of(text)
    assert words in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("task, metric, ok", [("classification", "eval_accuracy", True),
                                              ("classification", "eval_mse", False),
                                              ("regression", "eval_mae", True),
                                              ("language_model", "eval_perplexity", True),
                                              ("language_model", "eval_accuracy", False)])
def test_the_metric_is_checked_against_the_task(task, metric, ok):
    cfg = Config()
    cfg.task.name = task
    space = space_of(f"metric: {metric}\nspace: {{train.lr: {{uniform: [0.1, 0.2]}}}}")
    if ok:
        sweep_space.check_metric(space, cfg)
    else:
        with pytest.raises(ConfigError, match=f"task {task} reports .*not {metric}"):
            sweep_space.check_metric(space, cfg)


def test_the_builtin_tasks_report_the_metrics_the_sweep_knows_without_torch():
    import torch

    from ray_app.shared.plugins import resolve

    batches = {"classification": (torch.randn(4, 3), torch.tensor([0, 1, 2, 0])),
               "regression": (torch.randn(4, 2), torch.randn(4, 2)),
               "language_model": (torch.randn(4, 5, 7), torch.randint(0, 7, (4, 5))),
               "causal_lm": (torch.randn(4, 5, 7), torch.randint(0, 7, (4, 5)))}
    for task_name, names in sweep_space.BUILTIN_TASK_METRICS.items():
        task = resolve("task", task_name)()
        x, y = batches[task_name]
        values = task.evaluate(lambda inp, x=x: x, (x, y))
        means = {k: float(v.mean()) for k, v in values.items()}
        reported = set(values) | set(getattr(task, "summarize", lambda m: {})(means))
        assert reported == set(names), task_name


def test_model_args_of_a_plugin_are_checked_against_its_signature(tmp_path):
    cfg = load_config(LOCAL_YAML, [f"run.storage={tmp_path}"])
    space = space_of("metric: eval_accuracy\nspace: {model.args.widht: {choice: [8, 16]}}", cfg)
    with pytest.raises(ConfigError, match="trial-000: config key model.args.widht: .* takes no argument 'widht'"):
        sweep_space.check_trials(space, cfg, sweep.sweep_uri(cfg))


def test_a_bad_space_exits_2_with_one_line_within_2_seconds(run_cli, tmp_path):
    bad = tmp_path / "space.yaml"
    bad.write_text("metric: eval_accuracy\nspace: {train.epochs: {loguniform: [1.0e-4, 0.1]}}\n")
    t0 = time.monotonic()
    rc, out, err = run_cli(["sweep", "--config", LOCAL_YAML, "--space", str(bad), "--set", f"run.storage={tmp_path}"],
                           cwd=tmp_path, timeout=60)
    took = time.monotonic() - t0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "space key train.epochs" in lines[0] and "Traceback" not in err, err
    assert took < 2.0, took
    assert sorted(p.name for p in tmp_path.iterdir()) == ["space.yaml"]  # nothing written


def test_sweep_show_of_a_folder_without_a_sweep_exits_2(run_cli, tmp_path):
    rc, out, err = run_cli(["sweep", "show", str(tmp_path / "nope")], cwd=tmp_path, timeout=60)
    assert rc == 2 and "no sweep there" in err and "Traceback" not in err, err
    rc, out, err = run_cli(["sweep"], cwd=tmp_path, timeout=60)
    assert rc == 2 and "--space SPACE is missing" in err, err


# ---------------------------------------------------------------- the record

class FakeTrial:
    def __init__(self, index: int):
        self.config = {"trial": index}
        self.trial_id = f"t{index}"


@pytest.fixture
def recorded(tmp_path):
    from ray_app.shared.storage import LocalStorage

    cfg = load_config(LOCAL_YAML, [f"run.storage={tmp_path}", "run.name=s"])
    space = space_of("metric: eval_accuracy\ntrials: 3\nspace: {train.lr: {grid: [0.01, 0.02, 0.03]}}", cfg)
    configs = sweep_space.check_trials(space, cfg, sweep.sweep_uri(cfg))
    storage = LocalStorage(str(tmp_path))
    record = sweep.new_record("s", storage.uri("s"), space, cfg, configs)
    return sweep.Recorder(storage, "s", record, "eval_accuracy", say=lambda m: None), storage


def test_the_recorder_tells_finished_stopped_and_failed_trials_apart(recorded):
    recorder, storage = recorded
    for i in range(3):
        recorder.on_trial_start(FakeTrial(i))
    ckpt = "/runs/s/trial-000/ckpt-1"
    recorder.on_trial_result(FakeTrial(0), {"epoch": 1, "global_step": 10, "eval_accuracy": 0.5, "checkpoint": ckpt})
    recorder.on_trial_result(FakeTrial(0), {"epoch": 2, "global_step": 20, "eval_accuracy": 0.9, "checkpoint": ckpt + "2"})
    recorder.on_trial_result(FakeTrial(0), {"epoch": 2, "global_step": 20, "eval_accuracy": 0.9,
                                            "checkpoint": ckpt + "2", "sweep_finished": True})
    recorder.on_trial_result(FakeTrial(1), {"epoch": 1, "global_step": 10, "eval_accuracy": 0.3,
                                            "checkpoint": "/runs/s/trial-001/ckpt-1", "done": True})
    recorder.on_trial_result(FakeTrial(2), {"sweep_error": "training failed: diverged", "sweep_exit": 1})
    recorder.on_trial_error(FakeTrial(2))
    record = sweep.read_record(storage, "s")  # what was written, not the object in memory
    assert [t["state"] for t in record["trials"]] == ["finished", "stopped", "failed"]
    assert record["trials"][0]["history"] == [[1, 10, 0.5], [2, 20, 0.9]]
    assert record["trials"][2]["error"] == "training failed: diverged" and record["trials"][2]["exit"] == 1
    summary = sweep.summary_of(record)
    assert summary["best"]["trial"] == "trial-000" and summary["best"]["eval_accuracy"] == 0.9
    assert summary["best"]["checkpoint"] == ckpt + "2" and summary["best"]["params"] == {"train.lr": 0.01}
    assert yaml.safe_load(summary["best"]["config_yaml"])["train"]["lr"] == 0.01
    assert summary["counts"] == {"pending": 0, "running": 0, "finished": 1, "stopped": 1, "failed": 1}
    table = sweep.table_of(record).splitlines()
    assert table[0].split() == ["trial", "train.lr", "eval_accuracy", "state", "epochs", "steps"]
    assert table[2].split() == ["trial-001", "0.02", "0.3000", "stopped", "1", "10"]
    assert sweep.exit_code_of(record) == 0


def test_the_scheduler_replayed_from_the_record_stops_what_it_would_have(recorded):
    from ray.tune.schedulers import ASHAScheduler, TrialScheduler

    recorder, _ = recorded
    good, bad = recorder.record["trials"][0], recorder.record["trials"][1]
    good["history"], bad["history"] = [[1, 10, 0.9], [2, 20, 0.95]], [[1, 10, 0.8], [2, 20, 0.85]]
    space = sweep_space.Space("eval_accuracy", "max", 3, 1, "asha", 1, 2.0)
    configs = [Config() for _ in range(3)]
    asha = sweep._scheduler_of(space, configs, recorder.record)
    assert isinstance(asha, ASHAScheduler)
    newcomer = FakeTrial(2)
    asha.on_trial_add(None, newcomer)
    # below the rung's cutoff (the median of 0.9 and 0.8) at epoch 1: stopped, as an uninterrupted sweep would
    assert asha.on_trial_result(None, newcomer, {"epoch": 1, "eval_accuracy": 0.7}) == TrialScheduler.STOP
    fresh = sweep._scheduler_of(space, configs, {"metric": "eval_accuracy", "trials": []})
    fresh.on_trial_add(None, newcomer)
    assert fresh.on_trial_result(None, newcomer, {"epoch": 1, "eval_accuracy": 0.7}) == TrialScheduler.CONTINUE


# ---------------------------------------------------------------- MLflow: a parent run per sweep, a child per trial

def test_each_trial_logs_into_a_child_of_the_sweeps_mlflow_run():
    from ray_app.worker.tracking import MlflowSink
    from tests.unit.test_tracking import FakeMlflowClient

    class Client(FakeMlflowClient):
        def search_runs(self, experiment_ids, filter_string="", **kw):
            tag, value = filter_string.split("`")[1], filter_string.split("'")[1]
            return [self.get_run(rid) for rid, r in self.runs.items()
                    if r["exp"] in experiment_ids and r["tags"].get(tag) == value][:kw.get("max_results", 1000)]

        def log_param(self, run_id, key, value):
            self.runs[run_id]["params"][key] = value

        def log_metric(self, run_id, key, value, timestamp=None, step=None):
            self.runs[run_id]["metrics"].setdefault(key, []).append((step or 0, value))

        def set_tag(self, run_id, key, value):
            self.runs[run_id]["tags"][key] = value

    client = Client()
    cfg = Config()
    cfg.run.name, cfg.tracking.mlflow_uri = "s", "http://127.0.0.1:1"
    space = space_of("metric: eval_accuracy\ntrials: 2\nspace: {train.lr: {grid: [0.01, 0.02]}}", cfg)
    parent = sweep.mlflow_parent(cfg, space, "sweep-k", client=client)
    assert sweep.mlflow_parent(cfg, space, "sweep-k", client=client) == parent  # a resume finds it again
    assert client.runs[parent]["params"]["space.train.lr"] == '{"grid": [0.01, 0.02]}'
    sweep.mlflow_child(cfg, parent, "sweep-k-trial-000", "s/trial-000", client=client)
    sweep.mlflow_child(cfg, parent, "sweep-k-trial-000", "s/trial-000", client=client)
    children = [rid for rid, r in client.runs.items() if r["tags"].get("mlflow.parentRunId") == parent]
    assert len(children) == 1 and client.runs[children[0]]["name"] == "s/trial-000"
    # rank 0's tracker of that trial finds the child by its key and logs there
    sink = MlflowSink("http://127.0.0.1:1", experiment=cfg.tracking.experiment, run_name="trial-000", params={},
                      key="sweep-k-trial-000", client=client, say=lambda m: None)
    sink._resolve()
    assert sink.run_id == children[0]
    summary = {"metric": "eval_accuracy", "counts": {"finished": 2},
               "best": {"trial": "trial-000", "eval_accuracy": 0.9, "checkpoint": "/c"}}
    sweep.mlflow_close(cfg, parent, summary, client=client)
    assert client.runs[parent]["tags"]["ray_app.best_trial"] == "trial-000"
    assert client.runs[parent]["metrics"]["best_eval_accuracy"] == [(0, 0.9)]
    assert client.runs[parent]["status"] == "FINISHED"


def test_a_sweep_held_by_another_driver_exits_2_naming_it_before_ray_starts(run_cli, tmp_path):
    from ray_app.shared.lease import held_run
    from ray_app.shared.storage import LocalStorage

    space = tmp_path / "space.yaml"
    space.write_text("metric: eval_accuracy\nspace: {train.lr: {uniform: [0.01, 0.1]}}\n")
    with held_run(LocalStorage(str(tmp_path / "runs")), "s", 60.0):  # another driver of the same sweep
        rc, out, err = run_cli(["sweep", "--config", LOCAL_YAML, "--space", str(space), "--set",
                                f"run.storage={tmp_path / 'runs'}", "--set", "run.name=s"], cwd=tmp_path, timeout=60)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "is held by another driver" in lines[0], err
    assert not (tmp_path / "runs" / "s" / "sweep.json").exists()
