"""Script mode without Ray: how a script is run as ``__main__``, the process group it gets, the
environment, the checks before Ray starts, how its errors come back, and the checkpoint API."""

from __future__ import annotations

import collections
import json
import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ray_app import script as kit
from ray_app.driver import script as driver_script
from ray_app.shared.catalog import FORMAT, MANIFEST, SCRIPT_FORMAT, list_checkpoints, newest_good, verify
from ray_app.shared.config import load_config
from ray_app.shared.errors import ConfigError, UserCodeError, UserError
from ray_app.shared.storage import LocalStorage
from ray_app.worker import entry as worker
from ray_app.worker.entry import worker_main
from tests.support.stand_ins import assert_stands_in_for
from tests.support.worker import worker_without_ray


def write(folder: Path, name: str, source: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(source))
    return path


@pytest.fixture
def saved_process_state(monkeypatch):
    """os.environ, sys.argv and sys.path as they were; no session left behind."""
    env = dict(os.environ)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    os.environ.clear()
    os.environ.update(env)
    kit._SESSION = None


# ---------------------------------------------------------------- running the script as __main__

PROBE = """
    import json, os, sys
    import helper  # a module beside the script: its folder is first on sys.path

    def main():
        out = {"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "file": __file__, "helper": helper.X}
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
        code = int(sys.argv[2])
        if code >= 0:
            sys.exit(code)
        raise ValueError("the script's own bug")

    if __name__ == "__main__":
        main()
"""


@pytest.fixture
def probe(tmp_path, saved_process_state):
    folder = tmp_path / "proj"
    folder.mkdir()
    write(folder, "helper.py", "X = 42\n")
    return write(folder, "train.py", PROBE)


@pytest.mark.parametrize("code", ["0", "-2"], ids=["exit-0", "no-exit"])
def test_a_script_runs_as_main_with_its_argv_and_its_folder_on_the_path(probe, tmp_path, code):
    before_argv, before_path = list(sys.argv), list(sys.path)
    out = tmp_path / "out.json"
    if code == "-2":
        with pytest.raises(ValueError, match="the script's own bug"):
            kit.run_main(str(probe), [str(out), "-1"])
    else:
        kit.run_main(str(probe), [str(out), code])
    seen = json.loads(out.read_text())
    assert seen["argv"] == [str(probe), str(out), "-1" if code == "-2" else code]
    assert seen["path0"] == str(probe.parent) and seen["file"] == str(probe) and seen["helper"] == 42
    assert sys.argv == before_argv and sys.path == before_path  # restored, also after an exception


def test_a_non_zero_exit_is_raised(probe, tmp_path):
    with pytest.raises(SystemExit) as exc:
        kit.run_main(str(probe), [str(tmp_path / "o.json"), "3"])
    assert exc.value.code == 3


# ---------------------------------------------------------------- the process group the script gets

GROUP_SCRIPT = """
    import torch
    import torch.distributed as dist
    from torch.distributed import init_process_group, destroy_process_group

    init_process_group("nccl", init_method="tcp://10.255.255.1:1", world_size=7, rank=5)  # returns at once
    dist.init_process_group(backend="gloo")
    t = torch.ones(2)
    dist.all_reduce(t)
    RESULT = (dist.get_world_size(), t.tolist())
    destroy_process_group()
"""


