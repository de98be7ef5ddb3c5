"""The one-GPU check's language-model part (bench/gpu.sh): a Llama-architecture model of about 1B parameters
trained with every speed switch on, by the kit and by its bare twin, one GPU, one worker each.

    python bench/gpu_lm.py --out bench/gpu --timeout 180                   # on the GPU (bench/gpu.sh)
    python bench/gpu_lm.py --out /tmp/lm --timeout 900 --size tiny --device cpu --peak-tflops 0.05
                                                                           # the same path, tiny, on a CPU

- The model: transformers' ``LlamaConfig`` (hidden 2048, 16 layers, 32 heads, MLP 5504, vocabulary 32000, untied
  head: 0.94B parameters) with random weights (seed 0), made on the GPU and written by ``save_pretrained``
  (bf16 safetensors) into ``build/bench/gpu-lm-<size>/``; the kit reads it as ``model.name: hf`` (fp32 master
  weights), the twin (``bench/twin.py --device cuda``) loads the same folder with ``from_pretrained``.
- The data: random token ids (``data.name: bench.gpu_lm:random_tokens``, seeded: the same for both), sequences
  of 2048 tokens, 8 a step, ``task.name: causal_lm``; no download, no tokenizer.
- Both sides: ``train.precision=bf16-mixed`` (one worker: bf16 autocast), ``train.compile=true`` and
  ``train.activation_checkpointing=full`` on each decoder layer, AdamW, ``train.max_steps`` steps. The twin runs
  first and compiles cold; the kit then finds the twin's compiled code in the same cache
  (``train.compile_cache_dir``): the time to the first step is shown, compile's cost is not what is compared.
- Figures: steady tokens/s (steady samples/s x the target tokens of a sequence, every sequence full: the
  kit's and the twin's samples/s are counted the same way, from the end of step 5), MFU (FLOPs per step as the
  kit counts them: ``FlopCounterMode`` on its real step, activation checkpointing's recomputation included; the
  same count for the twin, which does the same work; over the GPU's dense bf16 peak), the kit's own summary
  figures beside (``steady_tokens_per_second``, ``steady_mfu``), peak GPU memory (kit: rank 0's
  ``ray_app_gpu_memory_max_allocated_bytes``; twin: ``torch.cuda.max_memory_allocated``) and each rank's peak
  resident memory on the host (VmHWM).

It appends its section to OUT/RESULTS.md (the page ``bench/run.py --gpu`` wrote) and keeps its figures in
gpu-lm.json beside that run's results.json. A run that fails is one line and exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_page import CheckFailed, page_missing  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SIZES = {
    # 0.94B parameters; 8 x 2048 tokens a step; 30 steps (the steady window: steps 6-30)
    "full": {"hidden": 2048, "layers": 16, "heads": 32, "mlp": 5504, "vocab": 32000, "seq_len": 2048, "batch": 8,
             "steps": 30},
    # the same code path in seconds (a CPU's check that nothing is misspelled)
    "tiny": {"hidden": 64, "layers": 2, "heads": 4, "mlp": 128, "vocab": 512, "seq_len": 64, "batch": 4,
             "steps": 12},
}
SWITCHES = ("train.precision=bf16-mixed", "train.compile=true", "train.activation_checkpointing=full")


# ---------------------------------------------------------------- the data plug-in (kit and twin)

def random_tokens(vocab_size: int, seq_len: int, num_samples: int, eval_samples: int = 8, seed: int = 0):
    """``data.name: bench.gpu_lm:random_tokens``: ``num_samples`` training and ``eval_samples`` evaluation
    sequences of ``seq_len`` token ids drawn uniformly from the vocabulary (a seeded generator), every token a
    target (``labels`` = ``input_ids``, no padding): ``causal_lm``'s samples."""
    import torch

    from ray_app.shared.text import PackedText

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (num_samples + eval_samples, seq_len), generator=g)
    mask = torch.ones_like(ids)
    train = PackedText(ids[:num_samples], ids[:num_samples], mask[:num_samples])
    evaluation = PackedText(ids[num_samples:], ids[num_samples:], mask[num_samples:])
    return train, evaluation, {"vocab_size": vocab_size, "seq_len": seq_len}


# ---------------------------------------------------------------- the model folder

def folder(size: str) -> Path:
    return REPO / "build" / "bench" / f"gpu-lm-{size}"


