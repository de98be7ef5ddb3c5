"""The kit side by side with bare torchrun: `make bench` (full) and `make bench-smoke` (CI).

    python bench/run.py                 # every case, 3 interleaved rounds -> bench/RESULTS.md, bench/results.png
                                        #   (every run's figures: build/bench/results.json)
    python bench/run.py --smoke         # every case once at tiny size; checks the outputs are well-formed
    python bench/run.py --cases a,c --rounds 5

Cases: (a) steady-state samples/s, compute-bound; (b) communication-bound;
(c) time to first step, cold and warm, with the phases; (d) checkpoint cost to S3,
sync vs async; (e) recovery after a worker SIGKILL; (f) scaling 1 -> 2 workers;
(g) metrics exporter on vs off; (p) the per-step preemption agreement on vs off, workloads
of (a) and (b); (r) every rank's pace (timing marks, one all_gather per log interval) on vs off,
the same; (t, not in the default set) MLflow tracking to a server that refuses and to one that
hangs vs no tracking; (s) script mode: the twin itself under `ray-app run`
vs torchrun, beside the plug-in mode's time to first step; (h, not in the default set) streamed shards:
samples/s of workload (a) reading its data set as `ray-app data write` shards from moto over loopback vs the
same samples map-style from memory; (v, not in the default set) start-up experiments
with bench/variants.py; (z) FSDP: the kit with `train.strategy=fsdp` vs the twin's plain FSDP2 on workload
(b), steady samples/s; (m, not in the default set) the speed switches, each on vs off, the kit and the twin with
the same switches, on bench/models.py's vision transformer in one epoch: train.precision=bf16-mixed,
train.activation_checkpointing=full, train.compile=true, steady samples/s, each rank's peak resident memory
and, for compile, the time to first step; (l, not in the default set) a
Hugging Face language model under FSDP: `model.name=hf`, `data.name=text`, `task.name=causal_lm` (bench/lm.py's
Llama-architecture model) vs the twin loading the same folder with `from_pretrained`, and the kit's own loop
without Ray under torchrun (bench/loop_alone.py) vs the twin, steady tokens/s. ``--gpu`` (bench/gpu.sh): (a),
(c), (d) on one GPU, bf16, with MFU. Each round runs every case's processes once, in order (kit, twin, kit,
twin, ...), so drift in the machine's load hits both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import lm as bench_lm  # noqa: E402
from bench import measure, parse, report  # noqa: E402
from bench.measure import Spec  # noqa: E402

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent


def results_json_path(out: Path) -> Path:
    """Where results.json goes: beside RESULTS.md, except in the source tree (bench/, bench/gpu), whose
    figures go under build/ instead (only RESULTS.md and the chart are tracked)."""
    out = out.resolve()
    if out == BENCH or BENCH in out.parents:
        return REPO / "build" / out.relative_to(REPO) / "results.json"
    return out / "results.json"


# ---------------------------------------------------------------- workloads (--set values, kit and twin alike)

_COMMON = ("data.name=synthetic", "train.warmup_epochs=0", "checkpoint.every_epochs=0", "checkpoint.every_steps=0")
# case (l): bench/lm.py's model, tokenizer and text (model.name=hf, data.name=text, task.name=causal_lm) under FSDP,
# AdamW; batches of sequences of data.args.seq_len tokens
_LM = ("train.strategy=fsdp", "train.optimizer=adamw", "train.lr=0.001", "train.weight_decay=0.0",
       "train.warmup_epochs=0", "checkpoint.every_epochs=0", "checkpoint.every_steps=0")
WORKLOADS = {
    "full": {
        # cases (a), (b), (f), (g), (p), (r), (s): long enough that the steady state outweighs the first steps
        "compute": (*_COMMON, "model.name=resnet18", "data.args.image_size=32", "data.args.num_samples=4096",
                    "data.batch_size=32", "train.epochs=2", "train.log_every_steps=5"),
        "comm": (*_COMMON, "model.name=wide_mlp", "data.args.image_size=32", "data.args.num_samples=1536",
                 "data.batch_size=32", "train.epochs=2", "train.lr=0.01", "train.log_every_steps=5"),
        # case (d): wide_mlp at 44x44 has 36.7M parameters, model + SGD momentum = 294 MB per checkpoint;
        # two epochs of 64 steps
        "ckpt": (*_COMMON, "model.name=wide_mlp", "data.args.image_size=44", "data.args.num_samples=4096",
                 "data.batch_size=32", "train.epochs=2", "train.lr=0.01", "train.log_every_steps=5",
                 "checkpoint.keep=2"),
        "recovery": (*_COMMON, "model.name=digits_cnn", "data.args.image_size=32", "data.args.num_samples=4096",
                     "data.batch_size=32", "train.epochs=2", "train.log_every_steps=8",
                     "checkpoint.every_steps=16"),
        "startup_steps": 8,
        "one_worker_steps": 48,  # (f) with 1 worker: same per-step work, capped (an epoch has twice the steps)
        # (h): workload (a)'s 4096 samples of 12 KB (50 MB) in 1 MB shards: 50 train shards, about 25 a rank an epoch
        "shard_mb": 1.0,
        # (l): about 1,000 sequences of 128 tokens, 8 a rank a step: about 60 steps an epoch
        "lm": (*bench_lm.overrides("full"), *_LM, "data.batch_size=8", "train.epochs=2", "train.log_every_steps=5"),
        # (m): bench/models.py's vision transformer (8 blocks of width 128, 64 patches of 4x4 an image), batch 64 a
        # rank, one epoch of 20 steps (its only evaluation after the steady window)
        "speed": (*_COMMON, "model.name=bench.models:vit", "model.args.depth=8", "data.args.image_size=32",
                  "data.args.num_samples=2560", "data.batch_size=64", "train.epochs=1", "train.log_every_steps=5"),
    },
    # smoke: 4 kit processes and 3 twins cover every case (the numbers are not judged)
    "smoke": {
        "compute": (*_COMMON, "model.name=digits_cnn", "data.args.image_size=8", "data.args.num_samples=512",
                    "data.batch_size=16", "train.epochs=2", "train.log_every_steps=2"),
        "comm": (*_COMMON, "model.name=wide_mlp", "data.args.image_size=8", "data.args.num_samples=256",
                 "data.batch_size=16", "train.epochs=2", "train.lr=0.01", "train.log_every_steps=2"),
        "shard_mb": 0.05,  # (h): 512 samples of 768 bytes in 8 train shards
        "lm": (*bench_lm.overrides("smoke"), *_LM, "data.batch_size=4", "train.epochs=1", "train.log_every_steps=2"),
        "speed": (*_COMMON, "model.name=bench.models:vit", "model.args.dim=32", "model.args.depth=2",
                  "model.args.heads=2", "data.args.image_size=8", "data.args.num_samples=256", "data.batch_size=16",
                  "train.epochs=1", "train.log_every_steps=2"),
    },
    # bench/gpu.sh: one GPU, one worker, bf16; resnet50 at 128 px (7.9 GFLOP per sample, forward + backward)
    "gpu": {
        "compute": (*_COMMON, "model.name=resnet50", "data.args.image_size=128", "data.args.num_samples=8192",
                    "data.batch_size=256", "train.epochs=4", "train.log_every_steps=8", "train.lr=0.1",
                    "train.precision=bf16-mixed", "scaling.use_gpu=true"),
        "startup_steps": 0,
    },
}
GPU_CASES = "a,c,d"
DEFAULT_CASES = "a,b,c,d,e,f,g,p,r,s"
DEFAULT_CASES += ",j,z"  # (j) the run journal's cost; (z) FSDP: the kit vs the twin's plain FSDP2
FSDP = ("train.strategy=fsdp",)  # case (z): the same --set for the kit and the twin
# case (m): each against all off, the kit and the twin alike (the vision transformer's blocks: its ModuleList)
SPEED_SWITCHES = {"bf16-mixed": ("train.precision=bf16-mixed",),
                  "ac full": ("train.activation_checkpointing=full",),
                  "compile": ("train.compile=true",)}
SMOKE_SWITCHES = ("ac full",)  # the smoke's: a compile costs tens of seconds on 2 cores
VARIANT_NAMES = ("kit", "ray-poll", "nice0")
SHARDS_PREFIX = "bench-shards"  # case (h): the shard set's prefix in the bench's S3 bucket


def streamed(overrides: tuple[str, ...], dest: str) -> tuple[str, ...]:
    """A workload's --set values reading its data set from the shards at ``dest`` instead: the data set's own
    name and arguments dropped (shards takes a path and prefetch only); batch size, model and the rest kept."""
    kept = tuple(o for o in overrides if not o.startswith(("data.name=", "data.args.")))
    return (*kept, "data.name=shards", f"data.path={dest}")


def shards_dest(case: str) -> str:
    from tests.integration.s3server import BUCKET

    return f"s3://{BUCKET}/{SHARDS_PREFIX}/{case}"


class Plan:
    """Which processes each case needs (one list per round) and how to turn results into rows."""

    def __init__(self, size: str, variants: tuple[str, ...] = VARIANT_NAMES, switches: tuple[str, ...] = tuple(SPEED_SWITCHES)):
        w = WORKLOADS[size]
        self.smoke, self.gpu = size == "smoke", size == "gpu"
        self.shard_sets: dict[str, tuple[tuple[str, ...], str, float]] = {}  # case -> (--set, DEST, --shard-mb)
        self.lm_size = size  # case (l): which of bench/lm.py's folders its runs read (made before the first run)
        if self.gpu:
            self._gpu_specs(w)
            return
        if self.smoke:
            self._smoke_specs(w)
            return
        kit_launch = "warm" if self.smoke else "cold"  # smoke: one warm cluster keeps CI short
        kit = lambda o, **kw: Spec("kit", o, launch=kw.pop("launch", kit_launch), **kw)  # noqa: E731
        twin = lambda o, **kw: Spec("twin", o, **kw)  # noqa: E731
        startup = w["compute"] + ((f"train.max_steps={w['startup_steps']}",) if w["startup_steps"] else ())
        off = ("metrics.enabled=false",)
        no_notice = ("failure.preemption_checkpoint=false",)
        no_pace = ("metrics.rank_pace=false",)
        one_worker = w["compute"] + (f"train.max_steps={w['one_worker_steps']}",)
        ckpt = {"none": w["ckpt"],
                "final": w["ckpt"] + ("checkpoint.every_epochs=1000", "checkpoint.upload=async"),  # the end only
                "sync": w["ckpt"] + ("checkpoint.every_epochs=1", "checkpoint.upload=sync"),
                "async": w["ckpt"] + ("checkpoint.every_epochs=1", "checkpoint.upload=async"),
                # the same, each rank's share written by DCP's checkpoint process instead of a thread
                "async process": w["ckpt"] + ("checkpoint.every_epochs=1", "checkpoint.upload=async",
                                              "checkpoint.async_writer=process")}
        scrape = 0.5  # the checkpoint histogram must be read between a checkpoint and the end
        self.specs = {
            "a": {"kit": kit(w["compute"]), "twin": twin(w["compute"])},
            "b": {"kit": kit(w["comm"]), "twin": twin(w["comm"])},
            "c": {"kit cold": kit(startup, launch="cold", cpu_sample=True), "twin": twin(startup, cpu_sample=True),
                  "kit warm": kit(startup, launch="warm", cpu_sample=True),
                  # the default job as a new user runs it (configs/local.yaml: digits, 2 workers, checkpoints;
                  # metrics on, no Prometheus scraping them)
                  "kit default": kit((), launch="cold", cpu_sample=True, scraped=False),
                  "twin default": twin((), cpu_sample=True),
                  # plain Ray Train (bench/ray_alone.py: a TorchTrainer with Ray's defaults, an empty train function)
                  "ray alone": Spec("ray", ())},
            "d": {**{name: kit(o, storage="s3", scrape_every=scrape, cpu_sample=True) for name, o in ckpt.items()},
                  # the same pair to a local folder: the cost without an S3 server on the two training cores
                  **{f"{name} folder": kit(ckpt[name], scrape_every=scrape, cpu_sample=True)
                     for name in ("final", "async")}},
            "e": {"kit": kit(w["recovery"], kill=True, scrape_every=scrape), "twin": twin(w["recovery"], kill=True)},
            "f": {"kit 2": kit(w["compute"]), "twin 2": twin(w["compute"]),
                  "kit 1": kit(one_worker, workers=1), "twin 1": twin(one_worker, workers=1)},
            # "on" spelled out, so it is a run of its own and not case (a)'s kit run: on and off back to back
            "g": {"on": kit(w["compute"] + ("metrics.enabled=true",)), "off": kit(w["compute"] + off)},
            # the preemption agreement: on is case (a)'s and (b)'s kit run, off a run of its own beside it
            "p": {"a on": kit(w["compute"]), "a off": kit(w["compute"] + no_notice),
                  "b on": kit(w["comm"]), "b off": kit(w["comm"] + no_notice)},
            # every rank's pace: on is case (a)'s and (b)'s kit run (log every 5 steps), off a run of its own
            "r": {"a on": kit(w["compute"]), "a off": kit(w["compute"] + no_pace),
                  "b on": kit(w["comm"]), "b off": kit(w["comm"] + no_pace)},
            # script mode: the twin, a torchrun-style script, unchanged under `ray-app run` (case (a)'s twin run)
            "s": {"ray-app run": Spec("script", w["compute"]), "torchrun": twin(w["compute"]),
                  "ray-app train": kit(w["compute"])},
            # tracking to a server that is down (refuses), or hangs (accepts, never answers), vs none; workload (a)
            # (not in the default cases: `--cases t`)
            "t": {"off": kit(w["compute"] + off),
                  "refused": kit(w["compute"] + off + (f"tracking.mlflow_uri={down_tracking_server()}",)),
                  "hung": kit(w["compute"] + off + (f"tracking.mlflow_uri={hung_tracking_server()}",))},
            # streamed shards (not in the default cases: `--cases h`): workload (a) map-style from memory vs the
            # same samples streamed from moto; both keep run.storage on the same S3 server, so only the data
            # source differs; the CPU sampler also follows moto_server
            "h": {"map-style": kit(w["compute"], storage="s3", cpu_sample=True),
                  "streamed": kit(streamed(w["compute"], shards_dest("h")), storage="s3", cpu_sample=True)},
            # start-up experiments (not in the default cases): bench/variants.py, kit unchanged
            "v": {name: kit(startup, variant=name, launch="cold", cpu_sample=True) for name in variants},
        }
        self.shard_sets["h"] = (w["compute"], shards_dest("h"), w["shard_mb"])
        # the run journal: on is case (a)'s and (b)'s kit run, off the same run with RAY_APP_JOURNAL=0 in every
        # process (bench/variants.py no-journal: the same command through the variants' entry point)
        self.specs["j"] = {"a on": kit(w["compute"]), "a off": kit(w["compute"], variant="no-journal"),
                           "b on": kit(w["comm"]), "b off": kit(w["comm"], variant="no-journal")}
        # FSDP: workload (b) (wide_mlp: its parameters and optimizer state dominate), kit vs the twin's plain FSDP2
        self.specs["z"] = {"kit": kit(w["comm"] + FSDP), "twin": twin(w["comm"] + FSDP)}
        # the speed switches, each on vs all off, the kit and the twin (not in the default cases: `--cases m`)
        self.specs["m"] = speed_specs(w["speed"], {n: SPEED_SWITCHES[n] for n in switches}, kit_launch,
                                      compile_caches() if "compile" in switches else None)
        # a Hugging Face language model under FSDP (not in the default cases: `--cases l`): the kit, the twin, and
        # the kit's own loop without Ray under torchrun
        self.specs["l"] = {"kit": kit(w["lm"]), "twin": twin(w["lm"]), "loop": Spec("loop", w["lm"])}

    def _smoke_specs(self, w: dict) -> None:
        """Few processes, each serving several cases; they run concurrently (see Runner.jobs)."""
        ckpt = ("checkpoint.every_epochs=1", "checkpoint.keep=50")
        # the recovery pair trains 6 epochs: at 2 a fast machine ended the run before the kill after its first
        # checkpoint landed (no recovery to measure)
        long = ("train.epochs=6",)
        k1 = Spec("kit", w["compute"] + long + ckpt + ("checkpoint.every_steps=4", "checkpoint.upload=sync"),
                  launch="warm", storage="s3", kill=True, scrape_every=0.25)
        k2 = Spec("kit", w["compute"] + ckpt + ("checkpoint.upload=async",), launch="cold", storage="s3",
                  scrape_every=0.25, cpu_sample=True)
        k3 = Spec("kit", w["comm"], launch="warm")
        k4 = Spec("kit", w["compute"] + ("metrics.enabled=false",), workers=1, launch="warm")
        t1 = Spec("twin", w["compute"] + long + ("checkpoint.every_steps=4",), kill=True)
        t2, t3 = Spec("twin", w["comm"], cpu_sample=True), Spec("twin", w["compute"], workers=1)
        k5 = Spec("kit", streamed(k4.overrides, shards_dest("h")), workers=1, launch="warm", storage="s3")
        self.shard_sets["h"] = (w["compute"], shards_dest("h"), w["shard_mb"])
        self.specs = {"a": {"kit": k1, "twin": t1}, "b": {"kit": k3, "twin": t2},
                      "c": {"kit cold": k2, "twin": t1, "kit warm": k1}, "d": {"none": k3, "sync": k1, "async": k2},
                      "e": {"kit": k1, "twin": t1}, "f": {"kit 2": k1, "twin 2": t1, "kit 1": k4, "twin 1": t3},
                      "g": {"on": k1, "off": k4}, "h": {"map-style": k4, "streamed": k5},
                      "s": {"ray-app run": Spec("script", w["comm"]), "torchrun": t2, "ray-app train": k3},
                      "p": {"a on": k4, "a off": Spec("kit", k4.overrides + ("failure.preemption_checkpoint=false",),
                                                      workers=1, launch="warm")},
                      "r": {"a on": k3, "a off": Spec("kit", k3.overrides + ("metrics.rank_pace=false",),
                                                      launch="warm")}}
        self.specs["z"] = {"kit": Spec("kit", w["comm"] + FSDP, launch="warm"), "twin": Spec("twin", w["comm"] + FSDP)}
        self.specs["l"] = {"kit": Spec("kit", w["lm"], launch="warm"), "twin": Spec("twin", w["lm"]),
                           "loop": Spec("loop", w["lm"])}
        self.specs["j"] = {"a on": k2, "a off": replace(k2, variant="no-journal")}  # a variant runs cold
        self.specs["m"] = speed_specs(w["speed"], {n: SPEED_SWITCHES[n] for n in SMOKE_SWITCHES}, "warm", None)

    def _gpu_specs(self, w: dict) -> None:
        """One worker on one GPU (kit) against one bare process on the GPU (twin); DataParallel with >= 2 GPUs."""
        import torch

        kit = lambda o, **kw: Spec("kit", o, workers=1, **kw)  # noqa: E731
        twin = Spec("twin", w["compute"], workers=1, device="cuda")
        ckpt = w["compute"] + ("checkpoint.every_epochs=1",)
        self.specs = {
            "a": {"kit": kit(w["compute"]), "twin": twin},
            "c": {"kit cold": kit(w["compute"]), "twin": twin, "kit warm": kit(w["compute"], launch="warm")},
            "d": {"none": kit(w["compute"]),
                  "sync": kit(ckpt + ("checkpoint.upload=sync",), storage="s3", scrape_every=0.5),
                  "async": kit(ckpt + ("checkpoint.upload=async",), storage="s3", scrape_every=0.5)},
        }
        if torch.cuda.device_count() >= 2:
            self.specs["a"]["dataparallel"] = replace(twin, data_parallel=True)


def speed_specs(overrides: tuple[str, ...], switches: dict, kit_launch: str, caches: Path | None) -> dict:
    """Case (m): the kit and the twin with every speed switch off and with each one on, the same --set values
    for both, every rank's peak resident memory sampled. Compile's caches (``train.compile_cache_dir``, which
    the twin honours too) are folders of this bench, one a side: each side's first compile is cold, the later
    rounds' find its cache, as a restarted run would."""
    specs = {}
    for name, extra in {"off": (), **switches}.items():
        for side in ("kit", "twin"):
            cache = (f"train.compile_cache_dir={caches / side}",) if caches and "train.compile=true" in extra else ()
            spec = Spec(side, overrides + extra + cache, rank_memory=True)
            specs[f"{side} {name}"] = replace(spec, launch=kit_launch) if side == "kit" else spec
    return specs