@pytest.fixture
def kit_group(tmp_path):
    """A real one-rank gloo group standing in for the one Ray Train sets up."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", world_size=1, rank=0)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_script_gets_the_kits_group_its_own_init_and_destroy_do_nothing(kit_group, tmp_path, saved_process_state):
    real_init, real_destroy = dist.init_process_group, dist.destroy_process_group
    said = []
    script = write(tmp_path, "group.py", textwrap.dedent(GROUP_SCRIPT) + "open(__file__ + '.out', 'w').write(repr(RESULT))\n")
    with kit.kit_process_group(say=lambda *a, **kw: said.append(a[0])):
        kit.run_main(str(script), [])
        dist.init_process_group("mpi")  # a second mismatch: no second notice
    assert Path(f"{script}.out").read_text() == "(1, [1.0, 1.0])"
    assert dist.is_initialized()  # the script's destroy_process_group left the kit's group alone
    assert len(said) == 1, said
    assert "backend 'nccl', init_method 'tcp://10.255.255.1:1', world_size 7, rank 5;" in said[0], said
    assert "(gloo, world size 1" in said[0], said
    assert dist.init_process_group is real_init and dist.destroy_process_group is real_destroy
    from torch.distributed import distributed_c10d

    assert distributed_c10d.init_process_group is real_init and distributed_c10d.destroy_process_group is real_destroy


def test_arguments_that_agree_with_the_kits_group_say_nothing(kit_group):
    said = []
    with kit.kit_process_group(say=lambda *a, **kw: said.append(a[0])):
        dist.init_process_group("gloo", init_method="env://", world_size=1, rank=0)
        dist.init_process_group(backend="GLOO")
        dist.init_process_group()
    assert said == []


def test_other_ranks_say_nothing_and_a_subgroup_is_really_destroyed(kit_group):
    with kit.kit_process_group(say=None):
        dist.init_process_group("nccl")
        sub = dist.new_group([0])
        dist.destroy_process_group(sub)
        dist.destroy_process_group()
    assert dist.is_initialized()


# ---------------------------------------------------------------- the environment

class FakeContext:
    def get_world_rank(self):
        return 3

    def get_world_size(self):
        return 4

    def get_local_rank(self):
        return 1

    def get_local_world_size(self):
        return 2

    def get_node_rank(self):
        return 1


def test_the_fake_context_answers_as_ray_trains_context():
    import ray.train

    assert_stands_in_for(FakeContext, ray.train.TrainContext)


def test_the_environment_is_torchruns():
    env = kit.torchrun_env(FakeContext(), "my-run")
    assert env == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                   "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "4", "ROLE_NAME": "default", "TORCHELASTIC_RUN_ID": "my-run"}


# ---------------------------------------------------------------- before Ray starts

def test_the_script_is_checked_before_ray(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub", "train.py", "print('hi')\n")
    write(tmp_path, "bad.py", "def f(:\n    pass\n")
    assert driver_script.check_script("sub/train.py") == os.path.join("sub", "train.py")
    assert driver_script.check_script(str(tmp_path / "sub" / "train.py")) == os.path.join("sub", "train.py")
    outside = write(tmp_path.parent, f"{tmp_path.name}-outside.py", "x = 1\n")
    assert driver_script.check_script(str(outside)) == str(outside)  # outside the folder: absolute
    for path, needle in (("nope.py", "SCRIPT nope.py: no such file"), ("sub", "SCRIPT sub: is a folder"),
                         ("bad.py", "SCRIPT bad.py: SyntaxError")):
        with pytest.raises(UserError, match=needle):
            driver_script.check_script(path)


@pytest.mark.parametrize("script, name", [("train.py", "train"), ("a/b/my model.py", "my-model"),
                                          ("_private.py", "script-_private")])
def test_a_scripts_run_is_named_after_it(script, name):
    assert driver_script.default_run_name(script) == name
    assert load_config(None, [f"run.name={name}"]).run.name == name  # a valid run name


@pytest.mark.parametrize("argv", [["run", "nope.py", "--epochs", "3"], ["run"], ["run", "--set", "x=1", "."]],
                         ids=["missing", "no-script", "folder"])
def test_bad_script_exits_2_with_one_line(run_cli, tmp_path, argv):
    rc, out, err = run_cli(argv, cwd=tmp_path, timeout=60)
    assert rc == 2 and out == "", (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("ray-app: error: SCRIPT"), err


def test_the_user_frames_are_the_scripts_folder_unless_it_holds_the_environment(tmp_path):
    script = str(tmp_path / "train.py")
    assert kit.script_roots(script) == (str(tmp_path),)
    in_env = os.path.join(sys.prefix, "train.py")  # a project folder with its venv inside
    assert kit.script_roots(in_env) == (in_env,)


# ---------------------------------------------------------------- a worker, without Ray

class FakeRuntime:
    """What run_in_worker needs of worker.RayRuntime: rank 0 of 1, reports recorded."""

    def __init__(self, storage, run, upload_mode, ddp_options=None):
        self.storage, self.run, self.rank, self.world_size = storage, run, 0, 1
        self.reports = []

    def report(self, metrics, local_dir=None, dir_name=None, upload=None):
        self.reports.append(metrics)
        if local_dir is not None:
            upload(Path(local_dir), dir_name)


def test_the_fake_runtime_is_built_and_called_as_ray_runtime():
    assert_stands_in_for(FakeRuntime, worker.RayRuntime)


@pytest.fixture
def script_worker(monkeypatch, tmp_path, saved_process_state):
    """worker.worker_main in script mode: fake runtime and Ray Train context, a project folder."""
    import ray.train

    project = worker_without_ray(monkeypatch, tmp_path, FakeRuntime)
    monkeypatch.setattr(ray.train, "get_context", FakeContext)
    cfg = load_config(None, [f"run.storage={tmp_path / 'runs'}", "run.name=s"])

    def run(source: str, args=(), job_script="train.py", **job_keys):
        write(project, "train.py", source)
        job = {"mode": "script", "script": job_script, "args": list(args), "config": cfg.to_dict(),
               "project_dir": str(project), **job_keys}
        results = []
        worker_main(job, results=type("Q", (), {"put": staticmethod(results.append)})())
        return results
    return run


def test_a_worker_runs_the_script_in_the_project_folder_with_torchruns_env(script_worker, tmp_path):
    script_worker("""
        import json, os, sys
        keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID"]
        json.dump({"env": {k: os.environ[k] for k in keys}, "cwd": os.getcwd(), "argv": sys.argv}, open("seen.json", "w"))
    """, ["--epochs", "2"])
    seen = json.loads((tmp_path / "project" / "seen.json").read_text())
    assert seen["cwd"] == str(tmp_path / "project")
    assert seen["argv"] == [str(tmp_path / "project" / "train.py"), "--epochs", "2"]
    assert seen["env"] == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                           "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "s"}


def test_the_lease_token_of_the_job_fences_the_scripts_saves(script_worker, tmp_path):
    """The driver's lease token reaches the script's session: a token the run's lease no longer holds (its
    driver was killed, another one took the run) commits nothing."""
    from ray_app.shared.errors import RunHeld
    from ray_app.shared.lease import RunLease, lease_store

    storage = LocalStorage(str(tmp_path / "runs"))
    holder = RunLease(lease_store(storage, "s"), storage.uri("s"), stale_s=30)
    holder.acquire()
    source = """
        from ray_app import script as kit
        kit.save({"epoch": 1})
    """
    script_worker(source, lease_token=holder.token)
    assert len(list_checkpoints(storage, "s")) == 1
    with pytest.raises(RunHeld, match="no longer held by this worker group's driver"):
        script_worker(source, lease_token="an-earlier-drivers-token")
    assert len(list_checkpoints(storage, "s")) == 1
    holder.release()


def test_an_exception_in_the_script_becomes_a_user_code_error(script_worker, tmp_path):
    with pytest.raises(UserCodeError) as exc:
        script_worker("""
            def check(lr):
                raise ValueError(f"lr={lr} is too large")

            if __name__ == "__main__":
                check(3.0)
        """)
    err = exc.value
    assert err.summary == "ValueError: lr=3.0 is too large"
    text = err.traceback_text
    assert text.startswith("Traceback (most recent call last):\n") and "in check" in text and "in <module>" in text
    assert "script.py" not in text and "runpy" not in text and "worker.py" not in text
    assert err.fingerprint.startswith("ValueError|lr=3.0 is too large|") and err.fingerprint.endswith("|step 0")
    assert worker._SHOWN_BY_THE_DRIVER.active


def test_a_collective_whose_peer_is_gone_is_a_lost_peer_not_the_scripts_error(script_worker):
    """What a surviving rank's all-reduce raises when another rank was killed (torch 2's gloo message):
    a restart of the group, not a bug in the script to be retried once and then shown."""
    from ray_app.shared.errors import PeerLost

    with pytest.raises(PeerLost, match=r"^rank 0 lost a peer: RuntimeError: \[/pytorch/third_party/gloo"):
        script_worker("""
            def all_reduce():
                raise RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed "
                                   "by peer [127.0.0.1]:9120")

            all_reduce()
        """)
    assert worker._SHOWN_BY_THE_DRIVER.active


def test_sys_exit_non_zero_fails_and_zero_ends_normally(script_worker):
    with pytest.raises(UserCodeError, match="SystemExit: 3"):
        script_worker("import sys\nsys.exit(3)\n")
    assert script_worker("import sys\nsys.exit(0)\nraise AssertionError('not reached')\n")[0]["saves"] == 0


def test_a_script_not_on_the_workers_node_is_bad_input(script_worker):
    with pytest.raises(ConfigError, match="SCRIPT other.py: not found on the worker"):
        script_worker("x = 1\n", job_script="other.py")  # the driver named a script this node does not have


# ---------------------------------------------------------------- the checkpoint API

@pytest.fixture
def session(tmp_path, saved_process_state):
    """A rank-0, one-rank session on a local folder; its reports are recorded."""
    runtime = FakeRuntime(LocalStorage(str(tmp_path / "runs")), "s", "sync")
    kit._SESSION = kit._Session(runtime.storage, "s", 0, 1, runtime.report)
    yield kit._SESSION, runtime
    kit._SESSION = None


def _state(value: float) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    with torch.no_grad():
        model.weight.fill_(value)
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": int(value), "note": None}


def test_save_commits_a_verified_checkpoint_and_load_returns_the_newest(session, tmp_path):
    s, runtime = session
    assert kit.load() is None  # a fresh start
    kit.save(_state(1.0))
    kit.save(_state(2.0))
    names = list_checkpoints(s.storage, "s")
    assert len(names) == 2 and s.last == s.storage.uri("s", names[-1])
    for name in names:
        v = verify(s.storage, f"s/{name}")
        assert v.ok and v.manifest["format"] == SCRIPT_FORMAT and set(v.manifest["files"]) == {"state.pt"}
    assert [r["script_saves"] for r in runtime.reports] == [1, 2] and runtime.reports[-1]["checkpoint"] == s.last
    direct = torch.load(tmp_path / "runs" / "s" / names[-1] / "state.pt", weights_only=True)
    loaded = kit.load()
    assert loaded["epoch"] == 2 and torch.equal(loaded["model"]["weight"], torch.full((2, 3), 2.0))
    assert loaded["optimizer"]["param_groups"] == direct["optimizer"]["param_groups"]
    assert s.progress == 2 and s.loaded == s.last


def test_a_broken_newest_checkpoint_is_skipped_and_numbering_goes_on_after_it(session, tmp_path, capsys):
    s, _ = session
    kit.save(_state(1.0))
    kit.save(_state(2.0))
    newest = tmp_path / "runs" / "s" / list_checkpoints(s.storage, "s")[-1]
    (newest / "state.pt").write_bytes(b"tampered")
    assert kit.load()["epoch"] == 1
    assert f"ray-app: skipped {s.storage.uri('s', newest.name)}: state.pt does not match its manifest" \
        in capsys.readouterr().out
    kit.save(_state(3.0))  # number 3: sorts after the broken number 2
    assert list_checkpoints(s.storage, "s")[-1].startswith("ckpt-s000000003-")
    assert kit.load()["epoch"] == 3


def test_a_save_commits_nothing_once_another_driver_holds_the_run(session, tmp_path):
    """``ray-app run`` gives its workers its lease token: once another driver has taken the run over (this
    one's was killed), the orphaned script's ``save`` commits nothing and leaves no folder."""
    from ray_app.shared.errors import RunHeld
    from ray_app.shared.lease import LEASE_FILE, RunLease, fence, lease_store

    s, _ = session
    first = RunLease(lease_store(s.storage, "s"), s.storage.uri("s"), stale_s=30)
    first.acquire()
    s.before_commit = fence(s.storage, "s", first.token)
    kit.save(_state(1.0))
    committed = list_checkpoints(s.storage, "s")
    assert len(committed) == 1
    (tmp_path / "runs" / "s" / LEASE_FILE).unlink()  # the first driver is gone; a second one takes the run
    second = RunLease(lease_store(s.storage, "s"), s.storage.uri("s"), stale_s=30)
    second.acquire()
    with pytest.raises(RunHeld, match="no longer held by this worker group's driver"):
        kit.save(_state(2.0))
    assert list_checkpoints(s.storage, "s") == committed
    second.release()


def test_other_ranks_only_report(session):
    s, runtime = session
    s.rank = 1
    kit.save(_state(1.0))
    assert runtime.reports == [{"script_saves": 1}] and list_checkpoints(s.storage, "s") == []


def test_outside_ray_app_run_save_checks_and_does_nothing_load_is_none(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert kit._SESSION is None
    kit.save(_state(1.0))
    assert kit.load() is None and list(tmp_path.iterdir()) == []
    with pytest.raises(TypeError):
        kit.save({"x": np.zeros(2)})


def test_the_loop_and_the_script_never_load_each_others_checkpoints(session):
    s, _ = session
    kit.save(_state(1.0))
    assert newest_good(s.storage, "s") is None  # the loop's format only
    name = list_checkpoints(s.storage, "s")[0]
    assert not verify(s.storage, f"s/{name}", fmt=FORMAT).ok and verify(s.storage, f"s/{name}").ok
    manifest = json.loads((Path(s.storage.uri("s", name)) / MANIFEST).read_text())
    assert manifest["global_step"] == 1 and manifest["epoch"] == 1  # the state's own epoch, for listings


def test_checkpoints_verify_works_on_a_scripts_run(session, run_cli, tmp_path):
    kit.save(_state(1.0))
    rc, out, err = run_cli(["checkpoints", "verify", str(tmp_path / "runs" / "s")], timeout=60)
    assert rc == 0 and "verified" in out, (out, err)


PLAIN = {"t": torch.ones(2), "p": torch.nn.Parameter(torch.zeros(1)), "i": 3, "f": 0.5, "b": True, "s": "x",
         "y": b"raw", "n": None, "l": [1, (2.0, "a")], "o": collections.OrderedDict(a=torch.zeros(1)),
         "dtype": torch.float16, "device": torch.device("cpu"), "size": torch.Size([2, 3]), 7: "int key",
         "rng": torch.get_rng_state()}


def test_what_check_plain_accepts_loads_with_weights_only(tmp_path):
    kit.check_plain(PLAIN)
    torch.save(PLAIN, tmp_path / "s.pt")
    back = torch.load(tmp_path / "s.pt", weights_only=True)
    assert back.keys() == PLAIN.keys() and back["size"] == torch.Size([2, 3])


@pytest.mark.parametrize("state, where", [
    ({"a": np.zeros(2)}, "state['a']"),
    ({"a": {"b": [1, np.float64(0.5)]}}, "state['a']['b'][1]"),
    ({"a": collections.namedtuple("P", "x")(1)}, "state['a']"),
    ({"m": torch.nn.Linear(1, 1)}, "state['m']"),
    ({"s": {1, 2}}, "state['s']"),
], ids=["numpy", "numpy-scalar", "namedtuple", "module", "set"])
def test_what_weights_only_would_refuse_is_refused_at_save_naming_the_entry(state, where, tmp_path):
    with pytest.raises(TypeError, match=rf"{where.replace('[', '.').replace(']', '.')} is a "):
        kit.check_plain(state)
    with pytest.raises(TypeError, match="must be a dict"):
        kit.check_plain([1, 2])
