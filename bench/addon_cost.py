"""What every rank's pace and the run journal add to a training step, timed inside the step.

A whole run's throughput on a 2-core machine moves by several per cent from run to run (bench/RESULTS.md),
far more than the <= 0.5 % these add-ons may cost, so the interleaved on/off runs of cases (r) and (j)
cannot resolve it. This times the add-ons' own work directly, in two gloo ranks (one thread each) running
the real DDP step of workload (a) (resnet18) or (b) (wide_mlp) as bench/run.py configures them, built by
the kit's own config, data, model and optimizer factories.

- **pace marks** (``perf_counter`` in the loader, the forward hooks, after backward and after the
  optimizer step): the same loop with the pace on and off over a step that does almost nothing (a 4x4
  linear layer), in interleaved blocks; the difference per step. It does not depend on the step's size.
- **pace exchange** (at each log interval: one ``all_gather``, rank 0's Prometheus gauges and straggler
  check): its median wall time in the real step loop, both ranks let in together by an untimed barrier:
  a rank that arrives early waits for the other at this sync point or, without it, in the next
  all-reduce, so that wait is not the exchange's cost.
- **journal, training thread** (rank 0's calls at each step and each log interval, the goodput
  included): the thread's CPU seconds inside them in the real step loop (a wall clock would also count
  the moments the OS gave the core to another process).
- **journal, writer thread**: the seconds to write one event to a local run folder, times the events
  rank 0 writes in one run of the workload (attempt, first step, trained, one checkpoint an epoch), spread
  over the run's steps; counted as if it took the training thread's time (it runs beside it).

cost = the add-on's seconds per step / the step's median seconds.

    python -m bench.addon_cost [--workloads a,b] [--steps 40] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

TARGET = 0.005
# bench/run.py's workloads (their --set values), built as the kit builds them; "smoke" is the test's
WORKLOADS = {"a": ("full", "compute"), "b": ("full", "comm"), "smoke": ("smoke", "compute")}


def workload_config(name: str):
    """The kit's config of one of bench/run.py's workloads."""
    from bench.run import WORKLOADS as RUN_WORKLOADS
    from ray_app.shared.config import load_config

    size, kind = WORKLOADS[name]
    return load_config(None, list(RUN_WORKLOADS[size][kind]))


# ---------------------------------------------------------------- the pace's marks, per step

def marks_seconds(steps: int = 4000, rounds: int = 9) -> float:
    """Seconds per step the pace's marks add: the same near-empty step with the pace on and off, blocks
    interleaved, the median of the rounds' differences."""
    from ray_app.worker.metrics import NullMetrics
    from ray_app.worker.pace import Pace

    batches = [torch.ones(1, 4)] * steps
    loops = {}
    for on in (True, False):
        module = torch.nn.Linear(4, 4)
        loops[on] = (module, Pace(0, 1, module, NullMetrics(), torch.device("cpu"), 1, enabled=on))

    def block(on: bool) -> float:
        module, pace = loops[on]
        t0 = time.perf_counter()
        with torch.no_grad():
            for x in pace.timed(batches):
                module(x)
                pace.backward_done()
                pace.stepped()
        return time.perf_counter() - t0

    diffs = []
    for _ in range(rounds):
        on, off = block(True), block(False)
        diffs.append((on - off) / steps)
    return max(0.0, statistics.median(diffs))


# ---------------------------------------------------------------- the journal's writer, per event

def event_write_seconds(events: int = 60) -> float:
    """Median seconds to write one journal event to a local run folder (the writer thread's work)."""
    from ray_app.shared.journal import JournalWriter
    from ray_app.shared.storage import LocalStorage

    with tempfile.TemporaryDirectory() as d:
        w = JournalWriter(LocalStorage(d), "run", source="rank0")
        times = []
        for i in range(events):
            event = {"kind": "checkpoint", "time": time.time(), "source": "rank0", "launch": "l", "attempt": "a",
                     "global_step": i, "uri": f"{d}/run/checkpoint_{i:06d}", "blocked_seconds": 0.01}
            t0 = time.perf_counter()
            w._write(event)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


# ---------------------------------------------------------------- the real step, two gloo ranks

