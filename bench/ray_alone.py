"""Ray alone: how long Ray Train itself takes to start an empty train function, no kit code at all.

    OMP_NUM_THREADS=1 python bench/ray_alone.py [--dashboard] [--workers 2] [--rounds 3]

A local ``ray.init`` (2 CPUs worth of workers), a plain ``TorchTrainer`` whose train function only
writes the time it was entered, and the phases of one run, as JSON lines: ``init`` (ray.init),
``import`` (ray.train.torch on the driver), ``ready_to_train_fn`` (ray.init returned -> the first line
of the train function on rank 0), ``train_fn_to_fit_return`` (its end -> ``fit`` returned on the
driver) and ``shutdown`` (ray.shutdown): what plain Ray Train, with its defaults, costs with no kit code.
Case (c) of bench/run.py runs it beside the kit's default job and the twin in every round.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def one_run(dashboard: bool, workers: int) -> dict:
    import ray

    t0 = time.time()
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=dashboard, logging_level="WARNING")
    ready = time.time()
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    imported = time.time()
    mark = tempfile.mktemp(prefix="ray-alone-")

    def train_fn(config):
        import ray.train

        if ray.train.get_context().get_world_rank() == 0:
            with open(config["mark"], "w") as f:
                f.write(str(time.time()))

    trainer = TorchTrainer(train_fn, train_loop_config={"mark": mark}, scaling_config=ScalingConfig(num_workers=workers),
                           run_config=RunConfig(storage_path=tempfile.mkdtemp(prefix="ray-alone-"), name="alone"))
    trainer.fit()
    returned = time.time()
    ray.shutdown()
    done = time.time()
    with open(mark) as f:
        entered = float(f.read())
    os.unlink(mark)
    return {"dashboard": dashboard, "init": round(ready - t0, 2), "import": round(imported - ready, 2),
            "ready_to_train_fn": round(entered - ready, 2), "train_fn_to_fit_return": round(returned - entered, 2),
            "shutdown": round(done - returned, 2), "train_fn_unix": entered}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dashboard", action="store_true", help="start Ray's dashboard (ray.init's default with ray[default])")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="runs, each in a fresh process")
    args = p.parse_args()
    if args.rounds == 1:
        print(json.dumps(one_run(args.dashboard, args.workers)), flush=True)
        return
    import subprocess
    import sys

    for _ in range(args.rounds):  # a fresh interpreter each time: nothing imported or started is reused
        cmd = [sys.executable, __file__, "--workers", str(args.workers)] + (["--dashboard"] if args.dashboard else [])
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
