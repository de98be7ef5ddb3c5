"""examples/: users' projects of their own, run from their folders with the ``ray-app`` console script.

- char_lm (a small GPT on CPython's help text, task language_model) trains to an eval loss below
  EVAL_LOSS_BOUND; stopped mid-epoch (train.max_steps) and resumed, its final parameters are
  bit-identical to the uninterrupted run's.
- regression (an MLP on scikit-learn's diabetes data, task regression) reaches EVAL_MSE_BOUND.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.processes import run_cli

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EVAL_LOSS_BOUND = 1.8  # nats per character; unigram entropy of the text is 3.25, the runs tuned reach ~1.47
EVAL_MSE_BOUND = 0.65  # standardized target; predicting the mean gives 1.04, linear regression 0.52
STOP_AT = 300  # mid-epoch: 207 steps per epoch at 2 workers


def ray_app(args: list[str], cwd: Path, timeout: float = 900) -> dict:
    rc, out, err = run_cli(args, env={"RAY_ADDRESS": None}, timeout=timeout, cwd=cwd, console_script=True)
    assert rc == 0, f"{out[-3000:]}\n{err[-3000:]}"
    return json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])


def exported(checkpoint: str, out: Path) -> dict:
    rc, _, err = run_cli(["checkpoints", "export", checkpoint, "--out", str(out)])
    assert rc == 0, err
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def char_lm(tmp_path_factory):
    storage = tmp_path_factory.mktemp("char-lm")
    common = ["train", "--config", "char_lm.yaml", "--set", f"run.storage={storage}", "--set", "metrics.enabled=false"]
    folder = EXAMPLES / "char_lm"
    full = ray_app(common + ["--set", "run.name=full"], folder)
    stopped = ray_app(common + ["--set", "run.name=stopped", "--set", f"train.max_steps={STOP_AT}"], folder)
    resumed = ray_app(common + ["--set", "run.name=stopped"], folder)
    return storage, full, stopped, resumed


def test_char_lm_learns_the_text(char_lm):
    _, full, _, _ = char_lm
    assert full["eval_loss"] < EVAL_LOSS_BOUND, full
    assert full["eval_perplexity"] == pytest.approx(2.718281828459045 ** full["eval_loss"], rel=1e-9)
    assert full["num_eval_samples"] > 0 and full["epochs"] == 4


def test_char_lm_stopped_mid_epoch_and_resumed_is_bit_identical(char_lm, tmp_path):
    _, full, stopped, resumed = char_lm
    assert stopped["global_step"] == STOP_AT and STOP_AT % 207 != 0
    assert resumed["resumed_from_step"] == STOP_AT and resumed["global_step"] == full["global_step"]
    a = exported(full["checkpoint"], tmp_path / "full.pt")
    b = exported(resumed["checkpoint"], tmp_path / "resumed.pt")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert resumed["eval_loss"] == full["eval_loss"]


def test_regression_reaches_the_stated_mse(tmp_path):
    summary = ray_app(["train", "--config", "regression.yaml", "--set", f"run.storage={tmp_path}",
                       "--set", "metrics.enabled=false"], EXAMPLES / "regression")
    assert summary["eval_mse"] < EVAL_MSE_BOUND, summary
    assert summary["eval_mae"] < 0.70 and summary["num_eval_samples"] == 89
