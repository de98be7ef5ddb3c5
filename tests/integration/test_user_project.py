"""A user's own project (tests/support/user_project.py), outside the repository, on a real Ray.

- trained with the ``ray-app`` console script run from the project's folder (local Ray);
- ``ray-app eval`` of its checkpoint at 1, 2 and 3 workers equals a plain single-process PyTorch
  evaluation of the exported state_dict (padded duplicates dropped: 97 samples);
- resuming with a config its checkpoints cannot follow exits 2 before Ray starts; keys that may change do;
- bad plug-ins exit 2 with one line naming the key, before Ray starts where the driver can tell;
  what only a worker can find ends the run at once, shown once; a bug in the user's code is shown
  once with its traceback and not retried to the end of failure.max_failures;
- the same project through ``ray job submit --working-dir .`` to a ``ray start --head`` cluster with
  token auth (that cluster also serves the worker-side error runs).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.support.processes import run_cli
from tests.support.user_project import N_EVAL, write_project

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
LOCAL = {"RAY_ADDRESS": None}


def ray_app(args: list[str], cwd: Path, env: dict | None = None, timeout: float = 600):
    """The ``ray-app`` console script (not ``python -m``, which would put the folder on sys.path itself)."""
    return run_cli(args, env=env, timeout=timeout, cwd=cwd, console_script=True)


def summary_of(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    assert lines, stdout[-3000:]
    return json.loads(lines[-1])


def one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip() and "authentication_token_setup" not in ln]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return write_project(tmp_path_factory.mktemp("acme-project"), EXTRA_FILES)


@pytest.fixture(scope="module")
def trained(project):
    rc, out, err = ray_app(["train", "--config", "my.yaml"], project, LOCAL)
    assert rc == 0, f"{out[-3000:]}\n{err[-3000:]}"
    return summary_of(out)


def test_trains_from_its_own_folder_with_its_own_metrics(project, trained):
    assert trained["run"] == "acme-run" and trained["global_step"] == 3 * 10  # ceil(151 / 16) steps per epoch
    assert {"eval_hits", "eval_nll"} <= trained.keys() and "eval_accuracy" not in trained
    assert trained["num_eval_samples"] == N_EVAL
    assert 0.5 < trained["eval_hits"] <= 1.0
    ckpt = Path(trained["checkpoint"])
    assert ckpt.parent == project / "runs" / "acme-run" and (ckpt / "manifest.json").is_file()


def test_checkpoints_list_shows_the_tasks_metrics(project, trained):
    rc, out, err = ray_app(["checkpoints", "list", "runs/acme-run", "--json"], project)
    assert rc == 0, err
    newest = json.loads(out)[-1]
    assert newest["verified"] and newest["metrics"]["eval_hits"] == trained["eval_hits"]


@pytest.fixture(scope="module")
def reference(project, trained, tmp_path_factory):
    """Every metric computed in one process, in plain PyTorch, from the exported state_dict."""
    out = tmp_path_factory.mktemp("export") / "model.pt"
    rc, _, err = ray_app(["checkpoints", "export", trained["checkpoint"], "--out", str(out)], project)
    assert rc == 0, err
    with pytest.MonkeyPatch.context() as mp:  # the user's package, from its folder, for this import only
        mp.syspath_prepend(str(project))
        from acme.data import build
        from acme.model import Net
    _, ev, info = build(n_train=301, n_eval=97)
    model = Net(info["num_features"], info["num_classes"], hidden=24)
    model.load_state_dict(torch.load(out, weights_only=True))
    model.eval()
    with torch.no_grad():
        logits = model(ev.features)
    hits = int((logits.argmax(1) == ev.label).sum())
    nll = F.cross_entropy(logits, ev.label, reduction="none").double().mean().item()
    return {"hits": hits, "nll": nll, "n": len(ev)}


# 3 ranks over 301 samples: uneven shards and padding, through Ray with the project's own metrics; 1, 2 and 3
# ranks on real gloo groups are the unit tier's (test_loop_ddp.py), 2 through Ray test_train_local.py's
@pytest.mark.parametrize("workers", [3])
def test_eval_at_any_world_size_equals_a_single_process_evaluation(project, trained, reference, workers):
    rc, out, err = ray_app(["eval", "--checkpoint", trained["checkpoint"], "--set", f"scaling.num_workers={workers}",
                            "--set", "scaling.cpus_per_worker=0.5"], project, LOCAL)
    assert rc == 0, f"{out[-3000:]}\n{err[-3000:]}"
    result = summary_of(out)
    assert result["world_size"] == workers and result["num_samples"] == reference["n"] == N_EVAL
    assert round(result["eval_hits"] * N_EVAL) == reference["hits"]  # counts exactly
    assert result["eval_hits"] == pytest.approx(reference["hits"] / N_EVAL, abs=1e-12)
    assert result["eval_nll"] == pytest.approx(reference["nll"], abs=1e-6)


# ---------------------------------------------------------------- resuming with another config

@pytest.mark.parametrize("overrides, keys", [
    (["model.args.hidden=32"], ["model.args"]),
    (["task.name=classification", "task.args={}"], ["task.name", "task.args"]),
    (["data.args.n_train=200", "data.batch_size=8"], ["data.args", "data.batch_size"]),
], ids=["model-args", "task", "data"])
def test_resuming_with_a_config_the_checkpoint_cannot_follow_exits_2(project, trained, overrides, keys):
    args = ["train", "--config", "my.yaml"] + [x for o in overrides for x in ("--set", o)]
    rc, out, err = ray_app(args, project, LOCAL, timeout=120)
    assert rc == 2, f"{out[-2000:]}\n{err[-2000:]}"
    line = one_error_line(err)
    assert all(k in line for k in keys) and "run.name" in line and "run.resume_from" in line, line
    assert "Token authentication" not in out + err  # Ray never started


def test_resuming_with_more_epochs_and_a_new_lr_continues(project, trained):
    rc, out, err = ray_app(["train", "--config", "my.yaml", "--set", "train.epochs=4", "--set", "train.lr=0.02"],
                           project, LOCAL)
    assert rc == 0, f"{out[-3000:]}\n{err[-3000:]}"
    again = summary_of(out)
    assert again["resumed_from_step"] == trained["global_step"] and again["global_step"] == 40


# ---------------------------------------------------------------- bad input, before Ray starts

EXTRA_FILES = {
    "digits.yaml": "run: {name: digits-here}\nmetrics: {enabled: false}\n",
    "acme/broken_syntax.py": "def Net(:\n    pass\n",
    "acme/odd.py": '''
        import torch

        from acme.data import Points, build

        CONSTANT = 3


        class NoEval:
            def loss(self, model, batch):
                return model(batch["features"]).sum(), 1


        def needs_root(root, n_eval=97):
            return build()


        def single(**kwargs):
            return build(**kwargs)[0]


        class ShortEval:
            def loss(self, model, batch):
                import torch.nn.functional as F
                return F.cross_entropy(model(batch["features"]), batch["label"]), batch["label"].shape[0]

            def evaluate(self, model, batch):
                return {"hits": torch.ones(3)}


        class Broken(torch.nn.Module):
            def __init__(self, num_features, num_classes):
                super().__init__()
                self.linear = torch.nn.Linear(num_features, num_classes)

            def forward(self, x):
                if not self.training:
                    raise ValueError(f"no eval for {x.shape[0]} rows")
                return self.linear(x)
    ''',
}

BEFORE_RAY = [  # (config file, --set ..., the key the line names, a hint it gives)
    ("my.yaml", ["model.name=acme.modl:Net"], "config key model.name", "acme.modl"),
    ("my.yaml", ["model.name=acme.model:Nett"], "config key model.name", "Net"),
    ("my.yaml", ["model.name=acme.odd:CONSTANT"], "config key model.name", "not a class or function"),
    ("my.yaml", ["model.args.widht=3"], "config key model.args.widht", "hidden"),
    ("my.yaml", ["task.name=acme.odd:NoEval", "task.args={}"], "config key task.name", "evaluate"),
    ("my.yaml", ["data.name=acme.odd:needs_root", "data.args={}"], "config key data.args.root", "root"),
    ("my.yaml", ["model.name=acme.broken_syntax:Net"], "config key model.name", "SyntaxError"),
    ("my.yaml", ["model.name=acme.model:Net(hidden)"], "config key model.name", "import path"),
    ("my.yaml", ["data.path=/data"], "config key data.path", "no path argument"),
    ("digits.yaml", ["model.name=resnet18"], "config key model.name", "3-channel"),
    ("digits.yaml", ["data.name=cifar10", "data.path=/etc"], "config key data.path", "cifar-10-batches-py"),
    ("digits.yaml", ["data.name=imagefolder", "data.path=."], "config key data.path", "train/"),
    ("digits.yaml", ["data.name=synthetic", "data.args.num_sample=3"], "config key data.args.num_sample", "num_samples"),
    ("digits.yaml", ["data.name=mnist"], "config key data.name", "digits"),
]


@pytest.mark.parametrize("config, overrides, key, hint", BEFORE_RAY,
                         ids=[f"{c.split('.')[0]}-{o[0].split('=')[1][:24]}" for c, o, _, _ in BEFORE_RAY])
def test_bad_plug_in_exits_2_with_one_line_before_ray_starts(project, config, overrides, key, hint):
    args = ["train", "--config", config, "--set", "run.name=bad-input"]
    rc, out, err = ray_app(args + [x for o in overrides for x in ("--set", o)], project, LOCAL, timeout=120)
    assert rc == 2, f"{out[-2000:]}\n{err[-2000:]}"
    line = one_error_line(err)
    assert line.startswith(f"ray-app: error: {key}") and hint in line, line
    assert "Token authentication" not in out + err  # Ray never started
    assert not (project / "runs" / "bad-input").exists()


# ---------------------------------------------------------------- a cluster: job submit, worker-side errors

def test_ray_job_submit_with_the_working_dir(project, ray_head, tmp_path):
    storage = tmp_path / "job-runs"
    entry = ["ray-app", "train", "--config", "my.yaml", "--set", f"run.storage={storage}", "--set", "run.name=acme-job"]
    p = subprocess.run([str(BIN / "ray"), "job", "submit", "--address", ray_head["jobs"], "--working-dir", ".",
                        "--", *entry], cwd=project, env=ray_head["env"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    result = summary_of(p.stdout)
    assert result["num_eval_samples"] == N_EVAL and 0.5 < result["eval_hits"] <= 1.0
    assert Path(result["checkpoint"]).parent == storage / "acme-job"


def _on_cluster(project, ray_head, run: str, overrides: list[str]):
    env = {**ray_head["env"], "RAY_ADDRESS": ray_head["gcs"]}
    args = ["train", "--config", "my.yaml", "--set", f"run.name={run}", "--set", "failure.max_failures=3"]
    return ray_app(args + [x for o in overrides for x in ("--set", o)], project, env)


@pytest.mark.parametrize("overrides, needle", [
    (["data.name=acme.odd:single"], "config key data.name: acme.odd:single returned a Points"),
    (["task.name=acme.odd:ShortEval", "task.args={}"], "of shape (3,); each value must be a per-sample tensor"),
], ids=["factory-shape", "eval-length"])  # a data set without __len__: tests/unit/test_plugins.py
def test_what_only_a_worker_finds_ends_the_run_at_once_shown_once(project, ray_head, overrides, needle):
    rc, out, err = _on_cluster(project, ray_head, "worker-finds", overrides)
    assert rc == 2, f"{out[-3000:]}\n{err[-3000:]}"
    line = one_error_line(err)
    assert needle in line, line
    assert (out + err).count(needle) == 1  # not once per worker and restart
    assert "Traceback" not in out + err


def test_a_bug_in_user_code_is_shown_once_with_its_traceback_and_not_retried_to_the_end(project, ray_head):
    rc, out, err = _on_cluster(project, ray_head, "user-bug", ["model.name=acme.odd:Broken", "model.args={}"])
    assert rc == 1, f"{out[-3000:]}\n{err[-3000:]}"
    text = out + err
    # the first attempt's restart line naming it, then the traceback once and the last line
    assert text.count("Traceback") == 1 and text.count("ValueError: no eval for") == 3
    assert text.count("ray-app: rank 0 raised in your code at step ") == 2  # the restart line, the traceback's head
    assert "acme/odd.py" in err and "in forward" in err and "ray_app/worker/entry.py" not in err
    # failure.max_failures=3, but the second attempt failed at the same place and step: a bug, not a fault
    assert text.count("rank 0/2 on host") == 2
    assert err.strip().splitlines()[-1].startswith("ray-app: training failed: ValueError: no eval for")
