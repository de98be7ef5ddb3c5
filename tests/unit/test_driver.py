"""The driver and worker sides without a Ray cluster: the trainer the kit builds (callbacks it keeps and leaves out, its
failure policy), the checks before Ray starts, how a worker turns an error into one the driver shows once,
and how the driver shows it."""

from __future__ import annotations

import inspect
import sys
import textwrap
import threading
import uuid

import pytest
import torch

from ray_app.driver import launcher as driver
from ray_app.driver.launcher import (
    LEAN_DROPPED_CALLBACKS,
    build_trainer,
    lean_trainer_class,
    preflight_run,
    raise_worker_failure,
    validate_before_ray,
)
from ray_app.shared.catalog import checkpoint_dir_name
from ray_app.shared.config import load_config
from ray_app.shared.errors import ConfigError, PluginError, TrainingFailed, UserCodeError, UserError
from ray_app.worker import entry as worker_side
from ray_app.worker.entry import worker_main
from tests.support.checkpoints import write_checkpoint
from tests.support.stand_ins import assert_stands_in_for
from tests.support.worker import worker_without_ray


def _callback_names(trainer) -> set[str]:
    return {type(cb).__name__ for cb in trainer._create_default_callbacks()}


def _trainer(cfg, job=None, results=None, run_name="r", storage_path="/tmp/x"):
    return build_trainer(cfg, job or {"mode": "train", "config": cfg.to_dict()}, results, run_name, storage_path)


def test_kit_trainer_leaves_out_the_unused_actors(tmp_path):
    cfg = load_config(None, [f"run.storage={tmp_path}"])
    names = _callback_names(_trainer(cfg, storage_path=str(tmp_path)))
    # what sets up the devices and the process group stays
    assert {"AcceleratorSetupCallback", "BackendSetupCallback"} <= names
    assert not names & set(LEAN_DROPPED_CALLBACKS)


