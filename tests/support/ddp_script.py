"""A torchrun-style DDP script and a failing one, written into a folder by the script-mode tests.

``TRAIN`` has the source article's structure: env:// ``init_process_group``, ``DistributedSampler`` with
``set_epoch``, DDP, an all_reduce of the logged loss, an all_gather eval, rank-0 prints, seeded; with
``--checkpoint`` it uses ``ray_app.script``'s save / load. ``FAILS`` raises in its own function.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

TRAIN = '''
    """A DDP script as torchrun runs it: env:// init, DistributedSampler + set_epoch, DDP, all_reduce of the
    logged loss, all_gather eval, rank-0 prints, seeded."""
    import argparse
    import hashlib
    import json
    import os
    import socket
    import time

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
            "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"]


    def blobs(n, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 8, generator=g)
        return TensorDataset(x, (x @ torch.randn(8, 3, generator=g)).argmax(1))


    def digest(model):
        sd = model.state_dict()
        return hashlib.sha256(b"".join(sd[k].numpy().tobytes() for k in sorted(sd))).hexdigest()[:16]


    def main():
        p = argparse.ArgumentParser()
        p.add_argument("--epochs", type=int, default=3)
        p.add_argument("--lr", type=float, default=0.1)
        p.add_argument("--sleep", type=float, default=0.0)        # seconds per epoch: room to kill a worker
        p.add_argument("--mark", default="")                       # a folder: each rank's env, finished epochs
        p.add_argument("--checkpoint", action="store_true")        # use ray_app.script's save / load
        p.add_argument("--where", action="store_true")             # every rank says where it runs
        p.add_argument("--tag", default="")                        # saved with each checkpoint: whose it is
        args = p.parse_args()

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        if args.where:
            host = socket.gethostname()
            print(f"rank {rank}/{world} on host {host} ip {socket.gethostbyname(host)}", flush=True)
        if args.mark:
            with open(os.path.join(args.mark, f"env-{rank}.json"), "w") as f:
                json.dump({k: os.environ.get(k) for k in KEYS}, f)
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3)))
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        train, test = blobs(301, 1), blobs(97, 2)
        sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0)
        loader = DataLoader(train, batch_size=16, sampler=sampler)
        test_loader = DataLoader(test, batch_size=32, sampler=DistributedSampler(test, shuffle=False))

        start = 0
        if args.checkpoint:
            from ray_app import script as kit

            state = kit.load()
            if state is not None:
                model.module.load_state_dict(state["model"])
                opt.load_state_dict(state["optimizer"])
                start = state["epoch"] + 1
        step = start * len(loader)
        for epoch in range(start, args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for x, y in loader:
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                step += 1
                if step % 5 == 0:
                    stats = torch.tensor([loss.item() * len(y), len(y)], dtype=torch.float64)
                    dist.all_reduce(stats)
                    if rank == 0:
                        print(f"step {step} loss {(stats[0] / stats[1]).item():.6f}", flush=True)
            model.eval()
            with torch.no_grad():
                hits = torch.cat([(model(x).argmax(1) == y).long() for x, y in test_loader])
            gathered = [torch.zeros_like(hits) for _ in range(world)]
            dist.all_gather(gathered, hits)
            if rank == 0:
                print(f"epoch {epoch} eval_accuracy {torch.cat(gathered).double().mean().item():.6f}", flush=True)
            if args.checkpoint:
                kit.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                          "tag": args.tag})
            if args.mark and rank == 0:
                open(os.path.join(args.mark, f"epoch-{epoch}"), "w").close()
            time.sleep(args.sleep)
        if rank == 0:
            print(f"final parameters {digest(model.module)}", flush=True)
        dist.destroy_process_group()


    if __name__ == "__main__":
        main()
'''

FAILS = '''
    import os

    import torch.distributed as dist

    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:1")  # not the kit's backend: one notice
    if dist.get_rank() == 0:
        print("attempt started", flush=True)
    dist.barrier()


    def step(n):
        raise ValueError(f"bad batch {n} on rank {os.environ['RANK']}")


    step(3)
'''


def lines_of(text: str) -> list[str]:
    """What the script printed on rank 0, without Ray's "(RayTrainWorker pid=...)" prefixes."""
    return re.findall(r"(?m)((?:step \d+ loss|epoch \d+ eval_accuracy|final parameters) \S+)$", text)


def write_scripts(folder: Path) -> Path:
    """train.py and fails.py in ``folder``."""
    (folder / "train.py").write_text(textwrap.dedent(TRAIN))
    (folder / "fails.py").write_text(textwrap.dedent(FAILS))
    return folder
