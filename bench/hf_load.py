"""Loading a pretrained Hugging Face model at 2 ranks under FSDP: the kit's ``model.name: hf`` (made on the
meta device, each rank reading only its rows of the safetensors) against a plug-in that calls
``from_pretrained`` on every rank and then shards. Each way runs in fresh processes (2 gloo ranks); each rank
reports its peak resident memory (``VmHWM``): the whole process's; above what it held once torch and
transformers were imported; and above what it held once the model's own code was imported too (transformers
imports a model's configuration and modeling modules, and with them torchvision, torch._dynamo, triton and
sympy, on first use: both ways import the same, so this is the part the loading itself holds); and its load
time, from the start of building the model to the sharded model ready. Alternating rounds; medians.

    python -m bench.hf_load [--layers 24 --hidden 1024] [--rounds 3] [--json OUT]

The default model is a Llama-architecture model of about 300M parameters with random weights, written
once with ``save_pretrained`` into a temporary folder (no hub).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta


def make_model(folder: str, layers: int, hidden: int) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8,
                      max_position_embeddings=2048, tie_word_embeddings=False)
    with torch.device("meta"):
        n = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    LlamaForCausalLM(cfg).save_pretrained(folder, max_shard_size="500MB")
    return n


def high_water_kib() -> int:
    """This process's peak resident memory (``VmHWM``, KiB). Not ``ru_maxrss``: that survives ``exec``, so a
    spawned rank would start at the high-water mark of the process that made the model."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def rank_main(rank: int, world: int, port: int, folder: str, how: str, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    import transformers  # noqa: F401 - imported by both ways: its import is not the load

    from ray_app.worker.strategy import fully_shard_model

    base = high_water_kib()
    import transformers.models.llama.modeling_llama  # noqa: F401 - the model's code, imported by both ways

    code = high_water_kib()
    t0 = time.perf_counter()
    if how == "kit":
        from ray_app.shared.hf import pretrained
        from ray_app.worker.pretrained import load_pretrained

        model = fully_shard_model(pretrained(folder), torch.device("cpu"), world)
        load_pretrained(model, torch.device("cpu"))
    else:  # a plug-in calling from_pretrained on every rank, then the kit's sharding
        from transformers import AutoModelForCausalLM

        model = fully_shard_model(AutoModelForCausalLM.from_pretrained(folder), torch.device("cpu"), world)
    dist.barrier()
    seconds = time.perf_counter() - t0
    peak = high_water_kib()
    out.put({"rank": rank, "how": how, "seconds": seconds, "peak_mib": peak / 1024, "start_mib": base / 1024,
             "code_mib": code / 1024})
    out.close()
    out.join_thread()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def one_round(folder: str, how: str) -> list[dict]:
    import torch.multiprocessing as mp

    from tests.support.ports import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, 2, port, folder, how, out)) for r in range(2)]
    for p in procs:
        p.start()
    rows = [out.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(60)
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-hf-load-") as folder:
        params = make_model(folder, args.layers, args.hidden)
        runs = []
        for _ in range(args.rounds):
            for how in ("kit", "from_pretrained"):
                runs += one_round(folder, how)
    result = {"params": params, "rounds": args.rounds, "runs": runs}
    for how in ("kit", "from_pretrained"):
        mine = [r for r in runs if r["how"] == how]
        result[how] = {"peak_mib": statistics.median(r["peak_mib"] for r in mine),
                       "above_start_mib": statistics.median(r["peak_mib"] - r["start_mib"] for r in mine),
                       "above_code_mib": statistics.median(r["peak_mib"] - r["code_mib"] for r in mine),
                       "seconds": statistics.median(r["seconds"] for r in mine)}
    result["peak_ratio"] = result["kit"]["peak_mib"] / result["from_pretrained"]["peak_mib"]
    for above in ("above_start", "above_code"):
        result[f"{above}_ratio"] = result["kit"][f"{above}_mib"] / result["from_pretrained"][f"{above}_mib"]
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