def test_ray_trains_controller_unpickles_no_torch(tmp_path):
    """What the controller process receives (the run context with the backend config, the callbacks, the
    policies) loads in a fresh interpreter without importing torch: it runs before any worker exists."""
    import subprocess

    from ray import cloudpickle
    from ray.train import FailureConfig

    from ray_app.controller.failure_policy import KitFailurePolicy

    trainer = _trainer(load_config(None, [f"run.storage={tmp_path}"]), storage_path=str(tmp_path))
    sent = tmp_path / "controller.pkl"
    sent.write_bytes(cloudpickle.dumps((trainer.train_run_context, trainer._create_default_callbacks(),
                                        KitFailurePolicy(FailureConfig(max_failures=1)))))
    probe = ("import sys; from ray import cloudpickle; import ray.train.v2._internal.execution.controller; "
             f"cloudpickle.loads(open({str(sent)!r}, 'rb').read()); print(sorted(m for m in sys.modules if m == 'torch'))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_datasets_keep_their_callback():
    from ray.train.torch import TorchTrainer

    lean = lean_trainer_class()
    assert issubclass(lean, TorchTrainer)
    with_data = lean(lambda: None, datasets={"train": lambda: None})
    names = _callback_names(with_data)
    assert "DatasetsCallback" in names and "PlacementGroupCleanerCallback" not in names
    assert "PlacementGroupCleanerCallback" in _callback_names(TorchTrainer(lambda: None))


def test_one_trainer_for_train_and_eval_carries_the_job(tmp_path):
    cfg = load_config(None, [f"run.storage={tmp_path}", "scaling.num_workers=3", "scaling.cpus_per_worker=0.5",
                             "failure.max_failures=4", "checkpoint.keep=2"])
    job = {"mode": "eval", "checkpoint": "/some/ckpt", "config": cfg.to_dict(), "project_dir": str(tmp_path)}
    trainer = _trainer(cfg, job, run_name="eval-x", storage_path=str(tmp_path / "ray"))
    assert trainer.train_loop_config == job
    rc = trainer.run_config
    assert (rc.name, rc.storage_path) == ("eval-x", str(tmp_path / "ray"))
    assert rc.failure_config.max_failures == 4 and rc.checkpoint_config.num_to_keep == 2
    sc = trainer.scaling_config
    assert sc.num_workers == 3 and not sc.use_gpu and sc.resources_per_worker == {"CPU": 0.5}


def test_min_workers_makes_the_worker_group_elastic(tmp_path):
    fixed = _trainer(load_config(None, [f"run.storage={tmp_path}", "scaling.num_workers=3"])).scaling_config
    assert fixed.num_workers == 3 and not fixed.elasticity_enabled
    cfg = load_config(None, [f"run.storage={tmp_path}", "scaling.num_workers=3", "scaling.min_workers=2",
                             "scaling.resize_interval_s=5"])
    elastic = _trainer(cfg).scaling_config
    assert elastic.elasticity_enabled and (elastic.min_workers, elastic.max_workers) == (2, 3)
    assert elastic.elastic_resize_monitor_interval_s == 5
    driver._check_capacity(cfg, {"CPU": 2}, remote=True)  # room for min_workers is enough to start
    with pytest.raises(UserError, match="scaling.num_workers"):
        driver._check_capacity(cfg, {"CPU": 1}, remote=True)
    same = load_config(None, [f"run.storage={tmp_path}", "scaling.num_workers=3", "scaling.min_workers=3"])
    assert not _trainer(same).scaling_config.elasticity_enabled
    with pytest.raises(ConfigError, match="scaling.min_workers=4 must not exceed scaling.num_workers=3"):
        load_config(None, ["scaling.num_workers=3", "scaling.min_workers=4"])


def test_kit_trainer_runs_with_the_kit_failure_policy(monkeypatch, tmp_path):
    """The lean trainer hands Ray's controller a KitFailurePolicy built from the run's FailureConfig."""
    from ray_app.controller.failure_policy import KitFailurePolicy

    lean = lean_trainer_class()
    base = next(c for c in lean.__mro__[1:] if "_initialize_and_run_controller" in vars(c))
    # Ray passes the policy by this keyword: the override replaces it (a Ray upgrade that renames it fails here)
    assert "failure_policy=" in inspect.getsource(base.fit)
    seen = {}
    monkeypatch.setattr(base, "_initialize_and_run_controller", lambda self, **kw: seen.update(kw) or "result")
    cfg = load_config(None, [f"run.storage={tmp_path}", "failure.max_failures=5"])
    trainer = _trainer(cfg, storage_path=str(tmp_path))
    assert trainer._initialize_and_run_controller(failure_policy="ray's default", other=1) == "result"
    assert isinstance(seen["failure_policy"], KitFailurePolicy) and seen["other"] == 1
    assert seen["failure_policy"].failure_config.max_failures == 5
    # it knows where this launch's hang reports are (ray_app.shared.reports), after the trip to the controller too
    import pickle

    reports = pickle.loads(pickle.dumps(seen["failure_policy"])).hang_reports
    launch = trainer.train_loop_config["launch"]
    assert (reports.storage_uri, reports.run, reports.launch) == (str(tmp_path), cfg.run.name, launch)
    assert trainer.train_loop_config["attempt_key"].startswith("ray_app:attempt:")
    evaluation = _trainer(cfg, job={"mode": "eval", "config": cfg.to_dict()})
    assert evaluation.failure_policy_kwargs == {} and "launch" not in evaluation.train_loop_config


def test_the_controller_polls_fast_only_while_reports_come(monkeypatch, tmp_path):
    """Ray Train's controller polls every 0.1 s for 3 s after a poll that took a report or saw a worker finish
    or fail, else every 0.5 s: a training run's lean trainer starts Ray's controller as a subclass whose
    ``_poll_workers`` (Ray's, run here) sets that interval; a user's own RAY_TRAIN_HEALTH_CHECK_INTERVAL_S
    and an evaluation keep Ray's fixed interval."""
    import asyncio
    import math
    from types import SimpleNamespace as S

    import ray.train.v2.api.data_parallel_trainer as dpt
    from ray import cloudpickle

    idle = S(running=True, error=None, training_report=None)
    poll = driver.BusyPolling(0.1)
    assert poll.after([idle, idle], now=100.0) == 0.5
    assert poll.after([S(running=True, error=None, training_report=object()), idle], now=101.0) == 0.1
    assert poll.after([idle, idle], now=103.9) == 0.1 and poll.after([idle, idle], now=104.1) == 0.5
    assert poll.after([S(running=False, error=None, training_report=None), idle], now=105.0) == 0.1
    assert poll.after([S(running=True, error=RuntimeError("x"), training_report=None)], now=110.0) == 0.1

    lean = lean_trainer_class()
    base = next(c for c in lean.__mro__[1:] if "_initialize_and_run_controller" in vars(c))
    seen = {}
    monkeypatch.setattr(base, "_initialize_and_run_controller", lambda self, **kw: seen.update(cls=dpt.TrainController))
    monkeypatch.delenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", raising=False)
    cfg = load_config(None, [f"run.storage={tmp_path}"])
    trainer = _trainer(cfg, storage_path=str(tmp_path))
    assert trainer.poll_when_busy.fast_s == 0.1
    trainer._initialize_and_run_controller()
    assert dpt.TrainController is not seen["cls"] and issubclass(seen["cls"], dpt.TrainController)  # put back after
    assert seen["cls"].__name__ == "TrainController"  # Ray names the actor's process and log lines by it
    controller = cloudpickle.loads(cloudpickle.dumps(seen["cls"]))  # as Ray sends it to the controller's process
    statuses = [{0: idle, 1: idle}, {0: S(running=True, error=None, training_report=object()), 1: idle}]
    group = S(poll_status=lambda timeout: S(worker_statuses=statuses.pop(0)))
    c = controller.__new__(controller)
    c._worker_group, c._health_check_interval_s = group, 0.1
    for expected in (0.5, 0.1):  # nothing came: slow; a report: fast
        c._latest_poll_time = -math.inf  # Ray's _poll_workers sleeps out the interval since the last poll
        asyncio.run(c._poll_workers())
        assert c._health_check_interval_s == expected

    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2")
    fixed = _trainer(cfg, storage_path=str(tmp_path))
    assert fixed.poll_when_busy is None
    fixed._initialize_and_run_controller()
    assert seen["cls"] is dpt.TrainController
    monkeypatch.delenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")
    assert _trainer(cfg, job={"mode": "eval", "config": cfg.to_dict()}).poll_when_busy is None


def test_a_ray_started_here_has_no_autoscaling_coordinator(monkeypatch, tmp_path):
    """On a local Ray (no autoscaler) the controller gets Ray's fixed-size policy minus the coordinator
    actor; an elastic run and a cluster run keep Ray's own policy."""
    from ray.train.v2._internal.execution.scaling_policy import create_scaling_policy
    from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy

    lean = lean_trainer_class()
    base = next(c for c in lean.__mro__[1:] if "_initialize_and_run_controller" in vars(c))
    assert "scaling_policy=create_scaling_policy(" in inspect.getsource(base.fit)  # the keyword replaced
    seen = {}
    monkeypatch.setattr(base, "_initialize_and_run_controller", lambda self, **kw: seen.update(kw))

    def policy_given(trainer):
        trainer._initialize_and_run_controller(scaling_policy=create_scaling_policy(trainer.scaling_config))
        return seen["scaling_policy"]

    fixed = _trainer(load_config(None, [f"run.storage={tmp_path}"]), storage_path=str(tmp_path))
    assert type(policy_given(fixed)) is FixedScalingPolicy  # a cluster (RAY_ADDRESS): Ray's own
    fixed.without_autoscaler = True
    policy = policy_given(fixed)
    assert type(policy).__name__ == "FixedPolicyWithoutAutoscaler" and policy.scaling_config is fixed.scaling_config
    policy.after_controller_start(train_run_context=None)  # creates no actor, sends nothing
    policy._maybe_send_resource_request()
    policy.make_decision_for_non_running_worker_group()
    elastic = _trainer(load_config(None, [f"run.storage={tmp_path}", "scaling.num_workers=3",
                                          "scaling.min_workers=2"]), storage_path=str(tmp_path))
    elastic.without_autoscaler = True
    assert type(policy_given(elastic)).__name__ != "FixedPolicyWithoutAutoscaler"


# ---------------------------------------------------------------- the driver shows a worker's failure

class _GroupError(Exception):
    def __init__(self, text, failures):
        super().__init__(text)
        self.worker_failures = failures


def test_bad_input_found_by_a_worker_is_one_line():
    error = _GroupError("Training failed", {1: RuntimeError("lost"),
                                            0: PluginError("config key data.name: acme returned a list\nmore")})
    with pytest.raises(UserError) as exc:
        raise_worker_failure(error)
    assert str(exc.value) == "config key data.name: acme returned a list"


def test_user_code_error_shows_its_traceback_once(capsys):
    a = UserCodeError("ValueError: bad", "Traceback (most recent call last):\n  File \"acme.py\", line 3\nValueError: bad\n",
                      "fp", rank=1, step=20)
    b = UserCodeError("ValueError: bad", "other rank's copy\n", "fp", rank=2, step=20)
    with pytest.raises(TrainingFailed) as exc:
        raise_worker_failure(_GroupError("x", {2: b, 1: a}))
    assert str(exc.value) == "ValueError: bad (rank 1, at step 20; traceback above)"
    err = capsys.readouterr().err
    assert err.count("Traceback") == 1 and "acme.py" in err and "rank 1 raised in your code" in err
    assert "other rank's copy" not in err


def test_other_failures_end_on_their_last_line():
    with pytest.raises(TrainingFailed, match=r"^RuntimeError: NCCL timeout$"):
        raise_worker_failure(RuntimeError("Training failed due to worker errors:\n[Rank 0 Error Snippet]:\n"
                                          "  File \"x.py\", line 1\nRuntimeError: NCCL timeout\n\n"))
    with pytest.raises(TrainingFailed, match="RuntimeError"):
        raise_worker_failure(RuntimeError(""))


# ---------------------------------------------------------------- before Ray

@pytest.fixture
def clean_path(monkeypatch):
    """sys.path as it was, after a test that puts the user's project folder on it."""
    monkeypatch.setattr(sys, "path", list(sys.path))


def _module(folder, source: str) -> str:
    name = f"userproj_{uuid.uuid4().hex[:8]}"
    (folder / f"{name}.py").write_text(textwrap.dedent(source))
    return name


def test_user_plugins_are_found_in_the_folder_ray_app_runs_from(tmp_path, monkeypatch, clean_path):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    name = _module(tmp_path, """
        from torch import nn

        def Net(num_classes, hidden=4):
            return nn.Linear(hidden, num_classes)
    """)
    monkeypatch.chdir(tmp_path)
    sys.path[:] = [p for p in sys.path if p not in ("", str(tmp_path))]
    monkeypatch.delitem(sys.modules, name, raising=False)  # removed again after the test
    cfg = load_config(None, [f"model.name={name}:Net", "model.args.hidden=8"])
    validate_before_ray(cfg)
    assert sys.path[0] == str(tmp_path) and name in sys.modules
    with pytest.raises(ConfigError, match="config key model.args.hiden"):
        validate_before_ray(load_config(None, [f"model.name={name}:Net", "model.args.hiden=8"]))


def test_data_folder_is_checked_before_ray_only_where_the_driver_shares_it(tmp_path, monkeypatch, clean_path):
    cfg = load_config(None, ["data.name=cifar10", f"data.path={tmp_path}"])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match="config key data.path.*cifar-10-batches-py"):
        validate_before_ray(cfg)
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")  # the workers' files are theirs to check
    validate_before_ray(cfg)


