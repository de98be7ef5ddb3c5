"""`python -m ray_app` as a user runs it: exit codes, one-line errors, help, checkpoint commands.

No Ray is started here: every command either fails on bad input before Ray
or only reads checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import tiny_payload, write_checkpoint, write_single_file_dir

REPO = Path(__file__).resolve().parents[2]
LOCAL_YAML = str(REPO / "configs" / "local.yaml")


def one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def make_checkpoint(storage_root: Path, run: str = "r1", step: int = 7) -> Path:
    """A real committed checkpoint of a tiny model under storage_root/run/."""
    return write_checkpoint(storage_root / run, step, metrics={"eval_accuracy": 0.5, "global_step": step})


@pytest.mark.parametrize("overrides, key", [
    (["train.epoch=3"], "train.epoch"),
    (["bogus.key=1"], "bogus"),
    (["train.epochs=abc"], "train.epochs"),
    (["train.epochs=-1"], "train.epochs"),
    (["data.batch_size=0"], "data.batch_size"),
    (["scaling.use_gpu=maybe"], "scaling.use_gpu"),
    (["metrics.port=70000"], "metrics.port"),
    (["train.optimizer=rmsprop"], "train.optimizer"),
    (["data.name=mnist"], "data.name"),
    (["data.name=imagefolder"], "data.path"),
    (["run.storage=gs://b/p"], "run.storage"),
    (["run.storage=s3://"], "run.storage"),
    (["train.epochs"], "train.epochs"),
    (["model.args=5"], "model.args"),
    (["model.args.widht=3"], "model.args.widht"),      # digits_cnn takes no such argument
    (["model.name=no_such_pkg.model:Net"], "model.name"),  # a plug-in that cannot be imported
    (["task.name=nope"], "task.name"),
    (["data.name=digits", "data.path=/data"], "data.path"),  # digits reads no folder
    (["train.precision=fp16"], "train.precision"),
    (["train.activation_checkpointing=some"], "train.activation_checkpointing"),
    (["train.amp=true", "train.precision=fp32"], "train.amp"),  # the deprecated key, disagreeing
    # bf16 weights: lr x weight_decay = 1e-4 < 2^-8 rounds away in each step's decay (tests/unit/test_precision.py)
    (["train.precision=bf16", "train.optimizer=adamw", "train.lr=0.001", "train.weight_decay=0.1"],
     "train.weight_decay"),
    (["train.peak_tflops=-1"], "train.peak_tflops"),
])
def test_bad_config_exits_2_with_one_line_and_creates_nothing(run_cli, tmp_path, overrides, key):
    args = ["train", "--config", LOCAL_YAML]
    for o in overrides:
        args += ["--set", o]
    rc, out, err = run_cli(args, cwd=tmp_path, timeout=60)
    assert rc == 2, (out, err)
    line = one_error_line(err)
    assert key in line and line.startswith("ray-app: error:")
    assert out == ""
    assert not (tmp_path / "runs").exists()
    assert list(tmp_path.iterdir()) == []


def test_unknown_model_exits_2_before_ray(run_cli, tmp_path):
    rc, out, err = run_cli(["train", "--config", LOCAL_YAML, "--set", "model.name=resnet9000",
                            "--set", f"run.storage={tmp_path / 'runs'}"], cwd=tmp_path, timeout=60)
    assert rc == 2
    assert "model.name" in one_error_line(err)
    assert not (tmp_path / "runs" / "digits-ddp").exists()


def test_user_plugins_are_found_from_the_project_folder(run_cli, tmp_path):
    """`ray-app preflight` run from the user's project folder imports their plug-ins (like python -m)."""
    (tmp_path / "acme_proj").mkdir()
    (tmp_path / "acme_proj" / "__init__.py").write_text("")
    (tmp_path / "acme_proj" / "model.py").write_text(
        "from torch import nn\n\n\nclass Net(nn.Module):\n"
        "    def __init__(self, num_classes, hidden=8):\n        super().__init__()\n")
    args = ["preflight", "--set", "model.name=acme_proj.model:Net", "--set", "run.storage=runs"]
    rc, out, err = run_cli([*args, "--set", "model.args.hidden=4"], cwd=tmp_path, env={"RAY_ADDRESS": None},
                           timeout=120)
    assert rc == 0, err
    assert "config ok" in out and "acme_proj.model:Net" in out
    rc, out, err = run_cli([*args, "--set", "model.args.hiden=4"], cwd=tmp_path, env={"RAY_ADDRESS": None},
                           timeout=120)
    assert rc == 2
    line = one_error_line(err)
    assert "config key model.args.hiden" in line and "num_classes, hidden" in line