def compile_caches() -> Path:
    """A folder of this bench for case (m)'s compile caches, removed when the bench ends."""
    import atexit
    import shutil

    folder = Path(tempfile.gettempdir()) / f"rb-inductor-{os.getpid()}"
    atexit.register(shutil.rmtree, folder, True)
    return folder


def down_tracking_server() -> str:
    """A URI on 127.0.0.1 where nothing listens: every request of rank 0's MLflow client is refused."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


_HUNG: list = []  # the listening sockets of hung_tracking_server, open as long as the bench runs


def hung_tracking_server() -> str:
    """A URI on 127.0.0.1 that accepts connections (the kernel's backlog) and never answers: a server that hangs."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    _HUNG.append(sock)
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


# ---------------------------------------------------------------- running

class Runner:
    def __init__(self, plan: Plan, cases: list[str], rounds: int, workdir: Path, log=print, budget_s: float = 0,
                 jobs: int = 1):
        self.plan, self.cases, self.rounds, self.log, self.budget_s = plan, cases, rounds, log, budget_s
        self.jobs = jobs  # > 1 only for the smoke: concurrent runs would spoil the figures
        self.ctx = measure.Context(workdir=workdir, log=log, timeout=300 if plan.smoke else 900)
        self.results: dict[tuple[Spec, int], dict] = {}
        # --merge: case -> the earlier bench its runs come from (its own runs, its own rounds), so a
        # process two cases share (case (p)'s "a on" is case (a)'s kit run) never mixes two benches
        self.earlier: dict[str, Runner] = {}
        self.cluster_start_s: list[float] = []
        self.shards_written: dict[str, dict] = {}  # case -> `ray-app data write`'s summary line
        self.addon_cost: dict = {}  # cases (r), (j): bench/addon_cost.py's figures, timed inside the step

    def needs(self, pred) -> bool:
        return any(pred(s) for c in self.cases for s in self.plan.specs[c].values())

    def __enter__(self):
        try:
            if self.needs(lambda s: s.storage == "s3"):
                from tests.integration.s3server import start_s3_server

                self.ctx.s3 = start_s3_server(self.ctx.workdir / "moto.log")
                self._write_shards()
            if "l" in self.cases:
                t = time.time()
                made = bench_lm.make(self.plan.lm_size)
                self.log(f"[bench] case (l): model, tokenizer and text written to {made} in {time.time() - t:.0f}s")
            if self.plan.smoke and self.needs(lambda s: s.launch == "warm"):
                self._cluster_up()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        self._cluster_down()
        if self.ctx.s3 is not None:
            self.ctx.s3.stop()

    def _write_shards(self) -> None:
        """Pack the data set of each case that streams shards (h) into the S3 server, once, before any run:
        `ray-app data write DEST` with the workload's --set values, as a user would."""
        import subprocess

        for case in self.cases:
            if case not in self.plan.shard_sets:
                continue
            overrides, dest, shard_mb = self.plan.shard_sets[case]
            argv = [str(measure.BIN / "ray-app"), "data", "write", dest, "--config", str(measure.CONFIG),
                    *measure._sets(overrides), "--shard-mb", str(shard_mb)]
            t = time.time()
            proc = subprocess.run(argv, cwd=REPO, env=self.ctx.s3.env(), capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"case ({case}): ray-app data write {dest} failed (exit {proc.returncode}):\n"
                                   f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
            self.shards_written[case] = json.loads(proc.stdout.strip().splitlines()[-1])
            w = self.shards_written[case]
            self.log(f"[bench] case ({case}): wrote {w['shards']} shards ({w['train_samples']} + {w['eval_samples']} "
                     f"samples, {w['bytes'] / 1e6:.1f} MB) to {dest} in {time.time() - t:.0f}s")

    def _cluster_up(self) -> None:
        if self.ctx.cluster is None:
            # concurrent smoke jobs each need their workers' CPUs: the warm cluster may oversubscribe
            self.ctx.cluster = measure.WarmCluster(self.ctx.workdir, num_cpus=os.cpu_count() * self.jobs)
            env = self.ctx.s3.env() if self.ctx.s3 is not None else None  # job drivers reach S3 with these
            self.cluster_start_s.append(self.ctx.cluster.start(env))  # stopped by __exit__ even if this fails
            time.sleep(2)  # let the head settle: "warm" means already running

    def _cluster_down(self) -> None:
        if self.ctx.cluster is not None:
            self.ctx.cluster.stop()
            self.ctx.cluster = None

    def schedule(self, rnd: int) -> dict[Spec, str]:
        """The unique processes of one round, in case order, with their labels.

        Odd rounds run each case's variants in reverse (A B, B A, A B, ...): a variant that
        always ran second, right after another run's shutdown, would carry that into its figure.
        """
        todo: dict[Spec, str] = {}
        for case in self.cases:
            items = list(self.plan.specs[case].items())
            for name, spec in (reversed(items) if rnd % 2 else items):
                todo.setdefault(spec, f"{case}/{name} round {rnd + 1}")
        return todo

    def load(self, runs: list[dict]) -> None:
        """Results saved in results.json, put back where the schedule expects them (--report-only, --merge)."""
        by_label = {r["label"]: r for r in runs}
        for rnd in range(self.rounds):
            for spec, label in self.schedule(rnd).items():
                if label in by_label:
                    self.results[(spec, rnd)] = by_label[label]

    @classmethod
    def saved(cls, plan: Plan, runs: list[dict], workdir: Path) -> Runner:
        """An earlier bench's runs, with the cases and rounds their labels name."""
        named = {r["label"].split("/")[0] for r in runs}
        rounds = max((int(r["label"].rsplit(" ", 1)[1]) for r in runs), default=1)
        runner = cls(plan, [c for c in plan.specs if c in named], rounds, workdir)
        runner.load(runs)
        return runner

    def all_runs(self) -> list[dict]:
        """This bench's runs, then those of the earlier benches its merged cases come from."""
        out = list(self.results.values())
        for case, earlier in self.earlier.items():
            out += [run for name in self.plan.specs[case] for run in earlier.runs(case, name)
                    if not any(run is seen for seen in out)]
        return out

    def saved_earlier(self) -> list[dict]:
        """What results.json keeps of the earlier benches: each one's runs and the cases taken from it."""
        blocks: dict[int, dict] = {}
        for case, earlier in self.earlier.items():
            block = blocks.setdefault(id(earlier), {"cases": [], "runs": list(earlier.results.values())})
            block["cases"].append(case)
        return list(blocks.values())

    def run_all(self) -> None:
        t0 = time.time()
        for rnd in range(self.rounds):
            todo = self.schedule(rnd)
            if self.jobs > 1:
                from concurrent.futures import ThreadPoolExecutor

                longest_first = sorted(todo.items(), key=lambda kv: not kv[0].kill)
                with ThreadPoolExecutor(self.jobs) as pool:
                    list(pool.map(lambda kv, r=rnd: self._run(kv[0], r, kv[1]), longest_first))
            else:
                for spec, label in todo.items():
                    self._run(spec, rnd, label)
            spent = time.time() - t0
            if self.budget_s and rnd + 1 < self.rounds and spent * (rnd + 2) / (rnd + 1) > self.budget_s:
                self.log(f"[bench] stopping after {rnd + 1} round(s): another would pass --budget {self.budget_s:.0f}s")
                self.rounds = rnd + 1
                break

    def _run(self, spec: Spec, rnd: int, label: str) -> None:
        if (spec, rnd) in self.results:
            return
        if spec.launch == "warm" and spec.kind == "kit" and self.jobs == 1:
            self._cluster_up()
        t = time.time()
        res = measure.run(spec, self.ctx, label)
        self.results[(spec, rnd)] = res
        self.log(f"[bench] {label}: rc={res['rc']} wall {res['wall_s']:.1f}s first step {res.get('first_step_s')} "
                 f"steady {_fmt(res.get('steady_sps'))} samples/s load {res['load1']:.1f} ({time.time() - t:.0f}s)")
        if spec.launch == "warm" and spec.kind == "kit" and not self.plan.smoke:
            self._cluster_down()  # an idle cluster would steal CPU from the other cases

    def runs(self, case: str, name: str) -> list[dict]:
        if case in self.earlier:
            return self.earlier[case].runs(case, name)
        spec = self.plan.specs[case][name]
        return [self.results[(spec, r)] for r in range(self.rounds) if (spec, r) in self.results]


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.1f}"


# ---------------------------------------------------------------- figures per case

def med(runs: list[dict], key: str):
    return parse.median(r.get(key) for r in runs)


def paired(a: list[dict], b: list[dict], key_a: str, key_b: str | None = None) -> str:
    """Round-by-round ratios a/b (the same round ran both back to back): shows the noise."""
    qs = [parse.ratio(x.get(key_a), y.get(key_b or key_a)) for x, y in zip(a, b)]
    return "per round " + ", ".join("-" if q is None else f"{q:.3f}" for q in qs)


def rows_for(case: str, r: Runner) -> list[dict]:
    if r.plan.gpu and case == "a":
        return rows_gpu_a(r)
    return CASE_ROWS[case](r)


def _row(case, metric, kit, ref, ratio, target, ok, note="", single=False):
    """One figure row; ``single``: a figure of the kit's alone, with no reference by design."""
    return {"case": case, "metric": metric, "kit": kit, "ref": ref, "ratio": ratio, "target": target, "ok": ok,
            "note": note, "single": single}


def twin_rate_key(kit_runs: list[dict]) -> str:
    """The twin's rate defined like the kit's: the summary's counts evaluation between epochs, the
    progress lines (the fallback) do not."""
    from_lines = any(k.get("steady_source") == "progress lines" for k in kit_runs)
    return "steady_step_sps" if from_lines else "steady_sps"


def _throughput(case: str, title: str, limit: float):
    def rows(r: Runner) -> list[dict]:
        kit, twin = r.runs(case, "kit"), r.runs(case, "twin")
        k, t = med(kit, "steady_sps"), med(twin, twin_rate_key(kit))
        q = parse.ratio(k, t)
        same = [parse.same_losses(a.get("losses", []), b.get("losses", [])) for a, b in zip(kit, twin)]
        note = "same losses as the twin: " + ("yes" if same and all(same) else "NO" if False in same else "n/a")
        note += "; " + paired(kit, twin, "steady_sps", twin_rate_key(kit))
        kw, tw = med(kit, "wall_s"), med(twin, "wall_s")
        return [_row(case, f"{title} steady samples/s (kit / twin)", k, t, q, f">= {limit}",
                     q is not None and q >= limit, note),
                _row(case, "the same run, wall clock from start to exit (s; ratio = kit / twin)", kw, tw,
                     parse.ratio(kw, tw), "reported", kw is not None)]
    return rows


def rows_c(r: Runner) -> list[dict]:
    cold, twin, warm = r.runs("c", "kit cold"), r.runs("c", "twin"), r.runs("c", "kit warm")
    t = med(twin, "first_step_s")
    out = []
    for name, runs, limit in (("cold", cold, 10.0), ("warm", warm, 3.0)):
        k = med(runs, "first_step_s")
        gap = k - t if k is not None and t is not None else None
        out.append(_row("c", f"time to first step, {name} (s; ratio column = kit - twin)", k, t, gap,
                        f"<= +{limit:g} s", gap is not None and gap <= limit))
    return out + rows_default_job(r) + rows_tail(r)


def ready_to_first_step_s(run: dict):
    """Ray ready (the driver's ray.init returned) -> the first optimizer step, from the run's own timeline."""
    t = (run.get("summary") or {}).get("timeline") or {}
    ready, first = t.get("ray_ready_unix"), t.get("first_step_unix")
    return first - ready if ready and first else None


def rows_default_job(r: Runner) -> list[dict]:
    """The default job (configs/local.yaml) under `ray-app train` and under torchrun: the whole wall clock,
    Ray ready -> first step, and end of training -> exit."""
    if not {"kit default", "twin default"} <= set(r.plan.specs["c"]):  # the smoke runs no default job
        return []
    kit, twin = r.runs("c", "kit default"), r.runs("c", "twin default")
    if not kit or not twin:
        return []
    kw, tw = med(kit, "wall_s"), med(twin, "wall_s")
    q = parse.ratio(kw, tw)
    ready = parse.median(ready_to_first_step_s(x) for x in kit)
    kt, tt = parse.median(tail_s(x) for x in kit), parse.median(tail_s(x) for x in twin)
    gap = kt - tt if kt is not None and tt is not None else None
    return [
        _row("c", "the default job, wall clock from start to exit (s; ratio = kit / twin)", kw, tw, q, "<= 1.6",
             q is not None and q <= 1.6, paired(kit, twin, "wall_s") + " (kit / twin)"),
        *rows_plain_ray(r, twin),
        _row("c", "the default job, Ray ready -> first step (s)", ready, None, None, "<= 8 s",
             ready is not None and ready <= 8.0, single=True),
        _row("c", "the default job, end of training -> process exit (s; ratio = kit - twin)", kt, tt, gap,
             "<= +2 s", gap is not None and gap <= 2.0),
    ]


def rows_plain_ray(r: Runner, twin: list[dict]) -> list[dict]:
    """What plain Ray Train costs with its defaults (an empty train function: ray.init, its actors, the workers'
    torch process group, shut-down), and that cost plus the twin's own training time over the twin's wall
    clock, round by round: where a TorchTrainer job with Ray's defaults would stand against the twin."""
    alone = r.runs("c", "ray alone") if "ray alone" in r.plan.specs["c"] else []
    if not alone:
        return []
    aw, tw = med(alone, "wall_s"), med(twin, "wall_s")
    ratios = [parse.ratio(a["wall_s"] + (t.get("summary") or {}).get("train_seconds", 0.0), t["wall_s"])
              for a, t in zip(alone, twin)]
    q = parse.median(ratios)
    note = "per round " + ", ".join("-" if f is None else f"{f:.3f}" for f in ratios)
    return [_row("c", "Ray Train alone, an empty train function: wall clock from start to exit (s; ratio = / twin)",
                 aw, tw, parse.ratio(aw, tw), "reported", aw is not None),
            _row("c", "plain Ray Train + the twin's training, over the twin's wall clock", q,
                 None, None, "reported", q is not None, note, single=True)]


def tail_s(run: dict):
    """End of training -> process exit: the run's own clock for where training ended, the runner's for exit."""
    s = run.get("summary") or {}
    if run["kind"] == "kit":
        start = (s.get("timeline") or {}).get("model_ready_unix")
    else:
        start = (s.get("stamps") or {}).get("model")
    return run["t_end"] - (start + s["train_seconds"]) if start and s.get("train_seconds") else None


def rows_tail(r: Runner) -> list[dict]:
    case = "a" if "a" in r.cases else "c"
    names = ("kit", "twin") if case == "a" else ("kit cold", "twin")
    k, t = (parse.median(tail_s(x) for x in r.runs(case, n)) for n in names)
    return [_row("c", f"end of training -> process exit, runs of case ({case}) (s; ratio = kit - twin)", k, t,
                 k - t if k is not None and t is not None else None, "reported", k is not None)]


def rows_d(r: Runner) -> list[dict]:
    """Blocked time per checkpoint; end-to-end cost of checkpointing every epoch.

    The baseline for the end-to-end cost is a run that checkpoints once, at the end ("final"):
    every run that keeps its model pays that one commit, whatever the cadence. Without a
    "final" run (smoke, GPU) the baseline is the run with no checkpoint at all.
    """
    sync, asyn = r.runs("d", "sync"), r.runs("d", "async")
    bs, ba = med(sync, "ckpt_blocked_s"), med(asyn, "ckpt_blocked_s")
    q = parse.ratio(ba, bs)
    out = [_row("d", "blocked per checkpoint (sharded: each rank writes its share), async vs sync (s)", ba, bs, q, "<= 0.05", q is not None and q <= 0.05,
                paired(asyn, sync, "ckpt_blocked_s") + " (async / sync)")]
    modes = [m for m in ("sync", "async", "async process") if m in r.plan.specs["d"]]
    if "async process" in modes:
        proc = r.runs("d", "async process")
        bp = med(proc, "ckpt_blocked_s")
        q = parse.ratio(bp, bs)
        out.append(_row("d", "blocked per checkpoint, async written by DCP's checkpoint process vs sync (s)", bp, bs, q,
                        "<= 0.05", q is not None and q <= 0.05, paired(proc, sync, "ckpt_blocked_s") + " (process / sync)"))
    base = "final" if "final" in r.plan.specs["d"] else "none"
    e2e = {k: parse.median(_e2e(x) for x in r.runs("d", k)) for k in (base, *modes)}
    for mode in modes:
        q = parse.ratio(e2e[mode], e2e[base])
        cost = q - 1 if q is not None else None
        what = "a checkpoint at the end only" if base == "final" else "no checkpoint"
        out.append(_row("d", f"first step -> exit, checkpoint every epoch ({mode}) vs {what} (s; ratio = cost)",
                        e2e[mode], e2e[base], cost, "<= 0.03", cost is not None and cost <= 0.03))
    if "async folder" in r.plan.specs["d"]:
        fin, asy = (parse.median(_e2e(x) for x in r.runs("d", k)) for k in ("final folder", "async folder"))
        q = parse.ratio(asy, fin)
        out.append(_row("d", "first step -> exit, checkpoint every epoch (async) vs at the end only, both to a local "
                             "folder (s; ratio = cost)", asy, fin, q - 1 if q is not None else None, "reported",
                        q is not None))
    if base == "final":
        none = parse.median(_e2e(x) for x in r.runs("d", "none"))
        q = parse.ratio(e2e["final"], none)
        out.append(_row("d", "first step -> exit, one checkpoint at the end vs none (s; ratio = cost)",
                        e2e["final"], none, q - 1 if q is not None else None, "reported", q is not None))
    return out


def _e2e(run: dict):
    return run["t_end"] - run["first_step_unix"] if run.get("first_step_unix") else None


def rows_e(r: Runner) -> list[dict]:
    k, t = med(r.runs("e", "kit"), "recovery_s"), med(r.runs("e", "twin"), "recovery_s")
    gap = k - t if k is not None and t is not None else None
    return [_row("e", "SIGKILL of a worker -> first step after resume (s; ratio = kit - twin)", k, t, gap,
                 "reported", k is not None)]


def rows_f(r: Runner) -> list[dict]:
    out = []
    for side in ("kit", "twin"):
        key = "steady_sps" if side == "kit" else twin_rate_key(r.runs("f", "kit 2"))
        one, two = med(r.runs("f", f"{side} 1"), key), med(r.runs("f", f"{side} 2"), key)
        eff = two / (2 * one) if one and two is not None else None
        out.append(_row("f", f"scaling efficiency 1 -> 2 workers, {side} (samples/s 2 w vs 1 w)", two, one, eff,
                        "reported", eff is not None))
    return out


def rows_g(r: Runner) -> list[dict]:
    """Cost = 1 - the median of the per-round on/off ratios: each round ran both back to back,
    so slow drifts of the machine's load cancel within a pair."""
    ons, offs = r.runs("g", "on"), r.runs("g", "off")
    on, off = med(ons, "steady_sps"), med(offs, "steady_sps")
    q = parse.median(parse.ratio(x.get("steady_sps"), y.get("steady_sps")) for x, y in zip(ons, offs))
    cost = 1 - q if q is not None else None
    return [_row("g", "exporter on vs off, steady samples/s (ratio = cost, from the median per-round ratio)", on, off,
                 cost, "<= 0.01", cost is not None and cost <= 0.01, paired(ons, offs, "steady_sps") + " (on / off)")]


def rows_t(r: Runner) -> list[dict]:
    """Cost of tracking to a server that is down = 1 - the median per-round ratio to the run without tracking
    (each round ran them back to back): rank 0 only appends to a buffer, so it should be within noise."""
    offs, out = r.runs("t", "off"), []
    for name in ("refused", "hung"):
        ons = r.runs("t", name)
        q = parse.median(parse.ratio(x.get("steady_sps"), y.get("steady_sps")) for x, y in zip(ons, offs))
        cost = 1 - q if q is not None else None
        out.append(_row("t", f"MLflow server {name} vs no tracking, steady samples/s (ratio = cost)",
                        med(ons, "steady_sps"), med(offs, "steady_sps"), cost, "<= 0.02",
                        cost is not None and cost <= 0.02, paired(ons, offs, "steady_sps") + f" ({name} / off)"))
    return out


def rows_h(r: Runner) -> list[dict]:
    """Streamed shards vs map-style: the median of the per-round ratios of steady samples/s (each round ran both
    back to back), the S3 server's CPU in the streamed runs beside."""
    st, ms = r.runs("h", "streamed"), r.runs("h", "map-style")
    q = parse.median(parse.ratio(x.get("steady_sps"), y.get("steady_sps")) for x, y in zip(st, ms))
    w = r.shards_written.get("h")
    where = (f"{w['shards']} shards of {w['bytes'] / 1e6 / w['shards']:.2f} MB on moto, prefetch 2; " if w else "")
    rows = [_row("h", "streamed shards (data.name=shards from S3 on loopback) vs map-style from memory, workload (a), "
                 "steady samples/s (ratio from the median per-round ratio)", med(st, "steady_sps"),
                 med(ms, "steady_sps"), q, ">= 0.9", q is not None and q >= 0.9,
                 where + paired(st, ms, "steady_sps") + " (streamed / map-style)")]
    moto, total = parse.median(moto_cpu_s(x) for x in st), parse.median(moto_cpu_s(x, "total") for x in st)
    if moto is not None:
        rows.append(_row("h", "CPU seconds of moto_server in a streamed run, start to exit (median; ratio column = its "
                         "share of the run's CPU, the S3 server's included)", moto, total, parse.ratio(moto, total),
                         "reported", True, f"map-style runs: {_fmt(parse.median(moto_cpu_s(x) for x in ms))} s"))
    return rows


def moto_cpu_s(run: dict, role: str = "moto_server"):
    """CPU seconds of the S3 server during a run (or the run's whole, ``total``), from the CPU sampler."""
    cpu = run.get("cpu_in_run") or {}
    return cpu.get("total") if role == "total" else (cpu.get("roles") or {}).get(role, [0, None])[1] if cpu else None


def rows_gpu_a(r: Runner) -> list[dict]:
    """Case (a) on one GPU: kit vs bare loop, plus model FLOP utilization of each."""
    from bench import flops

    rows = _throughput("a", "one GPU, bf16, resnet50 128 px", 0.98)(r)
    fps = flops.flops_per_sample(r.plan.specs["a"]["kit"].overrides)
    peak, where = flops.peak_flops(report.gpu_name())
    k, t = med(r.runs("a", "kit"), "steady_sps"), med(r.runs("a", "twin"), "steady_sps")
    mk, mt = flops.mfu(fps, k, peak), flops.mfu(fps, t, peak)
    rows.append(_row("a", f"MFU ({fps / 1e9:.2f} GFLOP/sample fwd+bwd by FlopCounterMode; peak {where})", mk, mt,
                     parse.ratio(mk, mt), "reported", mk is not None))
    if "dataparallel" in r.plan.specs["a"]:
        dp = med(r.runs("a", "dataparallel"), "steady_sps")
        rows.append(_row("a", "DataParallel, all GPUs, one process (samples/s vs the kit's one worker)", dp, k,
                         parse.ratio(dp, k), "reported", dp is not None))
    return rows


def rows_v(r: Runner) -> list[dict]:
    """Start-up experiments: time to first step of each variant against the kit as it is (cold)."""
    names = [n for n in r.plan.specs["v"] if n != "kit"]
    out = []
    for key, what in (("first_step_s", "time to first step"), ("tail_s", "end of training -> exit")):
        base = parse.median(_v(x, key) for x in r.runs("v", "kit"))
        for name in names:
            v = parse.median(_v(x, key) for x in r.runs("v", name))
            out.append(_row("v", f"{what}, cold: {name} vs kit (s; ratio = difference)", v, base,
                            v - base if v is not None and base is not None else None, "lower", v is not None))
    return out


def _v(run: dict, key: str):
    return tail_s(run) if key == "tail_s" else run.get(key)


def _on_off_cost(case: str, what: str):
    """Cost of ``what`` = 1 - the median of the per-round on/off ratios of steady samples/s, for the workloads
    of (a) and (b)."""
    def rows(r: Runner) -> list[dict]:
        out = []
        for w, title in (("a", "compute-bound"), ("b", "communication-bound")):
            if f"{w} on" not in r.plan.specs[case]:
                continue  # the smoke measures one workload
            ons, offs = r.runs(case, f"{w} on"), r.runs(case, f"{w} off")
            q = parse.median(parse.ratio(x.get("steady_sps"), y.get("steady_sps")) for x, y in zip(ons, offs))
            cost = 1 - q if q is not None else None
            out.append(_row(case, f"{what} on vs off, {title} ({w}), steady samples/s (ratio = cost, "
                            "from the median per-round ratio)", med(ons, "steady_sps"), med(offs, "steady_sps"), cost,
                            "<= 0.005", cost is not None and cost <= 0.005,
                            paired(ons, offs, "steady_sps") + " (on / off)"))
        return out + in_step_rows(case, what, r.addon_cost)
    return rows


IN_STEP = {"r": ("pace_s", "pace_cost"), "j": ("journal_total_s", "journal_cost")}


def in_step_rows(case: str, what: str, figures: dict) -> list[dict]:
    """``what``'s own time inside the real two-rank step of each workload (bench/addon_cost.py): the
    whole-run ratio above moves by several per cent between runs on 2 cores, this resolves 0.5 %."""
    if case not in IN_STEP:
        return []
    seconds, cost = IN_STEP[case]
    return [_row(case, f"{what}'s own time inside the step, ({w}) {f['model']} (us a step vs the step's ms; "
                 "ratio = cost; bench/addon_cost.py)", f[seconds] * 1e6, f["step_s"] * 1e3, f[cost], "<= 0.005",
                 f[cost] <= 0.005) for w, f in figures.get("workloads", {}).items()]


# one overlapped all-reduce per step
rows_p = _on_off_cost("p", "preemption agreement")
# perf_counter marks per step, one all_gather of a few floats per log interval
rows_r = _on_off_cost("r", "every rank's pace")
# rank 0's events (attempt, first step, checkpoints, end) queued to a writer thread; goodput at each log
rows_j = _on_off_cost("j", "the run journal")


def rows_s(r: Runner) -> list[dict]:
    """Script mode: the same script under `ray-app run` and torchrun; the plug-in mode's start beside."""
    script, twin, plugin = r.runs("s", "ray-app run"), r.runs("s", "torchrun"), r.runs("s", "ray-app train")
    k, t = med(script, "steady_sps"), med(twin, "steady_sps")
    q = parse.ratio(k, t)
    same = [parse.same_losses(a.get("losses", []), b.get("losses", [])) for a, b in zip(script, twin)]
    note = "same losses: " + ("yes" if same and all(same) else "NO" if False in same else "n/a")
    out = [_row("s", "script mode steady samples/s (ray-app run / torchrun, the same script)", k, t, q, ">= 0.98",
                q is not None and q >= 0.98, note + "; " + paired(script, twin, "steady_sps"))]
    ks, ts, ps = med(script, "first_step_s"), med(twin, "first_step_s"), med(plugin, "first_step_s")
    out.append(_row("s", "time to first step, script mode (s; ratio column = ray-app run - torchrun)", ks, ts,
                    ks - ts if ks is not None and ts is not None else None, "reported", ks is not None))
    out.append(_row("s", "time to first step, script mode vs plug-in mode (s; ray-app run, ray-app train; "
                    "ratio column = difference)", ks, ps, ks - ps if ks is not None and ps is not None else None,
                    "reported", ks is not None))
    return out


def rows_m(r: Runner) -> list[dict]:
    """The speed switches, each on against all off, the kit and its twin with the same switches, every run of a
    round back to back: steady samples/s on / off of each side (the median per-round ratio; reported: on a CPU
    without bf16 units bf16 is slower, AC spends a forward of each block for memory), kit / twin with the
    switch on, each rank's peak resident memory (VmHWM) on / off and kit / twin, and compile's time to first step
    (cold in the first round, the bench's cache after it)."""
    specs, out = r.plan.specs["m"], []
    runs = {name: r.runs("m", name) for name in specs}
    rate = twin_rate_key(runs["kit off"])
    for name in ("off", *(n for n in SPEED_SWITCHES if f"kit {n}" in specs)):
        kit, twin = runs[f"kit {name}"], runs[f"twin {name}"]
        what = "every switch off" if name == "off" else f"{name} on"
        if name != "off":
            for side, on, off, key in (("kit", kit, runs["kit off"], "steady_sps"), ("twin", twin, runs["twin off"], rate)):
                q = parse.median(parse.ratio(x.get(key), y.get(key)) for x, y in zip(on, off))
                out.append(_row("m", f"{name}: {side} on / off, steady samples/s (the median per-round ratio)",
                                med(on, key), med(off, key), q, "reported", q is not None,
                                paired(on, off, key) + " (on / off)"))
        k, t = med(kit, "steady_sps"), med(twin, rate)
        same = [parse.same_losses(a.get("losses", []), b.get("losses", [])) for a, b in zip(kit, twin)]
        note = "same losses as the twin: " + ("yes" if same and all(same) else "NO" if False in same else "n/a")
        out.append(_row("m", f"{what}: kit / twin, steady samples/s", k, t, parse.ratio(k, t), "reported",
                        k is not None, note + "; " + paired(kit, twin, "steady_sps", rate)))
        pairs = [("kit / twin", kit, twin)]
        if name != "off":
            pairs = [("kit on / off", kit, runs["kit off"]), ("twin on / off", twin, runs["twin off"])] + pairs
        for title, a, b in pairs:
            pa, pb = rank_peaks(a), rank_peaks(b)
            ka, kb = max(pa, default=None), max(pb, default=None)
            out.append(_row("m", f"{what}: peak resident memory of a rank, {title} (MiB, VmHWM; the larger rank)",
                            ka, kb, parse.ratio(ka, kb), "reported", ka is not None,
                            f"each rank: {_mib(pa)} vs {_mib(pb)}"))
    if "kit compile" in specs:
        for side in ("kit", "twin"):
            on, off = runs[f"{side} compile"], runs[f"{side} off"]
            a, b = med(on, "first_step_s"), med(off, "first_step_s")
            out.append(_row("m", f"compile: time to first step, {side} on vs off (s; ratio column = difference; the "
                            "first round compiles cold, the later ones find the bench's cache)", a, b,
                            a - b if a is not None and b is not None else None, "reported", a is not None,
                            "per round " + ", ".join("-" if x.get("first_step_s") is None or y.get("first_step_s") is None
                                                     else f"{x['first_step_s'] - y['first_step_s']:+.1f}"
                                                     for x, y in zip(on, off))))
    return out


def rank_peaks(runs: list[dict]) -> list[float]:
    """Each rank's peak resident memory (MiB), the median over the runs, in rank order."""
    lists = [x.get("rank_peak_mib") or [] for x in runs]
    return [parse.median(peaks[i] for peaks in lists if i < len(peaks)) for i in range(max(map(len, lists), default=0))]


def _mib(peaks: list[float]) -> str:
    return "/".join(f"{p:.0f}" for p in peaks) or "-"


CASE_ROWS = {"a": _throughput("a", "compute-bound (resnet18)", 0.98),
             "b": _throughput("b", "communication-bound (wide_mlp)", 0.97),
             "c": rows_c, "d": rows_d, "e": rows_e, "f": rows_f, "g": rows_g, "h": rows_h, "p": rows_p, "r": rows_r, "s": rows_s,
             "j": rows_j,
             "t": rows_t, "v": rows_v, "m": rows_m}
CASE_ROWS["z"] = _throughput("z", "FSDP (train.strategy=fsdp, wide_mlp; twin: plain fully_shard)", 0.97)


def rows_l(r: Runner) -> list[dict]:
    """A Hugging Face language model under FSDP: steady target tokens/s (samples/s x the target tokens of a
    sequence: every training sequence is full) of the kit and of its own loop without Ray, each against the twin."""
    tokens = bench_lm.target_tokens_per_sample(r.plan.lm_size)
    kit, twin, loop = r.runs("l", "kit"), r.runs("l", "twin"), r.runs("l", "loop")
    t = med(twin, twin_rate_key(kit))
    out = []
    for runs, what, limit in ((kit, "the kit (ray-app train) / twin", 0.97),
                              (loop, "the kit's loop without Ray, under torchrun / twin", 0.98)):
        k = med(runs, "steady_sps")
        q = parse.ratio(k, t)
        same = [parse.same_losses(a.get("losses", []), b.get("losses", [])) for a, b in zip(runs, twin)]
        note = (f"{tokens} target tokens a sequence; same losses as the twin: "
                + ("yes" if same and all(same) else "NO" if False in same else "n/a"))
        note += "; " + paired(runs, twin, "steady_sps", twin_rate_key(kit))
        out.append(_row("l", f"Hugging Face LM under FSDP (model.name=hf, causal_lm, text), steady tokens/s, {what}",
                        k * tokens if k is not None else None, t * tokens if t is not None else None, q,
                        f">= {limit}", q is not None and q >= limit, note))
    kw, tw = med(kit, "wall_s"), med(twin, "wall_s")
    out.append(_row("l", "the same runs, wall clock from start to exit, kit / twin (s)", kw, tw, parse.ratio(kw, tw),
                    "reported", kw is not None))
    return out


CASE_ROWS["l"] = rows_l


# ---------------------------------------------------------------- well-formedness (smoke)

def problems(r: Runner, rows: list[dict]) -> list[str]:
    """What is missing or malformed (not whether the numbers are good)."""
    out = [f"{res['label']}: exit {res['rc']}" for res in r.results.values() if res["rc"] != 0]
    for row in rows:
        if row["kit"] is None or (row["ref"] is None and not row.get("single")):
            out.append(f"({row['case']}) {row['metric']}: no figure (kit {row['kit']}, reference {row['ref']})")
    for (spec, _), res in r.results.items():
        if spec.kind == "kit" and spec.launch in ("cold", "warm") and not res.get("breakdown"):
            out.append(f"{res['label']}: no start-up phases parsed")
    return out


# ---------------------------------------------------------------- main

def attach_earlier(runner: Runner, blocks: list[dict], wanted) -> None:
    """The earlier benches saved in a results.json ("earlier"): each wanted case not yet attached
    gets the runs of the bench it came from."""
    for block in blocks:
        earlier = Runner.saved(runner.plan, block["runs"], runner.ctx.workdir)
        runner.earlier.update({c: earlier for c in block["cases"] if wanted(c) and c not in runner.earlier})
    runner.rounds = max([runner.rounds, *(e.rounds for e in runner.earlier.values())])


def merge(runner: Runner, cases: list[str], old: dict, machine: dict) -> list[str]:
    """Add the cases not re-run now from an earlier bench (and from the benches it merged), each case with
    the runs of the bench it was measured in; returns every case the report covers."""
    mine = Runner.saved(runner.plan, old["runs"], runner.ctx.workdir)
    kept = [c for c in mine.cases if c not in cases]
    runner.earlier.update({c: mine for c in kept})
    if not runner.addon_cost:  # (r) and (j) not re-run now: their in-step figures are the earlier bench's
        runner.addon_cost = old.get("addon_cost", {})
    attach_earlier(runner, old.get("earlier", []), lambda c: c not in cases)  # what that bench had merged itself
    if not runner.earlier:
        return runner.cases
    runner.cases = [c for c in runner.plan.specs if c in runner.earlier or c in cases]
    om = old["machine"]
    machine["merged"] = machine.get("merged", []) + om.get("merged", []) + ([
        f"cases {','.join(kept)} from the bench of {om['date']} (kit {om.get('kit', '?')}, "
        f"load before {om['load_average']}, {om.get('bench_minutes', '?')} min); this run: cases {','.join(cases)}"]
        if kept else [])
    return runner.cases


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="every case once at tiny size; check the outputs only")
    p.add_argument("--gpu", action="store_true", help=f"one GPU, one worker, bf16: cases {GPU_CASES} (bench/gpu.sh)")
    p.add_argument("--cases", default=None, help="comma-separated subset of a..g")
    p.add_argument("--budget", type=float, default=0, help="seconds: start no round that would end after this")
    p.add_argument("--jobs", type=int, default=None, help="concurrent runs (smoke only; default 3 there, else 1)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; smoke 1)")
    p.add_argument("--out", default=str(BENCH), help="folder for RESULTS.md, results.png (and results.json, "
                   "except in bench/ itself: build/bench/results.json)")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder (logs of every run)")
    p.add_argument("--report-only", metavar="RESULTS_JSON", help="rewrite the report from a saved results.json")
    p.add_argument("--merge", metavar="RESULTS_JSON",
                   help="re-run only --cases; the other cases' runs come from this earlier results.json")
    p.add_argument("--variants", default=",".join(VARIANT_NAMES),
                   help="case v: bench/variants.py names to compare (the first is the reference, 'kit')")
    p.add_argument("--switches", default=",".join(SPEED_SWITCHES),
                   help=f"case m: which speed switches to turn on, each against all off ({','.join(SPEED_SWITCHES)})")
    args = p.parse_args(argv)
    switches = tuple(n.strip() for n in args.switches.split(",") if n.strip())
    if not switches or set(switches) - set(SPEED_SWITCHES):
        p.error(f"--switches: use names from {','.join(SPEED_SWITCHES)}")
    plan = Plan("smoke" if args.smoke else "gpu" if args.gpu else "full", tuple(args.variants.split(",")), switches)
    cases = [c.strip() for c in (args.cases or (GPU_CASES if args.gpu else DEFAULT_CASES)).split(",") if c.strip()]
    from bench.variants import VARIANTS

    if set(args.variants.split(",")) - set(VARIANTS) or not args.variants.startswith("kit"):
        p.error(f"--variants: start with kit and use names from {','.join(VARIANTS)}")
    unknown = set(cases) - set(plan.specs)
    if unknown:
        p.error(f"unknown cases {sorted(unknown)}; use a subset of {','.join(plan.specs)}")
    rounds = args.rounds or (1 if args.smoke else 3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    saved_json = results_json_path(out)
    saved_json.parent.mkdir(parents=True, exist_ok=True)
    # read before this run writes anything: --merge names the results.json this run will overwrite
    earlier = json.loads(Path(args.merge).read_text()) if args.merge else None
    workdir = Path(tempfile.mkdtemp(prefix="rb-", dir="/tmp"))  # short: Ray's socket paths live under it
    machine = report.machine_details()
    t0 = time.time()
    mode = "smoke" if args.smoke else "gpu" if args.gpu else "full"
    print(f"[bench] {mode}: cases {','.join(cases)}, {rounds} round(s), "
          f"scratch {workdir}, load average {machine['load_average']}", flush=True)
    if args.report_only:
        saved = json.loads(Path(args.report_only).read_text())
        runner = Runner.saved(plan, saved["runs"], workdir)  # labelled by the cases that bench ran
        attach_earlier(runner, saved.get("earlier", []), lambda c: c in cases and c not in runner.cases)
        runner.cases = [c for c in plan.specs if c in cases]
        runner.cluster_start_s = saved.get("cluster_start_s", [])
        runner.shards_written = saved.get("shards_written", {})
        runner.addon_cost = saved.get("addon_cost", {})
        machine = saved["machine"]
    else:
        with Runner(plan, cases, rounds, workdir, log=lambda m: print(m, flush=True), budget_s=args.budget,
                    jobs=(args.jobs or 3) if args.smoke else 1) as runner:
            runner.run_all()
            if {"r", "j"} & set(cases):  # their own time inside the step, resolving what the runs cannot
                from bench import addon_cost

                print("[bench] (r), (j): the pace's and the journal's own time inside the step", flush=True)
                runner.addon_cost = addon_cost.measure(["smoke"] if args.smoke else ["a", "b"], 10 if args.smoke else 40)
        machine["load_average_after"] = report.load_average()
        machine["kit_after"] = report.kit_version()  # the tree may change during a long bench
        machine["bench_minutes"] = round((time.time() - t0) / 60, 1)
    if earlier is not None:
        cases = merge(runner, cases, earlier, machine)
    # the figures first: a report that fails to render can be redone with --report-only
    saved_json.write_text(json.dumps({"machine": machine, "runs": list(runner.results.values()),
                                      "earlier": runner.saved_earlier(), "cluster_start_s": runner.cluster_start_s,
                                      "shards_written": runner.shards_written, "addon_cost": runner.addon_cost},
                                     default=str))
    rows = [row for c in cases for row in rows_for(c, runner)]
    report.write(out, rows, runner, machine, mode=mode, results_json=saved_json)
    bad = problems(runner, rows)
    for line in report.table_lines(rows):
        print(line)
    if not args.keep:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    if bad:
        print("[bench] malformed output:\n  " + "\n  ".join(bad), file=sys.stderr)
        return 1
    print(f"[bench] wrote {out / 'RESULTS.md'}, {out / 'results.png'}, {saved_json} "
          f"in {machine['bench_minutes']} min", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