def _saved_run(root, run: str, cfg_overrides: list[str], step: int = 3) -> str:
    """A committed checkpoint of ``run`` whose config.json is that of ``cfg_overrides``."""
    write_checkpoint(root / run, step, config=load_config(None, cfg_overrides).to_dict())
    return str(root / run)


def test_a_run_resumes_only_with_the_config_its_checkpoints_depend_on(tmp_path, clean_path):
    runs = tmp_path / "runs"
    _saved_run(runs, "r1", ["model.name=mlp", "model.args.hidden=16"])
    base = [f"run.storage={runs}", "run.name=r1", "model.name=mlp", "model.args.hidden=16"]
    preflight_run(load_config(None, [*base, "train.epochs=20", "train.lr=0.5"]))  # may change on resume
    with pytest.raises(UserError) as exc:
        preflight_run(load_config(None, [*base, "model.args.hidden=32", "task.name=regression"]))
    msg = str(exc.value)
    assert "model.args ({'hidden': 16} -> {'hidden': 32})" in msg and "task.name ('classification' -> 'regression')" in msg
    assert "run.name" in msg and f"run.resume_from={runs / 'r1'}" in msg and "\n" not in msg
    preflight_run(load_config(None, [*base, "model.args.hidden=32", "run.name=r2"]))  # a new run is fine


