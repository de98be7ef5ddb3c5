"""``ray-app`` command line (also ``python -m ray_app``).

Exit codes: 0 success; 2 bad input (config, arguments, credentials, missing
bucket, unreadable or tampered checkpoint or shard, a run held by another driver) with
one line naming the key or resource and the fix; 1 a failure during training (or in
the data set ``ray-app data write`` packs); 143 a
training run stopped by a SIGTERM to the driver after its checkpoint was committed;
130 interrupted (SIGINT, Ctrl-C), after the checkpoint at the next step. The table of what
each failure is and the code it ends with: ``ray_app.shared.failures``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path

from ray_app import __version__
from ray_app.shared.errors import CheckpointError, ConfigError, ShardError, UserError
from ray_app.shared.failures import EXIT_FAILED, EXIT_OK, exit_code, one_line
from ray_app.shared.shards import DEFAULT_SHARD_MB

RETRY_DEFAULT_S = 120.0  # = failure.storage_retry_s's default (a unit test checks)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: bad input, one line, the table's exit code
        self.print_usage(sys.stderr)
        bad = ConfigError(message)
        print(one_line(bad), file=sys.stderr)
        sys.exit(exit_code(bad))


def _config_args(p: argparse.ArgumentParser, config_default: str | None = "configs/local.yaml") -> None:
    p.add_argument("--config", default=None, metavar="FILE",
                   help=f"YAML run config (default: {config_default} if it exists, else built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key, e.g. --set train.epochs=5 (repeatable; `ray-app config keys` "
                        "lists them)")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ray-app", description="PyTorch DDP training on Ray Train: train, evaluate, inspect checkpoints, "
                                            "run your own DDP script, pack data into shards, list the config's keys.")
    p.add_argument("--version", action="version", version=f"ray-app {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="train (resumes if the run already has checkpoints)")
    _config_args(t)
    t.add_argument("--summary", metavar="FILE", help="also write the summary JSON to FILE")

    e = sub.add_parser("eval", help="distributed evaluation of a checkpoint")
    e.add_argument("--checkpoint", required=True, metavar="URI", help="checkpoint URI, or a run URI (its newest)")
    e.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of the checkpoint's config (e.g. scaling.num_workers=1)")
    e.add_argument("--summary", metavar="FILE", help="also write the summary JSON to FILE")

    c = sub.add_parser("checkpoints", help="list, verify or export a run's checkpoints")
    csub = c.add_subparsers(dest="action", required=True, parser_class=_Parser)
    for name, help_text in (("list", "epoch, step, time, metrics, size and verification of each checkpoint"),
                            ("verify", "check every manifest entry (exit 2 if the newest or any named is bad)"),
                            ("export", "write the model state_dict of the newest good (or the named) checkpoint")):
        a = csub.add_parser(name, help=help_text)
        a.add_argument("uri", metavar="RUN_OR_CHECKPOINT_URI")
        a.add_argument("--json", action="store_true", help="machine-readable output")
        a.add_argument("--storage-retry-s", type=float, default=RETRY_DEFAULT_S, metavar="SECONDS",
                       help=f"how long an unreachable store is waited out (default {RETRY_DEFAULT_S:g}, as "
                            "failure.storage_retry_s)")
        if name == "export":
            a.add_argument("--out", required=True, metavar="PATH",
                           help="where to write it: a .pt file (--format pt), a folder (--format hf, peft)")
            a.add_argument("--format", choices=("pt", "hf", "peft"), default="pt",
                           help="pt: the model's state_dict in one file (default); hf: a folder transformers' "
                                "from_pretrained loads (config.json, safetensors, index, tokenizer), for a "
                                "model.name hf run (a model.lora run: the base with its adapters merged); "
                                "peft: a model.lora run's adapter folder, as PeftModel.save_pretrained writes it")
            a.add_argument("--max-shard-gb", type=float, default=5.0, metavar="GB",
                           help="--format hf: the most bytes of one safetensors file (default 5)")
            a.add_argument("--force", action="store_true", help="overwrite PATH if it exists")

    u = sub.add_parser("runs", help="the runs under a storage and their state; a run's timeline and where its "
                                    "wall time went (its journal)")
    usub = u.add_subparsers(dest="action", required=True, parser_class=_Parser)
    for name, arg, help_text in (("list", "STORAGE", "each run under STORAGE: state, last step, last event, the "
                                                     "driver holding it"),
                                 ("show", "RUN_URI", "a run's timeline and its wall time split into productive "
                                                     "training, start-up, restarts, recomputed steps, checkpoint "
                                                     "blocking and evaluation")):
        a = usub.add_parser(name, help=help_text)
        a.add_argument("uri", metavar=arg)
        a.add_argument("--json", action="store_true", help="machine-readable output")
        a.add_argument("--storage-retry-s", type=float, default=RETRY_DEFAULT_S, metavar="SECONDS",
                       help=f"how long an unreachable store is waited out (default {RETRY_DEFAULT_S:g}, as "
                            "failure.storage_retry_s)")

    f = sub.add_parser("preflight", help="check config, storage and cluster; train nothing")
    _config_args(f)

    r = sub.add_parser("run", help="run a torchrun-style DDP script, unchanged, on the Ray Train workers",
                       usage="ray-app run [-h] [--config FILE] [--set KEY=VALUE] SCRIPT [ARGS ...]",
                       description="Each worker runs SCRIPT as __main__ with ARGS, the environment torchrun gives "
                                   "and the process group Ray Train set up (see ray_app.script).")
    _config_args(r)
    # nargs="?": argparse would name the optional ARGS too when SCRIPT is missing (cmd_run says it alone)
    r.add_argument("script", nargs="?", metavar="SCRIPT", help="the script, e.g. train.py")
    # REMAINDER: everything after SCRIPT is the script's, its own --flags included (as torchrun parses it)
    r.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's own arguments")

    d = sub.add_parser("data", help="pack data.name's train and eval sets into Parquet shards; verify shards")
    dsub = d.add_subparsers(dest="action", required=True, parser_class=_Parser)
    w = dsub.add_parser("write", help="pack the configured data set into shards under DEST, the manifest last",
                        description="Builds data.name as `ray-app train` does (same --config and --set) and writes "
                                    "DEST/train/*.parquet, DEST/eval/*.parquet and DEST/manifest.json.")
    w.add_argument("dest", metavar="DEST", help="s3://bucket/prefix or a local folder")
    _config_args(w)
    w.add_argument("--shard-mb", type=_positive_float, default=DEFAULT_SHARD_MB, metavar="MB",
                   help=f"sample bytes per shard before compression, in MB (default {DEFAULT_SHARD_MB:g})")
    w.add_argument("--overwrite", action="store_true",
                   help="replace the manifest of a shard set already at DEST (its old shards are kept)")
    v = dsub.add_parser("verify", help="check every shard's size and sha256 against DEST's manifest")
    v.add_argument("dest", metavar="DEST", help="s3://bucket/prefix or a local folder")

    _sweep_args(sub)

    g = sub.add_parser("config", help="every config key with its default and help, or the JSON Schema of config files")
    gsub = g.add_subparsers(dest="action", required=True, parser_class=_Parser)
    k = gsub.add_parser("keys", help="every config key: type, default and help")
    k.add_argument("--markdown", action="store_true", help="as the README's table (header and rows)")
    gsub.add_parser("schema", help="the JSON Schema (draft 2020-12) of config files, for editors "
                                   "(configs/schema.json is its output)")
    return p


def _sweep_args(sub) -> None:
    s = sub.add_parser("sweep", help="Ray Tune trials over a space of config keys, each a run of the kit; "
                                     "`sweep show SWEEP_URI` prints a sweep's table",
                       usage="ray-app sweep [-h] --space SPACE [--config FILE] [--set KEY=VALUE] [--summary FILE]\n"
                             "       ray-app sweep show SWEEP_URI",
                       description="Runs (or resumes) the sweep {run.storage}/{run.name}: see docs/sweeps.md.")
    _config_args(s)
    s.add_argument("--space", metavar="SPACE", help="YAML space file: metric, mode, trials, concurrent, scheduler, space")
    s.add_argument("--summary", metavar="FILE", help="also write the summary JSON to FILE")
    s.add_argument("show", nargs="?", choices=["show"], help=argparse.SUPPRESS)
    s.add_argument("uri", nargs="?", metavar="SWEEP_URI", help=argparse.SUPPRESS)


def _load(args):
    from ray_app.shared.config import load_config

    path = args.config
    if path is None and Path("configs/local.yaml").is_file():
        path = "configs/local.yaml"
    return load_config(path, args.overrides)


def _json_safe(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    return obj


def _emit_summary(summary: dict, path: str | None) -> None:
    line = json.dumps(_json_safe(summary), sort_keys=False)
    if path:
        Path(path).write_text(line + "\n")
    sys.stderr.flush()
    print(line, flush=True)


def cmd_train(args) -> int:
    from ray_app.driver.launcher import run_training

    cfg = _load(args)
    _emit_summary(run_training(cfg), args.summary)
    return EXIT_OK


def cmd_eval(args) -> int:
    from ray_app.driver.launcher import run_eval

    _emit_summary(run_eval(args.checkpoint, args.overrides), args.summary)
    return EXIT_OK


def cmd_preflight(args) -> int:
    from ray_app.driver.launcher import init_ray, preflight_run

    cfg = _load(args)
    storage = preflight_run(cfg)
    print(f"config ok: run {cfg.run.name}, {cfg.scaling.num_workers} workers, {cfg.model.name} on {cfg.data.name}")
    print(f"storage ok: {storage.uri(cfg.run.name)} is writable")
    import os

    if os.environ.get("RAY_ADDRESS"):
        init_ray(cfg)
        import ray

        print(f"cluster ok: {ray.cluster_resources()}")
        ray.shutdown()
    return EXIT_OK


def cmd_run(args) -> int:
    from ray_app.driver.script import check_script, run_script

    if args.script is None:
        raise UserError("SCRIPT is missing: ray-app run [--config FILE] [--set KEY=VALUE] SCRIPT [ARGS...]")
    script = check_script(args.script)  # before the config and Ray: a typo in the name costs nothing
    _emit_summary(run_script(_load(args), script, args.args), None)
    return EXIT_OK


def cmd_config(args) -> int:
    from ray_app.driver import config_reference as ref

    if args.action == "schema":
        sys.stdout.write(ref.schema_json())
    else:
        sys.stdout.write(ref.keys_markdown() if args.markdown else ref.keys_text())
    return EXIT_OK


def cmd_checkpoints(args) -> int:
    from ray_app.shared import catalog

    if args.action == "export":
        return _export(args)
    storage, run, name = catalog.locate(args.uri, args.storage_retry_s, then=catalog.AT_START)
    names = [name] if name is not None else catalog.list_checkpoints(storage, run)
    if not names:
        catalog.no_checkpoint(args.uri, storage, run)
    rows = [_describe(storage, f"{run}/{n}" if run else n, n) for n in names]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            status = "verified" if r["verified"] else f"NOT VERIFIED ({r['problems']})"
            shown = "  ".join(f"{k} {v if not isinstance(v, float) else round(v, 4)}"
                              for k, v in r["metrics"].items() if k.startswith("eval_"))
            print(f"{r['name']}  epoch {r['epoch']}  step {r['global_step']}  {r['time']}  "
                  f"{r['bytes'] / 1e6:.2f} MB  {shown + '  ' if shown else ''}{status}")
    if args.action == "verify":
        # a folder without a manifest is an upload that never committed: never loaded, not a failure by itself
        committed = [r for r in rows if not r["problems"].startswith("no manifest")] or rows
        bad = [r for r in committed if not r["verified"]]
        if bad and (name is not None or bad[-1] is committed[-1] or len(bad) == len(committed)):
            raise CheckpointError(f"{len(bad)} of {len(rows)} checkpoints failed verification "
                                  f"(newest bad: {bad[-1]['uri']}); do not load them")
    return EXIT_OK


def cmd_runs(args) -> int:
    """``runs list`` / ``runs show``: read-only (no lease taken), from the runs' journals and leases."""
    from ray_app.driver import runs

    if args.action == "list":
        rows = runs.list_runs(args.uri, args.storage_retry_s)
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            for line in runs.list_lines(rows):
                print(line)
        return EXIT_OK
    shown = runs.show_run(args.uri, args.storage_retry_s)
    if args.json:
        print(json.dumps(_json_safe(shown), indent=1))
    else:
        for line in runs.show_lines(shown):
            print(line)
    return EXIT_OK