def test_malformed_yaml_exits_2(run_cli, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  epochs: [3\n")
    rc, _, err = run_cli(["train", "--config", str(bad)], cwd=tmp_path, timeout=60)
    assert rc == 2
    assert str(bad) in one_error_line(err)


@pytest.mark.parametrize("command", ["train", "preflight"])
def test_a_key_given_twice_exits_2_naming_file_key_and_lines(run_cli, tmp_path, command):
    dup = tmp_path / "dup.yaml"
    dup.write_text("train:\n  epochs: 2\n  epochs: 0\n")  # were the first one dropped, 0 would fail another way
    rc, out, err = run_cli([command, "--config", str(dup)], cwd=tmp_path, timeout=60)
    assert rc == 2, (out, err)
    line = one_error_line(err)
    assert str(dup) in line and "train.epochs" in line and "lines 2 and 3" in line
    assert out == "" and sorted(p.name for p in tmp_path.iterdir()) == ["dup.yaml"]


def test_a_config_that_is_not_utf8_exits_2(run_cli, tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("run:\n  name: caf".encode() + b"\xe9\n")
    rc, _, err = run_cli(["train", "--config", str(bad)], cwd=tmp_path, timeout=60)
    assert rc == 2
    line = one_error_line(err)
    assert str(bad) in line and "byte 16" in line and "UTF-8" in line


def test_missing_config_file_exits_2(run_cli, tmp_path):
    rc, out, err = run_cli(["train", "--config", str(tmp_path / "nope.yaml")], cwd=tmp_path, timeout=60)
    assert rc == 2
    line = one_error_line(err)
    assert "nope.yaml" in line and "no such file" in line


def test_unknown_option_exits_2_without_traceback(run_cli):
    rc, _, err = run_cli(["train", "--epochs", "3"], timeout=60)
    assert rc == 2
    assert "Traceback" not in err and "--epochs" in err


def test_help_lists_the_commands(run_cli):
    rc, out, err = run_cli(["--help"], timeout=60)
    assert rc == 0, err
    for cmd in ("train", "eval", "checkpoints", "preflight", "config"):
        assert cmd in out


def _commands() -> set[str]:
    """Every command of the parser: `train`, `checkpoints list`, `config schema`, ..."""
    import argparse

    from ray_app.driver.cli import build_parser

    def subcommands(parser) -> dict:
        return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})

    out = set()
    for name, parser in subcommands(build_parser()).items():
        out |= {f"{name} {action}" for action in subcommands(parser)} or {name}
    return out


def test_readme_command_line_lists_every_command():
    readme = (REPO / "README.md").read_text()
    block = readme.split("\n## Command line\n", 1)[1].split("```", 2)[1]
    documented = set()
    for line in block.splitlines():
        words = line.split("#")[0].split()
        if words[:1] == ["ray-app"]:
            documented |= {f"{words[1]} {a}" for a in words[2].split("|")} if words[1] in ("checkpoints", "config", "data", "runs") \
                else {words[1]}
    assert documented == _commands()


def test_config_keys_lists_every_key_with_its_default(run_cli):
    from ray_app.driver.config_reference import describe_keys, format_default, keys_markdown

    rc, out, err = run_cli(["config", "keys"], timeout=60)
    assert rc == 0, err
    lines = out.splitlines()
    assert len(lines) == len(describe_keys())
    for line, (key, typ, default, help_text) in zip(lines, describe_keys()):
        assert line.split()[:3] == [key, typ, format_default(default)] and line.endswith(help_text)
    rc, out, _ = run_cli(["config", "keys", "--markdown"], timeout=60)
    assert rc == 0 and out == keys_markdown()


def test_train_help_lists_config_and_set(run_cli):
    rc, out, _ = run_cli(["train", "--help"], timeout=60)
    assert rc == 0
    assert "--config" in out and "--set" in out and "--summary" in out


def test_version(run_cli):
    rc, out, _ = run_cli(["--version"], timeout=60)
    assert rc == 0 and out.startswith("ray-app ")


@pytest.mark.parametrize("action", ["list", "verify", "export"])
def test_checkpoint_commands_on_missing_run_exit_2(run_cli, tmp_path, action):
    args = ["checkpoints", action, str(tmp_path / "runs" / "no-such-run")]
    if action == "export":
        args += ["--out", str(tmp_path / "model.pt")]
    rc, _, err = run_cli(args, timeout=60)
    assert rc == 2
    assert "no-such-run" in one_error_line(err)
    assert not (tmp_path / "model.pt").exists()


def test_eval_of_missing_checkpoint_exits_2(run_cli, tmp_path):
    rc, _, err = run_cli(["eval", "--checkpoint", str(tmp_path / "runs" / "no-such-run")], timeout=120)
    assert rc == 2
    assert "no-such-run" in one_error_line(err)


def test_checkpoints_list_verify_export_on_a_good_run(run_cli, tmp_path):
    ckpt = make_checkpoint(tmp_path / "runs")
    run_uri = str(tmp_path / "runs" / "r1")
    rc, out, err = run_cli(["checkpoints", "list", run_uri], timeout=60)
    assert rc == 0, err
    assert ckpt.name in out and "verified" in out and "step 7" in out and "eval_accuracy 0.5" in out
    rc, out, err = run_cli(["checkpoints", "list", run_uri, "--json"], timeout=60)
    rows = json.loads(out)
    assert [r["name"] for r in rows] == [ckpt.name] and rows[0]["verified"] is True
    rc, _, err = run_cli(["checkpoints", "verify", run_uri], timeout=60)
    assert rc == 0, err
    out_file = tmp_path / "exported.pt"
    rc, out, err = run_cli(["checkpoints", "export", run_uri, "--out", str(out_file)], timeout=60)
    assert rc == 0, err
    exported = torch.load(out_file, weights_only=True)
    expected = tiny_payload(7).model
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[k], expected[k]) for k in expected)
    assert json.loads(out.splitlines()[-1])["global_step"] == 7