def make_model(size: str, device: str) -> tuple[Path, int]:
    """Write the model's folder afresh (random weights, seed 0, made on ``device``, bf16 safetensors);
    returns it and the model's parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    s, out = SIZES[size], folder(size) / "model"
    shutil.rmtree(out, ignore_errors=True)
    cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["mlp"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["heads"],
                      max_position_embeddings=s["seq_len"], tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    model.to(torch.bfloat16).save_pretrained(out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out, params


def overrides(size: str, model_dir: Path, cache: Path, peak_tflops: float) -> tuple[str, ...]:
    """The --set values of both sides: model, data, task, optimizer, the three switches, the steps."""
    s = SIZES[size]
    return ("model.name=hf", f"model.args.path={model_dir}", "task.name=causal_lm",
            "data.name=bench.gpu_lm:random_tokens", f"data.args.vocab_size={s['vocab']}",
            f"data.args.seq_len={s['seq_len']}", f"data.args.num_samples={s['batch'] * s['steps']}",
            f"data.batch_size={s['batch']}", "train.epochs=1", f"train.max_steps={s['steps']}",
            "train.log_every_steps=5", "train.optimizer=adamw", "train.lr=0.0003", "train.weight_decay=0.0",
            "train.warmup_epochs=0", "checkpoint.every_epochs=0", "checkpoint.every_steps=0", *SWITCHES,
            f"train.compile_cache_dir={cache}", *((f"train.peak_tflops={peak_tflops}",) if peak_tflops else ()))


# ---------------------------------------------------------------- the runs

def run_both(size: str, device: str, timeout: float, peak_tflops: float) -> dict:
    """Make the model, then the twin (its compile cold), then the kit (the twin's compile cache); their figures."""
    from bench import measure

    t0 = time.time()
    model_dir, params = make_model(size, device)
    made_s = time.time() - t0
    print(f"[gpu-lm] {_count(params)} parameters written to {model_dir} in {made_s:.0f}s", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="rbl-", dir="/tmp"))  # short: Ray's socket paths live under it
    try:
        sets = overrides(size, model_dir, workdir / "inductor", peak_tflops)
        gpu = ("scaling.use_gpu=true",) if device == "cuda" else ()
        ctx = measure.Context(workdir=workdir, timeout=max(30.0, 0.55 * (timeout - (time.time() - t0))))
        twin = measure.run(measure.Spec("twin", sets, workers=1, device=device, rank_memory=True), ctx, "lm/twin")
        _check(twin, "the twin (bench/twin.py)")
        ctx.timeout = max(30.0, timeout - (time.time() - t0) - 5)
        kit = measure.run(measure.Spec("kit", sets + gpu, workers=1, scrape_every=1.0, rank_memory=True), ctx,
                          "lm/kit")
        _check(kit, "the kit (ray-app train)")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return figures(size, device, params, made_s, kit, twin, peak_tflops)


def _check(run: dict, what: str) -> None:
    if run["rc"] != 0 or not run.get("steady_sps"):
        tail = Path(run["dir"]) / "output.log"
        said = tail.read_text().strip().splitlines()[-12:] if tail.exists() else []
        print("\n".join(said), file=sys.stderr)
        raise CheckFailed(f"{what} failed (exit {run['rc']}; steady samples/s {run.get('steady_sps')}); "
                          "its last lines are above")


def figures(size: str, device: str, params: int, made_s: float, kit: dict, twin: dict, peak_tflops: float) -> dict:
    from bench import flops, parse, report

    s = SIZES[size]
    tokens = s["seq_len"] - 1  # the targets of a full sequence (the task shifts by one)
    summary, twin_summary = kit.get("summary") or {}, twin.get("summary") or {}
    peak, where = (peak_tflops * 1e12, "--peak-tflops") if peak_tflops else flops.peak_flops(report.gpu_name())
    per_step = summary.get("flops_per_step")  # the kit's count of its real step (one worker: its whole batch)
    per_sample = per_step / s["batch"] if per_step else None
    side = {}
    for name, run, gpu_bytes in (("kit", kit, kit.get("gpu_peak_bytes")),
                                 ("twin", twin, twin_summary.get("cuda_peak_bytes"))):
        sps = run.get("steady_sps")
        side[name] = {"steady_samples_per_second": sps, "steady_tokens_per_second": sps * tokens if sps else None,
                      "mfu": flops.mfu(per_sample, sps, peak), "gpu_peak_gib": gpu_bytes / 2**30 if gpu_bytes else None,
                      "rank_peak_mib": run.get("rank_peak_mib"), "first_step_s": run.get("first_step_s"),
                      "wall_s": run.get("wall_s"), "last_logged_loss": (run.get("losses") or [[None, None]])[-1][1]}
    return {"size": size, "device": device, "params": params, "model_written_s": round(made_s, 1), "config": s,
            "switches": list(SWITCHES), "peak": where, "flops_per_step": per_step, **side,
            "kit_summary": {k: summary.get(k) for k in ("steady_tokens_per_second", "steady_mfu",
                                                        "steady_samples_per_second", "train_tokens")},
            "tokens_ratio": parse.ratio(side["kit"]["steady_tokens_per_second"],
                                        side["twin"]["steady_tokens_per_second"]),
            "same_losses": parse.same_losses(kit.get("losses", []), twin.get("losses", []), tol=2e-2)}