def _describe(storage, rel: str, name: str) -> dict:
    from ray_app.shared import catalog

    v = catalog.verify(storage, rel, name)
    files = storage.list_files(rel)
    metrics, man = {}, v.manifest or {}
    if v.ok:
        try:
            metrics = json.loads(storage.read_bytes(f"{rel}/metrics.json"))
        except Exception:
            metrics = {}
    created = man.get("created")
    return {"name": name, "uri": storage.uri(rel), "verified": v.ok, "problems": v.reason,
            "epoch": man.get("epoch"), "global_step": man.get("global_step"),
            "time": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(created)) if created else "?",
            "bytes": sum(files.values()),
            "metrics": {k: v for k, v in metrics.items() if k == "train_loss" or k.startswith("eval_")}}


def _export(args) -> int:
    from ray_app.driver.export import export_hf, export_peft, export_pt

    out = Path(args.out)
    if out.exists() and not args.force:
        raise UserError(f"--out {out} already exists; choose another path or pass --force")
    if args.format == "hf":
        if not args.max_shard_gb > 0:
            raise UserError(f"--max-shard-gb {args.max_shard_gb:g}: give a size above 0, e.g. 5")
        summary = export_hf(args.uri, out, args.storage_retry_s, args.max_shard_gb)
    elif args.format == "peft":
        summary = export_peft(args.uri, out, args.storage_retry_s)
    else:
        summary = export_pt(args.uri, out, args.storage_retry_s)
    print(json.dumps(summary))
    return EXIT_OK