def test_resume_from_needs_the_same_model(tmp_path, clean_path):
    runs = tmp_path / "runs"
    source = _saved_run(runs, "src", ["model.name=mlp"])
    ok = load_config(None, [f"run.storage={runs}", "run.name=new", "model.name=mlp", f"run.resume_from={source}",
                            "train.lr=0.01", "data.batch_size=8"])  # a warm start may change the rest
    preflight_run(ok)
    with pytest.raises(UserError, match=r"config key run.resume_from: .* holds another model \(model.name \('mlp' -> 'digits_cnn'\)"):
        preflight_run(load_config(None, [f"run.storage={runs}", "run.name=new2", f"run.resume_from={source}"]))


@pytest.mark.timeout(60)
def test_the_drivers_resume_from_check_verifies_every_file_reading_each_once(tmp_path, clean_path, monkeypatch):
    from ray_app.shared import storage as storage_mod
    from tests.unit.test_checkpoint import CountingStorage

    runs = tmp_path / "runs"
    source = _saved_run(runs, "src", ["model.name=mlp"])
    made = []

    def counting_open(uri, retry_s=0.0, then=None):
        made.append(CountingStorage(uri) if not uri.startswith("s3://") else storage_mod.S3Storage(uri, retry_s))
        return made[-1]

    monkeypatch.setattr(storage_mod, "open_storage", counting_open)
    preflight_run(load_config(None, [f"run.storage={runs}", "run.name=new", "model.name=mlp",
                                     f"run.resume_from={source}"]))
    reads = {rel: sizes for s in made for rel, sizes in s.reads.items()}
    checkpoint = next(iter(reads)).rsplit("/", 1)[0]
    assert reads == {f"{checkpoint}/{name}": [size] for name, size in made[0].list_files(checkpoint).items()}, reads


