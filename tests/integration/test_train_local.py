"""`ray-app train` / `eval` / `checkpoints` on a real local Ray, the way `make train` runs them.

Three Ray runs in all (train, eval, resume), about 30-40 s each.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import checkpoint_model
from tests.support.evaluation import default_model_eval

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SUMMARY_KEYS = {"run", "checkpoint", "epochs", "global_step", "train_loss", "eval_accuracy", "train_seconds",
                "resumed_from_step", "checkpoints_written", "checkpoint_blocked_seconds", "timeline"}
DIGITS_EVAL = 359
STEPS = 10 * 23  # 10 epochs x ceil(719 / 32) batches per rank
LOCAL_ENV = {"RAY_ADDRESS": None}  # always a fresh local Ray, never someone's cluster


def last_json(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    assert lines, "no output"
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def train(run_cli, port_picker):
    def run(storage: Path, timeout: float = 600):
        # like `make train`: the default relative ./runs, resolved against the user's working directory
        # (Ray workers run elsewhere), so the command runs from the storage folder's parent
        return run_cli(["train", "--config", str(REPO / "configs" / "local.yaml"), "--set", f"run.storage=./{storage.name}",
                        "--set", f"metrics.port={port_picker()}"], env=LOCAL_ENV, timeout=timeout, cwd=storage.parent)
    return run


@pytest.fixture(scope="module")
def trained(tmp_path_factory, train):
    storage = tmp_path_factory.mktemp("storage")
    rc, out, err = train(storage)
    assert rc == 0, f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    return storage, last_json(out), out


def test_default_config_trains_digits_to_95_percent(trained):
    storage, summary, out = trained
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["run"] == "digits-ddp"
    assert summary["epochs"] == 10 and summary["global_step"] == STEPS
    assert summary["eval_accuracy"] >= 0.95
    assert summary["resumed_from_step"] == 0
    assert 0 < summary["train_loss"] < 0.5 and summary["train_seconds"] > 0
    assert summary["checkpoints_written"] == 10 and summary["checkpoint_blocked_seconds"] > 0  # every epoch
    # one progress report per epoch from rank 0, not one per rank
    for epoch in range(10):
        assert sum(f"epoch {epoch} done:" in ln for ln in out.splitlines()) == 1, epoch
    # every rank's pace: an even run on a loaded 2-core machine names no rank
    assert [ln for ln in out.splitlines() if "straggler:" in ln] == []


def test_summary_checkpoint_is_committed_under_the_storage_dir(trained):
    from ray_app.shared.catalog import verify
    from ray_app.shared.storage import LocalStorage

    storage, summary, _ = trained
    ckpt = Path(summary["checkpoint"])
    assert ckpt.is_dir() and ckpt.parent == storage / "digits-ddp"
    assert (ckpt / "manifest.json").is_file()
    v = verify(LocalStorage(str(storage)), f"digits-ddp/{ckpt.name}")
    assert v.ok, v.reason
    assert v.manifest["global_step"] == STEPS


def test_checkpoints_list_and_verify(trained, run_cli):
    storage, summary, _ = trained
    run_uri = str(storage / "digits-ddp")
    rc, out, err = run_cli(["checkpoints", "list", run_uri], timeout=120)
    assert rc == 0, err
    assert Path(summary["checkpoint"]).name in out and "NOT VERIFIED" not in out
    assert len([ln for ln in out.splitlines() if ln.startswith("ckpt-s")]) <= 3  # checkpoint.keep
    rc, _, err = run_cli(["checkpoints", "verify", run_uri], timeout=120)
    assert rc == 0, err


def test_eval_equals_a_single_process_evaluation_of_the_export(trained, tmp_path, run_cli):
    _, summary, _ = trained
    rc, out, err = run_cli(["eval", "--checkpoint", summary["checkpoint"]], env=LOCAL_ENV, timeout=600)
    assert rc == 0, f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    result = last_json(out)
    assert result["num_samples"] == DIGITS_EVAL
    assert result["checkpoint"] == summary["checkpoint"]

    exported = tmp_path / "model.pt"
    rc, _, err = run_cli(["checkpoints", "export", summary["checkpoint"], "--out", str(exported)], timeout=120)
    assert rc == 0, err
    accuracy, loss = default_model_eval(torch.load(exported, weights_only=True))
    assert result["eval_accuracy"] == accuracy
    assert result["eval_accuracy"] == summary["eval_accuracy"]
    assert result["eval_loss"] == pytest.approx(loss, rel=1e-5)


def test_training_the_same_run_again_resumes(trained, train):
    """A run whose last epoch is done, run again: one line saying it is complete, its summary from the
    newest checkpoint, and no Ray started for nothing."""
    storage, first, _ = trained
    rc, out, err = train(storage)
    assert rc == 0, f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    assert f"is complete: {first['checkpoint']} is at epoch" in err and "Token authentication" not in out + err, err
    again = last_json(out)
    assert again["resumed_from_step"] == STEPS
    assert again["global_step"] == first["global_step"]
    assert again["checkpoint"] == first["checkpoint"]
    assert again["eval_accuracy"] == first["eval_accuracy"]
    assert again["train_seconds"] < max(first["train_seconds"] / 3, 5.0)


@pytest.mark.timeout(300)
def test_a_diverging_run_ends_with_one_line_and_exit_1(run_cli, tmp_path, port_picker):
    """`--set train.lr=1e6` (what a user tries): the run stops at the step its loss turns non-finite, exit 1,
    one line naming that step, no traceback; no checkpoint it left holds a non-finite parameter. With
    `checkpoint.keep=1` and a checkpoint every step, the newest good one survives the divergence and the
    line names it."""
    rc, out, err = run_cli(["train", "--set", f"run.storage={tmp_path}", "--set", "run.name=diverge",
                            "--set", "train.lr=1e6", "--set", "train.epochs=1", "--set", "checkpoint.every_steps=1",
                            "--set", "checkpoint.keep=1", "--set", f"metrics.port={port_picker()}"],
                           env=LOCAL_ENV, timeout=240)
    assert rc == 1, f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    last = err.strip().splitlines()[-1]
    assert last.startswith("ray-app: training failed: training diverged at step "), err[-3000:]
    assert "Traceback" not in out + err and err.count("training diverged") == 1, err[-3000:]
    for manifest in (tmp_path / "diverge").glob("ckpt-s*/manifest.json"):
        state = checkpoint_model(str(manifest.parent))
        assert all(bool(torch.isfinite(t).all()) for t in state.values()), manifest
    diverged_at = int(last.split("training diverged at step ")[1].split(":")[0])
    committed = [m.parent for m in (tmp_path / "diverge").glob("ckpt-s*/manifest.json")]
    assert len(committed) == 1 and f"newest good checkpoint: {committed[0]}" in last, (committed, last)
    assert int(committed[0].name.removeprefix("ckpt-s").split("-")[0]) < diverged_at, (committed, last)
    rc, out, err = run_cli(["runs", "show", str(tmp_path / "diverge"), "--json"], env=LOCAL_ENV, timeout=60)
    assert rc == 0, err
    events = json.loads(out)["events"]
    diverged = [e for e in events if e["kind"] == "diverged"]
    assert len(diverged) == 1 and diverged[0]["cause"].startswith(f"training diverged at step {diverged_at}"), diverged
    assert (events[-1]["kind"], events[-1]["exit_code"], events[-1]["line"]) == ("end", 1, last), events[-1]


@pytest.mark.timeout(180)
def test_a_cluster_too_small_exits_2_and_leaves_no_ray_running(run_cli, tmp_path):
    """More workers than this machine has CPUs: found once Ray is up (exit 2, one line naming the keys), and
    the local Ray the command started stops with it (no process of it is left)."""
    import secrets

    from tests.support.processes import MARKER, processes_marked

    marker = secrets.token_hex(8)  # in the environment of the driver and of every Ray process it starts
    rc, out, err = run_cli(["train", "--set", f"run.storage={tmp_path}", "--set", "scaling.num_workers=64"],
                           env={**LOCAL_ENV, MARKER: marker}, timeout=150)
    assert rc == 2, f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    assert err.strip().splitlines()[-1].startswith("ray-app: error: config key scaling.num_workers=64"), err[-2000:]
    left = processes_marked(marker)
    assert not left, [" ".join(p.cmdline())[:120] for p in left]