# ---------------------------------------------------------------- the page

def section(f: dict) -> list[str]:
    s, kit, twin = f["config"], f["kit"], f["twin"]

    def row(what, key, digits, scale=1.0):
        a, b = kit[key], twin[key]
        q = a / b if a is not None and b else None
        return f"| {what} | {_num(a, digits, scale)} | {_num(b, digits, scale)} | {_num(q, 3)} |"

    def rss(v):
        return "/".join(f"{x:.0f}" for x in v) if v else "-"

    ks = f["kit_summary"]
    same = {True: "yes", False: "NO", None: "n/a"}[f["same_losses"]]
    return [
        f"## A {_count(f['params'])}-parameter Llama on one {'GPU' if f['device'] == 'cuda' else 'CPU'}: "
        "bf16-mixed, compile, full activation checkpointing", "",
        f"`bench/gpu_lm.py`: transformers' `LlamaConfig` (hidden {s['hidden']}, {s['layers']} layers, {s['heads']} "
        f"heads, MLP {s['mlp']}, vocabulary {s['vocab']}), random weights written with `save_pretrained` in "
        f"{f['model_written_s']} s; random token ids, {s['batch']} sequences of {s['seq_len']} a step, "
        f"{s['steps']} steps, AdamW, one worker; `{' '.join(f['switches'])}` on both sides. The kit: "
        f"`ray-app train`, `model.name=hf`, `task.name=causal_lm`; the twin: `bench/twin.py --device {f['device']}`, "
        "`from_pretrained` of the same folder, the same switches in plain torch. The twin compiled cold, the kit "
        "found its compiled code in the same cache.", "",
        "| | kit | twin | kit / twin |", "| --- | ---: | ---: | ---: |",
        row("steady tokens/s (samples/s x target tokens a sequence)", "steady_tokens_per_second", 0),
        row(f"MFU (FLOPs per step counted by the kit, AC's recomputation included; peak {f['peak']})", "mfu", 3),
        row("peak GPU memory (GiB)", "gpu_peak_gib", 1),
        f"| peak resident memory on the host, each rank (MiB, VmHWM) | {rss(kit['rank_peak_mib'])} | "
        f"{rss(twin['rank_peak_mib'])} | |",
        row("time to first step (s)", "first_step_s", 1),
        row("wall clock, start to exit (s)", "wall_s", 1),
        row("last logged loss", "last_logged_loss", 4), "",
        f"The kit's own summary: steady tokens/s {_num(ks['steady_tokens_per_second'], 0)}, MFU "
        f"{_num(ks['steady_mfu'], 3)}, FLOPs per step {_num(f['flops_per_step'], 1, 1e-9)} G. The same losses at "
        f"the logged steps (within 2 %): {same}."]


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 / 2 else f"{n / 1e6:.1f}M"


def _num(v, digits: int, scale: float = 1.0) -> str:
    return "-" if v is None else f"{v * scale:,.{digits}f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(REPO / "bench" / "gpu"))
    p.add_argument("--timeout", type=float, default=180, help="seconds this part may take")
    p.add_argument("--size", choices=sorted(SIZES), default="full")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--peak-tflops", type=float, default=float(os.environ.get("BENCH_GPU_PEAK_TFLOPS") or 0),
                   help="the device's peak (default: BENCH_GPU_PEAK_TFLOPS, else the GPU table); given, the kit "
                        "divides by it too (train.peak_tflops)")
    args = p.parse_args(argv)
    out = Path(args.out)
    if page_missing(out, "gpu_lm.py"):
        return 2
    try:
        part = run_both(args.size, args.device, args.timeout, args.peak_tflops)
    except CheckFailed as exc:
        print(f"bench/gpu.sh: the language model: {exc}", file=sys.stderr)
        return 1
    from bench.gpu_page import append
    from bench.run import results_json_path

    results_json_path(out).with_name("gpu-lm.json").write_text(json.dumps(part, indent=1, default=str) + "\n")
    append(out, section(part))
    print("[gpu-lm] " + json.dumps({k: part[k] for k in ("kit", "twin", "tokens_ratio")}, default=str)[:600],
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