# ---------------------------------------------------------------- RayRuntime.report

class FakeRayTrain:
    """The parts of ``ray.train`` that RayRuntime.report calls; records each report's checkpoint name."""

    class CheckpointUploadMode:
        SYNC, ASYNC = "sync", "async"

    class Checkpoint:
        def __init__(self, path, filesystem=None):
            self.path = path

        @classmethod
        def from_directory(cls, path):
            return cls(path)

    def __init__(self):
        self.reports = []

    def report(self, metrics, checkpoint=None, checkpoint_dir_name=None, **kwargs):
        self.reports.append((checkpoint is not None, checkpoint_dir_name))


def test_the_fake_ray_train_takes_its_calls_as_ray_train_does():
    import ray.train

    assert_stands_in_for(FakeRayTrain(), ray.train)


def test_every_rank_reports_the_writers_checkpoint_name_to_ray(tmp_path):
    from ray_app.shared.storage import LocalStorage

    train = FakeRayTrain()
    rt = object.__new__(worker_side.RayRuntime)  # without Ray: what __init__ would read from ray.train
    rt._train, rt.storage, rt.run, rt.upload_mode = train, LocalStorage(str(tmp_path)), "r", "sync"
    name = checkpoint_dir_name(4)
    rt.report({"global_step": 4}, None, name)  # a rank that does not write
    local = tmp_path / "local"
    local.mkdir()
    rt.report({"global_step": 4}, local, name, upload=lambda local_dir, dir_name: None)  # the writer
    rt.report({"global_step": 5})  # a report without a checkpoint
    assert train.reports == [(False, name), (True, name), (False, None)]


# ---------------------------------------------------------------- a worker's error