def test_export_refuses_to_overwrite(run_cli, tmp_path):
    make_checkpoint(tmp_path / "runs")
    out_file = tmp_path / "model.pt"
    out_file.write_bytes(b"precious")
    rc, _, err = run_cli(["checkpoints", "export", str(tmp_path / "runs" / "r1"), "--out", str(out_file)],
                         timeout=60)
    assert rc == 2
    assert str(out_file) in one_error_line(err) and "--force" in err
    assert out_file.read_bytes() == b"precious"
    rc, _, err = run_cli(["checkpoints", "export", str(tmp_path / "runs" / "r1"), "--out", str(out_file),
                          "--force"], timeout=60)
    assert rc == 0, err
    assert out_file.read_bytes() != b"precious"
    assert "weight" in torch.load(out_file, weights_only=True)


def test_verify_of_a_tampered_checkpoint_exits_2(run_cli, tmp_path):
    ckpt = make_checkpoint(tmp_path / "runs")
    data = bytearray((ckpt / "model.pt").read_bytes())
    data[-10] ^= 0xFF
    (ckpt / "model.pt").write_bytes(bytes(data))
    rc, out, err = run_cli(["checkpoints", "verify", str(tmp_path / "runs" / "r1")], timeout=60)
    assert rc == 2
    assert "model.pt" in out and "NOT VERIFIED" in out
    assert "failed verification" in one_error_line(err)
    rc, _, err = run_cli(["checkpoints", "export", str(ckpt), "--out", str(tmp_path / "m.pt")], timeout=60)
    assert rc == 2
    assert "model.pt" in one_error_line(err)
    assert not (tmp_path / "m.pt").exists()


def _newest_with_a_changed_scheduler(runs: Path, sets: list[str]) -> tuple[str, str]:
    """Two checkpoints of run r1 as the kit writes them, both at epoch 1 with the config ``sets`` gives; the
    newer one's scheduler.pt (a file eval and export do not load) with a changed byte. Returns their URIs."""
    from ray_app.shared.config import load_config
    from ray_app.shared.storage import LocalStorage
    from ray_app.worker.checkpoint import Checkpointer
    from tests.support.checkpoints import save_tiny_shards

    storage = LocalStorage(str(runs))
    config = load_config(None, sets).to_dict()
    cp = Checkpointer(storage, "r1", lambda metrics, local_dir, dir_name, upload: upload and upload(local_dir, dir_name))
    old, new = (save_tiny_shards(cp, step, seed=step, config=config)[0] for step in (4, 8))
    path = runs / "r1" / new / "scheduler.pt"
    data = bytearray(path.read_bytes())
    data[-30] ^= 0x01
    path.write_bytes(bytes(data))
    return storage.uri("r1", old), storage.uri("r1", new)