def cmd_data(args) -> int:
    from ray_app.shared import shards

    if args.action == "verify":
        return _verify_shards(args.dest)
    cfg = _load(args)
    storage = shards.open_dest(args.dest)
    present = shards.check_dest(storage, args.overwrite)  # before the data set is built: a refusal costs nothing
    from ray_app.shared.errors import DataPipelineError
    from ray_app.shared.plugins import add_project_to_path, build_data, validate

    add_project_to_path(os.getcwd())
    validate(cfg)
    train, evaluation, info = build_data(cfg)
    source = {"data.name": cfg.data.name, "data.args": cfg.data.args}
    try:
        manifest = shards.write_shards(storage, {"train": train, "eval": evaluation}, info, source, args.shard_mb)
    except DataPipelineError as exc:  # the user's data set raised: their frames once, then one line
        print(DataPipelineError.report_of(exc).rstrip(), file=sys.stderr)
        print(f"ray-app: data write failed in data.name {cfg.data.name}; no manifest was written at {args.dest}",
              file=sys.stderr)
        return EXIT_FAILED
    old = sorted(set(present) - {shards.MANIFEST})
    if old:
        print(f"{len(old)} files of earlier writes remain under {storage.uri()} (not in the manifest, e.g. {old[0]}); "
              "delete them once no reader uses them")
    _emit_summary({"manifest": storage.uri(shards.MANIFEST), "samples": manifest.total_samples,
                   **{f"{split}_samples": manifest.samples(split) for split in shards.SPLITS},
                   "shards": len(manifest.shards), "bytes": manifest.total_bytes,
                   "info": manifest.info}, None)
    return EXIT_OK