class FakeRayRuntime:
    """What worker_main needs of RayRuntime, without Ray (rank 1 of 2 on the CPU)."""

    def __init__(self, storage, run, upload_mode, ddp_options=None):
        self.storage, self.run = storage, run
        self.rank, self.world_size = 1, 2
        self.device = torch.device("cpu")

    def prepare_model(self, model, bucket_cap_mb=25):
        raise RuntimeError("the kit's own failure (no user frame)")

    def report(self, *a, **kw):
        raise AssertionError("not reached")


def test_the_fake_ray_runtime_is_built_and_called_as_ray_runtime():
    assert_stands_in_for(FakeRayRuntime, worker_side.RayRuntime)


SMALL_DATA = ["data.name=synthetic", "data.args.num_samples=16", "data.args.image_size=4"]


@pytest.fixture
def worker(monkeypatch, tmp_path, clean_path):
    """worker_main with a fake runtime; the user's code lives in a project folder that is not on sys.path."""
    project = worker_without_ray(monkeypatch, tmp_path, FakeRayRuntime)
    base = [f"run.storage={tmp_path / 'runs'}", "metrics.enabled=false"]

    def run(source: str, overrides: list[str]):
        name = _module(project, source)
        cfg = load_config(None, [*base, *(o.replace("USER", name) for o in overrides)])
        try:
            worker_main({"mode": "train", "config": cfg.to_dict(), "project_dir": str(project)})
        finally:
            sys.modules.pop(name, None)
    return run


def test_an_exception_in_user_code_becomes_a_user_code_error(worker, tmp_path):
    with pytest.raises(UserCodeError) as exc:
        worker("""
            def helper(hidden):
                raise ValueError(f"hidden={hidden} is too small")

            def Net(num_classes, hidden=2):
                return helper(hidden)
        """, ["model.name=USER:Net", *SMALL_DATA])
    err = exc.value
    assert err.rank == 1 and err.summary == "ValueError: hidden=2 is too small" and str(err) == err.summary
    text = err.traceback_text
    assert text.startswith("Traceback (most recent call last):\n") and text.rstrip().endswith("hidden=2 is too small")
    assert "in Net" in text and "in helper" in text
    assert "worker.py" not in text and "driver.py" not in text and "plugins.py" not in text and "loop.py" not in text
    assert str(tmp_path / "project") in text  # the worker found the code in the project folder
    assert err.fingerprint.startswith("ValueError|hidden=2 is too small|") and err.fingerprint.endswith("|step -1")
    assert worker_side._SHOWN_BY_THE_DRIVER.active  # Ray Train's own log of it is left out: the driver shows it


def test_bad_input_from_a_worker_stays_a_config_error(worker):
    with pytest.raises(PluginError, match="config key data.name: .* returned a TensorDataset"):
        worker("""
            import torch
            from torch.utils.data import TensorDataset

            def build():
                return TensorDataset(torch.zeros(4, 2))
        """, ["data.name=USER:build"])


def test_a_failure_outside_user_code_is_raised_as_it_is(worker):
    with pytest.raises(RuntimeError, match="the kit's own failure") as exc:
        worker("X = 1\n", ["model.name=mlp", *SMALL_DATA])
    assert not isinstance(exc.value, UserCodeError)
    assert not worker_side._SHOWN_BY_THE_DRIVER.active  # the driver shows only its last line: Ray's log keeps it


@pytest.mark.parametrize("raised,leaving", [
    # what a rank's collective raises when its peer's process is gone (the message of torch 2's gloo)
    (RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
                  "[127.0.0.1]:9120"), False),
    (RuntimeError("Application timeout caused pair closure"), False),  # gloo: a collective timed out
    (RuntimeError("the kit's own failure (no user frame)"), True),  # after the notice to leave
])
def test_a_rank_that_lost_its_peer_is_a_peer_lost_left_out_of_rays_log(worker, monkeypatch, raised, leaving):
    from ray_app.shared.errors import PeerLost
    from ray_app.worker import preemption

    def prepare_model(self, model, bucket_cap_mb=25):
        raise raised

    monkeypatch.setattr(FakeRayRuntime, "prepare_model", prepare_model)
    monkeypatch.setattr(preemption, "NOTICE", threading.Event())
    if leaving:
        preemption.NOTICE.set()
    with pytest.raises(PeerLost, match=r"^rank 1 lost a peer: RuntimeError: "):
        worker("X = 1\n", ["model.name=mlp", *SMALL_DATA])
    assert worker_side._SHOWN_BY_THE_DRIVER.active  # the restart's one line names the cause instead


