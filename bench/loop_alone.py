"""The kit's own loop without Ray, under torchrun: what the kit costs before Ray is around it.

    torchrun --standalone --nproc-per-node 2 bench/loop_alone.py --config configs/local.yaml --set ... --out OUT

Each rank builds what a Ray Train worker builds (``ray_app.worker.parts.build_parts``: data, model, FSDP or
DDP, the pretrained weights, task, samplers, optimizer) and runs ``ray_app.worker.loop.Trainer`` on it, the
loop ``ray-app train`` runs, with a runtime in place of Ray Train's (topology from torchrun's environment,
DDP wrapping, a report that is a barrier, as Ray Train's is), checkpoints off, no metrics exporter. Rank 0
appends the loop's summary (``steady_samples_per_second``, the first step, the phases) to ``--out`` as one
JSON line, in the twin's shape (``bench/twin.py``), so the bench reads both alike; its progress lines are the
kit's own.
"""

from __future__ import annotations

import time

T_SCRIPT = time.time()  # before the heavy imports: python start-up is torchrun's share

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ray_app.shared.config import load_config  # noqa: E402
from ray_app.shared.storage import LocalStorage  # noqa: E402
from ray_app.worker.checkpoint import Checkpointer  # noqa: E402
from ray_app.worker.loop import Trainer  # noqa: E402
from ray_app.worker.metrics import NullMetrics  # noqa: E402
from ray_app.worker.parts import build_parts  # noqa: E402
from ray_app.worker.progress import RunStats  # noqa: E402

T_IMPORTS = time.time()


class TorchrunRuntime:
    """What ``ray_app.worker.entry.RayRuntime`` gives the loop, from torchrun's environment: topology, DDP
    wrapping, and a report that is a barrier (``ray.train.report`` is one); nothing is uploaded."""

    def __init__(self):
        self.rank, self.world_size, self.device = dist.get_rank(), dist.get_world_size(), torch.device("cpu")

    def prepare_model(self, model, bucket_cap_mb: int = 25):
        return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True)

    def report(self, metrics: dict, local_dir=None, dir_name=None, upload=None) -> None:
        dist.barrier()  # sync point: as Ray Train's report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default=None, help="append rank 0's JSON line to this file")
    args = p.parse_args(argv)
    cfg = load_config(args.config, [*args.overrides, "checkpoint.every_epochs=0", "checkpoint.every_steps=0"])
    stamps = {"script": T_SCRIPT, "imports": T_IMPORTS}
    dist.init_process_group("gloo")
    stamps["process_group"] = time.time()
    runtime = TorchrunRuntime()
    stats = RunStats()
    with tempfile.TemporaryDirectory(prefix="loop-alone-") as scratch:
        checkpointer = Checkpointer(LocalStorage(scratch), cfg.run.name, runtime.report, every_epochs=0, every_steps=0)
        stamps["data"] = time.time()  # build_parts makes the data and the model: the phase "model + DDP" holds both
        parts = build_parts(cfg, runtime)
        stamps["model"] = time.time()
        summary = Trainer(cfg, runtime, parts, checkpointer, NullMetrics(), stats).fit()
    stamps["first_step"] = stats.timeline.get("first_step_unix")
    if runtime.rank == 0:
        line = json.dumps({"kind": "loop", **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                              for k, v in summary.items()},
                           "first_step_unix": stamps["first_step"], "stamps": stamps}, default=str)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)  # as bench/twin.py: gloo's static destructors sometimes abort a finished interpreter