SKIPPED = "ray-app: skipped {}: scheduler.pt does not match its manifest (sha256)"


@pytest.mark.timeout(120)
def test_export_skips_the_checkpoint_verify_rejects_and_says_so_once(run_cli, tmp_path):
    old, new = _newest_with_a_changed_scheduler(tmp_path / "runs", [])
    rc, _, err = run_cli(["checkpoints", "verify", str(tmp_path / "runs" / "r1")], timeout=60)
    assert rc == 2, err
    rc, out, err = run_cli(["checkpoints", "export", str(tmp_path / "runs" / "r1"), "--out", str(tmp_path / "m.pt")],
                           timeout=60)
    assert rc == 0, err
    assert json.loads(out.splitlines()[-1])["checkpoint"] == old
    assert [ln for ln in err.splitlines() if ln.strip()] == [SKIPPED.format(new)]


@pytest.mark.timeout(120)
def test_train_of_a_finished_run_whose_newest_checkpoint_is_damaged_names_the_older_one(run_cli, tmp_path):
    """`ray-app train` on a run whose checkpoints already end it: its "complete" check takes the newest
    checkpoint that verifies, says which it skipped, and starts no Ray."""
    sets = [f"run.storage={tmp_path / 'runs'}", "run.name=r1", "train.epochs=1"]
    old, new = _newest_with_a_changed_scheduler(tmp_path / "runs", sets)
    rc, out, err = run_cli(["train", *[a for s in sets for a in ("--set", s)]], env={"RAY_ADDRESS": None}, timeout=120)
    assert rc == 0, err
    assert json.loads(out.splitlines()[-1])["checkpoint"] == old
    assert err.count(SKIPPED.format(new)) == 1, err
    assert f"is complete: {old} is at epoch 1" in err and "Token authentication" not in out + err


def test_checkpoints_list_shows_every_eval_metric_of_the_task(run_cli, tmp_path):
    ckpt = make_checkpoint(tmp_path / "runs")
    metrics = {"global_step": 7, "train_loss": 0.5, "eval_mse": 0.123456, "eval_mae": 0.25, "other": 1}
    (ckpt / "metrics.json").write_text(json.dumps(metrics))
    # re-commit: the manifest must list the new metrics.json
    write_single_file_dir(ckpt, tiny_payload(7, metrics=metrics))
    rc, out, err = run_cli(["checkpoints", "list", str(tmp_path / "runs" / "r1")], timeout=60)
    assert rc == 0, err
    assert "eval_mse 0.1235" in out and "eval_mae 0.25" in out and "eval_accuracy" not in out
    assert "other" not in out and "verified" in out
    rc, out, _ = run_cli(["checkpoints", "list", str(tmp_path / "runs" / "r1"), "--json"], timeout=60)
    assert json.loads(out)[0]["metrics"] == {"train_loss": 0.5, "eval_mse": 0.123456, "eval_mae": 0.25}


class _DenyingS3:
    """An S3 endpoint on 127.0.0.1 that refuses every request as S3 refuses an unknown access key."""

    BODY = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InvalidAccessKeyId</Code><Message>The AWS '
            b'Access Key Id you provided does not exist in our records.</Message></Error>')

    def __enter__(self):
        import http.server
        import threading

        body = self.BODY

        class Handler(http.server.BaseHTTPRequestHandler):
            def _deny(self):
                self.send_response(403)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _deny

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


S3_COMMANDS = {
    "list": ["checkpoints", "list", "s3://bucket-x/runs/r1"],
    "verify": ["checkpoints", "verify", "s3://bucket-x/runs/r1"],
    "export": ["checkpoints", "export", "s3://bucket-x/runs/r1", "--out", "{tmp}/m.pt"],
    "eval": ["eval", "--checkpoint", "s3://bucket-x/runs/r1"],
    "runs-list": ["runs", "list", "s3://bucket-x/runs"],
    "runs-show": ["runs", "show", "s3://bucket-x/runs/r1"],
}