def test_ray_trains_log_of_an_error_the_driver_shows_is_left_out(monkeypatch):
    import logging

    shown = worker_side._SHOWN_BY_THE_DRIVER
    record = logging.LogRecord("ray.train", logging.ERROR, "x.py", 1, "Error in training function:\nTraceback", None, None)
    other = logging.LogRecord("ray.train", logging.ERROR, "x.py", 1, "Something else", None, None)
    monkeypatch.setattr(shown, "active", False)
    assert shown.filter(record) and shown.filter(other)
    monkeypatch.setattr(shown, "active", True)
    assert not shown.filter(record) and shown.filter(other)


def test_a_run_is_checked_without_importing_torch(tmp_path):
    """The resume check reads the checkpoint catalog, which imports no torch (torch costs the driver seconds),
    also for a run that has checkpoints."""
    import subprocess
    import sys

    from tests.support.checkpoints import write_checkpoint

    cfg = load_config(None, [f"run.storage={tmp_path}"])
    write_checkpoint(tmp_path / cfg.run.name, 5, config=cfg.to_dict())
    code = ("import sys; from ray_app.shared.config import load_config; from ray_app.driver.launcher import preflight_run; "
            f"preflight_run(load_config(None, ['run.storage={tmp_path}'])); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_an_elastic_group_that_did_not_start_is_asked_for_one_fewer_until_the_view_changes(tmp_path, monkeypatch):
    """Just after a node is lost, Ray's view still counts it: a group of 3 sized to that view times out,
    and the next ask is 2 while the view shows the same nodes; a node that joins (or leaves) ends that,
    and so does FEWER_FOR_S (a fresh node slow to start its first worker: the view was right)."""
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
    from ray.train.v2._internal.execution.controller.state import ReschedulingState
    from ray.train.v2._internal.execution.scaling_policy import ResizeDecision, create_scaling_policy
    from ray.train.v2.api.exceptions import ControllerError

    from ray_app.controller.scaling_policy import FewerAfterStartTimeout

    lean = lean_trainer_class()
    base = next(c for c in lean.__mro__[1:] if "_initialize_and_run_controller" in vars(c))
    seen = {}
    monkeypatch.setattr(base, "_initialize_and_run_controller", lambda self, **kw: seen.update(kw))
    elastic = _trainer(load_config(None, [f"run.storage={tmp_path}", "scaling.num_workers=3",
                                          "scaling.min_workers=2"]), storage_path=str(tmp_path))
    elastic._initialize_and_run_controller(scaling_policy=create_scaling_policy(elastic.scaling_config))
    policy = seen["scaling_policy"]
    assert isinstance(policy.limiter, FewerAfterStartTimeout)

    view = {f"node-{i}": {"CPU": 1.0} for i in range(3)}  # the lost node still among them
    now = [1000.0]
    monkeypatch.setattr(policy.limiter, "_clock", lambda: now[0])
    monkeypatch.setattr(policy, "_maybe_send_resource_request", lambda: None)
    monkeypatch.setattr(policy, "_get_reserved_resources", lambda: policy.__dict__.update(
        _latest_reserved_resources=dict(view)) or dict(view))

    def asked() -> int:
        decision = policy.make_decision_for_non_running_worker_group()
        assert isinstance(decision, ResizeDecision)
        return decision.num_workers

    assert asked() == 3
    timed_out = ControllerError(WorkerGroupStartupTimeoutError(num_workers=3))
    policy.after_controller_state_update(None, ReschedulingState(training_failed_error=timed_out))
    assert asked() == 2 and asked() == 2  # the same view: one fewer, every time
    policy.after_controller_state_update(None, ReschedulingState(training_failed_error=ControllerError(
        WorkerGroupStartupTimeoutError(num_workers=2))))
    assert asked() == 2  # never below scaling.min_workers
    view["node-3"] = {"CPU": 1.0}  # a node joined: Ray's count again
    assert asked() == 3  # 4 nodes in view, scaling.num_workers 3

    del view["node-3"]
    assert asked() == 3  # a group of 3 sized to this view, and it does not start either
    policy.after_controller_state_update(None, ReschedulingState(training_failed_error=timed_out))
    now[0] += policy.limiter.FEWER_FOR_S - 1
    assert asked() == 2  # the same view, not long after
    now[0] += 1
    assert asked() == 3  # the same view, long enough: trusted again


def test_the_driver_waits_for_the_workers_last_lines_before_shutting_ray_down():
    """Worker output reaches the driver through Ray's stdstream dispatcher: ``drain`` returns once it has
    been quiet for ``quiet_s``, not while lines still arrive, and leaves the dispatcher as it was."""
    import threading
    import time

    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    from ray_app.driver.launcher import WorkerLogs

    logs = WorkerLogs()
    arrived = []

    def stream():
        for i in range(8):  # a line every 0.1 s for 0.8 s
            dispatcher.emit({"lines": [f"line {i}"], "pid": 1, "is_err": False})
            arrived.append(time.monotonic())
            time.sleep(0.1)

    sender = threading.Thread(target=stream)
    t0 = time.monotonic()
    sender.start()
    logs.drain(quiet_s=0.3, most_s=5.0)
    waited = time.monotonic() - t0
    sender.join()
    assert len(arrived) == 8 and waited >= arrived[-1] - t0 + 0.3 - 0.05, (waited, arrived[-1] - t0)
    assert waited < 3.0
    assert all(name != WorkerLogs.HANDLER for name, _ in dispatcher.handlers)
    t0 = time.monotonic()
    WorkerLogs().drain(quiet_s=0.3, most_s=5.0)  # nothing streams: one quiet window
    assert 0.3 <= time.monotonic() - t0 < 2.0


def test_a_key_only_the_other_strategy_reads_is_named_once_before_ray(capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for quiet in ([], ["train.strategy=fsdp", "train.fsdp_units=Block", "train.reshard_after_forward=false"],
                  ["train.find_unused_parameters=true", "train.static_graph=true", "train.bucket_cap_mb=50"]):
        validate_before_ray(load_config(None, quiet))
    assert capsys.readouterr().err == ""
    validate_before_ray(load_config(None, ["train.strategy=fsdp", "train.find_unused_parameters=true",
                                           "train.bucket_cap_mb=50"]))
    assert capsys.readouterr().err == (
        "ray-app: train.bucket_cap_mb=50, train.find_unused_parameters=true are read under train.strategy=ddp only, "
        "so not used by this train.strategy=fsdp run (docs/fsdp.md)\n")
    validate_before_ray(load_config(None, ["train.fsdp_units=Block"]))
    assert capsys.readouterr().err == (
        'ray-app: train.fsdp_units="Block" is read under train.strategy=fsdp only, so not used by this '
        "train.strategy=ddp run (docs/fsdp.md)\n")


def test_the_deprecated_train_amp_is_one_warning_line_before_ray_and_means_bf16_mixed(capsys, monkeypatch):
    """train.amp goes: true is train.precision=bf16-mixed, false fp32, said in one line (and disagreeing with
    train.precision is bad input: tests/unit/test_cli.py). train.fsdp_units names the blocks activation
    checkpointing and compile apply to under DDP too: no note then."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for quiet in (["train.precision=bf16-mixed"], ["train.fsdp_units=Block", "train.activation_checkpointing=full"],
                  ["train.fsdp_units=Block", "train.compile=true"]):
        validate_before_ray(load_config(None, quiet))
    assert capsys.readouterr().err == ""
    cfg = load_config(None, ["train.amp=true"])
    assert cfg.train.precision == "bf16-mixed"
    validate_before_ray(cfg)
    assert capsys.readouterr().err == ("ray-app: train.amp is deprecated: train.amp=true is read as "
                                       "train.precision=bf16-mixed; set that instead\n")
    assert load_config(None, ["train.amp=false"]).train.precision == "fp32"
    assert load_config(None, ["train.amp=true", "train.precision=bf16-mixed"]).train.precision == "bf16-mixed"