def _rank(rank: int, world: int, port: int, workload: str, steps: int, folder: str, out) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader

    from ray_app.shared.journal import JournalSink, JournalWriter
    from ray_app.shared.plugins import build_data, build_model
    from ray_app.shared.storage import LocalStorage
    from ray_app.worker.metrics import PrometheusMetrics
    from ray_app.worker.pace import Pace
    from ray_app.worker.parts import build_optimizer

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = workload_config(workload)
    train_set, _, info = build_data(cfg)
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg, info)
    ddp = DDP(model)
    opt, _ = build_optimizer(cfg, ddp, steps_per_epoch=steps, total_steps=steps)
    loss_fn = torch.nn.CrossEntropyLoss()
    warmup, batch, log_every = 5, cfg.data.batch_size, cfg.train.log_every_steps
    batches = [b for _, b in zip(range(4), DataLoader(train_set, batch_size=batch))]
    loader = [batches[i % len(batches)] for i in range(warmup + steps)]
    metrics = PrometheusMetrics(0)  # rank 0's gauges, set as the kit sets them (no HTTP server needed)
    pace = Pace(rank, world, model, metrics, torch.device("cpu"), batch, say=lambda *_: None)
    sink = None
    if rank == 0:
        storage = LocalStorage(folder)
        sink = JournalSink(JournalWriter(storage, "run", source="rank0"), storage, "run", goodput=metrics)
        sink.start(world_size=world)
    walls, exchanges, journal = [], [], 0.0
    cpu = time.thread_time  # the journal's calls: this thread's CPU seconds, which a preemption does not inflate
    last = time.perf_counter()
    for i, (x, y) in enumerate(pace.timed(loader), start=1):
        loss = loss_fn(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        pace.backward_done()
        opt.step()
        pace.stepped()
        c0 = cpu()
        if sink is not None:
            sink.on_step(0.0)
        spent = cpu() - c0
        if i % log_every == 0:
            dist.barrier()  # not timed: the ranks' phase difference, which the next all-reduce would hold anyway
            t0 = time.perf_counter()
            pace.exchange(i)
            took = time.perf_counter() - t0
            c0 = cpu()
            if sink is not None:
                sink.on_progress(global_step=i, loss=loss.item())
            spent += cpu() - c0
            if i > warmup:
                exchanges.append(took)
        now = time.perf_counter()
        if i > warmup:
            walls.append(now - last)
            journal += spent
        last = now
    if sink is not None:
        sink.close()
    dist.destroy_process_group()
    out.put({"rank": rank, "step_s": statistics.median(walls),
             "exchange_s": statistics.median(exchanges) / log_every,  # the median exchange, once an interval
             "journal_s": journal / steps})


def real_step(workload: str, steps: int) -> dict:
    """Both ranks' median step, and the exchange's and the journal's seconds per step (rank 0's journal)."""
    import torch.multiprocessing as mp

    from bench.measure import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, 2, port, workload, steps, folder, out)) for r in range(2)]
        for p in procs:
            p.start()
        rows = []
        while len(rows) < len(procs):
            try:
                rows.append(out.get(timeout=1.0))
            except queue.Empty:
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed:  # one rank raised: the other waits in a collective for ever
                    for p in procs:
                        p.kill()
                    raise RuntimeError(f"rank {failed[0]} of the measured step failed (its traceback is above)") from None
        for p in procs:
            p.join(timeout=60)
    rows.sort(key=lambda r: r["rank"])
    return {"step_s": max(r["step_s"] for r in rows), "exchange_s": max(r["exchange_s"] for r in rows),
            "journal_s": rows[0]["journal_s"]}


def measure(workloads: list[str], steps: int, marks_steps: int = 4000, marks_rounds: int = 9, events: int = 60) -> dict:
    marks = marks_seconds(marks_steps, marks_rounds)
    write = event_write_seconds(events)
    result = {"marks_s_per_step": marks, "event_write_s": write, "workloads": {}}
    for w in workloads:
        cfg = workload_config(w)
        run_steps = cfg.train.epochs * cfg.data.args["num_samples"] // (2 * cfg.data.batch_size)  # 2 ranks
        events = 3 + cfg.train.epochs  # attempt, first step, trained; at most a checkpoint an epoch
        r = real_step(w, steps)
        pace = marks + r["exchange_s"]
        journal = r["journal_s"] + events * write / run_steps
        result["workloads"][w] = {**r, "model": cfg.model.name, "pace_s": pace, "journal_total_s": journal,
                                  "pace_cost": pace / r["step_s"], "journal_cost": journal / r["step_s"]}
    return result


def table(result: dict) -> str:
    rows = ["| workload | step (ms) | pace: marks + exchange (us a step) | pace cost | journal: calls + writes "
            "(us a step) | journal cost | target |", "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for w, r in result["workloads"].items():
        rows.append(f"| ({w}) {r['model']} | {r['step_s'] * 1e3:.1f} | {result['marks_s_per_step'] * 1e6:.1f} + "
                    f"{r['exchange_s'] * 1e6:.1f} | {r['pace_cost']:.4%} | {r['journal_s'] * 1e6:.1f} + "
                    f"{(r['journal_total_s'] - r['journal_s']) * 1e6:.1f} | {r['journal_cost']:.4%} | "
                    f"<= {TARGET:.1%} each |")
    rows.append(f"\nOne journal event written to a local folder: {result['event_write_s'] * 1e3:.3f} ms.")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="a,b", help="comma-separated: a (resnet18), b (wide_mlp)")
    p.add_argument("--steps", type=int, default=40, help="measured steps of the real step loop (after 5 warm-up)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = set(workloads) - {"a", "b"}
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}; use a subset of a,b")
    result = measure(workloads, args.steps)
    print(table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    over = [w for w, r in result["workloads"].items() if max(r["pace_cost"], r["journal_cost"]) > TARGET]
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