# an unreachable store is waited out for the budget (failure.storage_retry_s; 120 s by default), as in training
BUDGET = {"list": ["--storage-retry-s", "2"], "verify": ["--storage-retry-s", "2"],
          "export": ["--storage-retry-s", "2"], "eval": ["--set", "failure.storage_retry_s=2"],
          "runs-list": ["--storage-retry-s", "2"], "runs-show": ["--storage-retry-s", "2"]}


def waited_then_one_error_line(stderr: str) -> str:
    """The line saying the store is waited for, then the one error line; returns the error line."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 2 and "Traceback" not in stderr, stderr
    assert "unreachable" in lines[0] and "retrying for up to 2 s (failure.storage_retry_s)" in lines[0], stderr
    return lines[1]


def test_the_commands_retry_budget_defaults_to_failure_storage_retry_s():
    from ray_app.driver.cli import RETRY_DEFAULT_S
    from ray_app.shared.config import FailureSection

    assert RETRY_DEFAULT_S == FailureSection().storage_retry_s


def _s3_env(endpoint: str) -> dict:
    env = {k: None for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE",
                             "AWS_SHARED_CREDENTIALS_FILE")}
    return dict(env, AWS_ENDPOINT_URL_S3=endpoint, AWS_ACCESS_KEY_ID="AKIAEXAMPLE", AWS_SECRET_ACCESS_KEY="not-a-secret",
                AWS_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")


def _main_in_process(args: list[str], env: dict, monkeypatch, capsys) -> tuple[int, str]:
    """``ray-app ARGS`` in this process (torch is imported already: seconds less than a subprocess)."""
    import signal

    from ray_app.driver import cli

    for key, value in env.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # main() would leave its SIGTERM handler here
    capsys.readouterr()
    rc = cli.main(args)
    return rc, capsys.readouterr().err


@pytest.mark.timeout(120)
def test_an_unreachable_s3_endpoint_is_one_line_and_exit_2_as_a_user_runs_it(run_cli, tmp_path):
    from tests.support.ports import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    rc, _, err = run_cli([*S3_COMMANDS["eval"], *BUDGET["eval"]], env=_s3_env(endpoint), timeout=100)
    line = waited_then_one_error_line(err)
    assert rc == 2, err
    assert "s3://bucket-x" in line and endpoint in line and "AWS_ENDPOINT_URL_S3" in line, line


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", list(S3_COMMANDS))
def test_an_unreachable_s3_endpoint_is_one_line_and_exit_2(tmp_path, command, monkeypatch, capsys):
    from tests.support.ports import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    args = [a.format(tmp=tmp_path) for a in [*S3_COMMANDS[command], *BUDGET[command]]]
    rc, err = _main_in_process(args, _s3_env(endpoint), monkeypatch, capsys)
    line = waited_then_one_error_line(err)
    assert rc == 2, err
    assert "s3://bucket-x" in line and endpoint in line and "AWS_ENDPOINT_URL_S3" in line, line
    assert "not-a-secret" not in err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", list(S3_COMMANDS))
def test_refused_credentials_are_one_line_and_exit_2(tmp_path, command, monkeypatch, capsys):
    args = [a.format(tmp=tmp_path) for a in S3_COMMANDS[command]]
    with _DenyingS3() as endpoint:
        rc, err = _main_in_process(args, _s3_env(endpoint), monkeypatch, capsys)
    line = one_error_line(err)
    assert rc == 2, err
    assert "s3://bucket-x" in line and "access denied" in line and "credentials" in line, line
    assert "not-a-secret" not in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["list", "train"])
def test_partial_credentials_are_one_line_and_exit_2(tmp_path, command, monkeypatch, capsys):
    """AWS_ACCESS_KEY_ID set and the secret empty: botocore refuses to build a client; one line naming the
    variable that is missing (never a value), before any request or Ray."""
    from tests.support.ports import free_port

    env = dict(_s3_env(f"http://127.0.0.1:{free_port()}"), AWS_SECRET_ACCESS_KEY="")
    args = S3_COMMANDS["list"] if command == "list" else ["train", "--set", "run.storage=s3://bucket-x/runs"]
    rc, err = _main_in_process(args, env, monkeypatch, capsys)
    line = one_error_line(err)
    assert rc == 2, err
    assert "credentials are incomplete" in line and "AWS_SECRET_ACCESS_KEY" in line and "AKIAEXAMPLE" not in line