def _verify_shards(dest: str) -> int:
    from ray_app.shared import shards

    storage = shards.open_dest(dest)
    manifest, problems = shards.verify(storage)
    for line in problems:
        print(f"BAD {line}")
    size = f"{len(manifest.shards)} shards, {manifest.total_samples} samples, {manifest.total_bytes / 1e6:.2f} MB"
    if problems:
        raise ShardError(f"{storage.uri()}: {len(problems)} of {len(manifest.shards)} shards failed verification "
                         f"(first: {problems[0].split(':')[0]}); write the data set again with `ray-app data write DEST "
                         "--overwrite`")
    print(f"{storage.uri()}: {size}: verified")
    return EXIT_OK


def cmd_sweep(args) -> int:
    from ray_app.driver import sweep_space

    if args.show:
        from ray_app.driver import sweep

        if not args.uri:
            raise UserError("sweep show: SWEEP_URI is missing: ray-app sweep show {run.storage}/{run.name}")
        summary, record = sweep.show_sweep(args.uri)
        sweep.show(summary, record)
        _emit_summary(summary, args.summary)
        return EXIT_OK
    if not args.space:
        raise UserError("--space SPACE is missing: ray-app sweep --space space.yaml [--config FILE] [--set ...]")
    cfg = _load(args)
    space = sweep_space.load_space(args.space, cfg)
    from ray_app.driver import sweep

    configs = sweep_space.check_trials(space, cfg, sweep.sweep_uri(cfg))  # every trial's config, before Ray starts
    summary, record = sweep.run_sweep(cfg, space, configs)
    sweep.show(summary, record)
    _emit_summary(summary, args.summary)
    return sweep.exit_code_of(record)


def _terminate(signum, frame):
    raise KeyboardInterrupt


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "preflight": cmd_preflight, "checkpoints": cmd_checkpoints,
            "runs": cmd_runs,
            "run": cmd_run, "config": cmd_config, "data": cmd_data, "sweep": cmd_sweep}


def main(argv: list[str] | None = None) -> int:
    """A command, ended by the failure table (``ray_app.shared.failures``): an exception of one of its rows at the
    driver is that row's line and exit code; any other is a traceback."""
    args = build_parser().parse_args(argv)  # before the imports below: --help and usage errors skip torch

    signal.signal(signal.SIGTERM, _terminate)  # `ray job stop`, docker stop, k8s: shut Ray down cleanly
    try:
        return COMMANDS[args.command](args)
    except BaseException as exc:  # noqa: B036 - the table says which end a command with a line and a code
        code = exit_code(exc)
        if code is None:
            raise
        print(one_line(exc), file=sys.stderr)
        return code


def run() -> None:
    """The ``ray-app`` command (and ``python -m ray_app``): ``main``, then the process ends at once.

    Once the summary is written and Ray shut down, nothing is left to do, but the interpreter's own
    teardown with torch and Ray loaded takes about a second more (measured: ~1.2 s of a run's end on
    2 cores); Ray is shut down if a path left it running (its atexit hook would), the output is flushed,
    and the process exits with ``main``'s code without the rest of the teardown."""
    code = main()
    ray = sys.modules.get("ray")
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        ray.shutdown()  # what Ray's atexit hook would do: a local Ray started here stops with this process
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it
            pass
    os._exit(code if isinstance(code, int) else 1)


if __name__ == "__main__":
    run()
