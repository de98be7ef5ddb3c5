"""``ray-app checkpoints export RUN_OR_CHECKPOINT --out PATH [--format pt|hf]``: a checkpoint's model, offline.

``pt`` (default): the model's ``state_dict`` in one file (``torch.load(..., weights_only=True)`` reads it).

``hf``: a folder that transformers' ``AutoModelForCausalLM.from_pretrained(PATH)`` and serving stacks read:
``config.json`` (and ``generation_config.json``) from the run's ``model.args.path``, the weights as safetensors
files of at most ``--max-shard-gb`` (5 by default) each, with ``model.safetensors.index.json`` when there are
several, and the tokenizer's files when the run read ``data.name: text``. A checkpoint every rank wrote (of any
world size, either strategy) is consolidated one output file at a time: this process holds the tensors of
the file being written, never the whole model. The folder is written beside PATH and renamed into place last.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from ray_app.shared.errors import UserError

SAFE_MAX_GB = 5.0
HF_CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def export_pt(uri: str, out: Path, retry_s: float) -> dict:
    import torch

    from ray_app.shared import catalog
    from ray_app.worker import checkpoint as ck

    loaded = ck.load_uri(uri, rank=None, model_only=True, retry_s=retry_s, then=catalog.AT_START, say=say)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    torch.save(loaded.model, tmp)
    tmp.replace(out)
    return {"checkpoint": loaded.uri, "out": str(out), "tensors": len(loaded.model), "global_step": loaded.global_step}


def plan_files(tensors: dict, max_bytes: int) -> list[list[str]]:
    """The tensors' names cut into files of at most ``max_bytes`` each (a bigger tensor alone in its file),
    in the order given."""
    files: list[list[str]] = [[]]
    size = 0
    for name, nbytes in tensors.items():
        if files[-1] and size + nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    return files


def export_hf(uri: str, out: Path, retry_s: float, max_shard_gb: float = SAFE_MAX_GB) -> dict:
    import torch
    from safetensors.torch import save_file

    from ray_app.shared import catalog
    from ray_app.shared.hf import _storage
    from ray_app.worker import checkpoint as ck
    from ray_app.worker.checkpoint import SHARDED_FORMAT
    from ray_app.worker.sharded import ShardedRef

    found = catalog.choose(uri, keep=ck.needed(None, model_only=True), retry_s=retry_s, then=catalog.AT_START,
                           say=say)
    run = found.json("config.json")
    model, data = run.get("model", {}), run.get("data", {})
    if model.get("name") != "hf":
        raise UserError(f"--format hf: {found.uri} is a checkpoint of model.name {model.get('name')!r}; --format hf "
                        "writes a model.name hf run's model (its config.json comes from model.args.path); use "
                        "--format pt for this one")
    source = _storage(model["args"]["path"], retry_s)
    hf_config = json.loads(source.read_bytes("config.json"))
    if found.manifest["format"] == SHARDED_FORMAT:
        ref = ShardedRef(found.storage, found.rel, found.manifest["files"], found.verification.contents)
        shapes = ref.model_tensors()
        read = ref.consolidate_some
    else:  # the earlier single-file format: the state is one file already
        whole = ck.load(found, None, model_only=True).model
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in whole.items()}
        read = lambda names: {k: whole[k] for k in names}  # noqa: E731
    if hf_config.get("tie_word_embeddings") and "lm_head.weight" in shapes:
        shapes.pop("lm_head.weight")  # as save_pretrained writes a tied model: the embedding once
    sizes = {k: int(torch.Size(s).numel()) * torch.empty((), dtype=d).element_size() for k, (s, d) in shapes.items()}
    groups = plan_files(sizes, int(max_shard_gb * 1e9))
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map = {}
    for i, names in enumerate(groups, start=1):
        name = "model.safetensors" if len(groups) == 1 else f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: v.contiguous() for k, v in read(names).items()}  # this file's tensors only
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in names})
        del tensors
    if len(groups) > 1:
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))},
            indent=2))
    copied = _copy_small(source, tmp, HF_CONFIG_FILES)
    if data.get("name") == "text" and data.get("args", {}).get("tokenizer"):
        copied += _copy_small(_storage(data["args"]["tokenizer"], retry_s), tmp, TOKENIZER_FILES)
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    os.replace(tmp, out)
    return {"checkpoint": found.uri, "out": str(out), "format": "hf", "tensors": len(weight_map),
            "files": len(groups), "bytes": sum(sizes.values()), "copied": copied,
            "global_step": found.manifest.get("global_step")}


def _copy_small(storage, folder: Path, names) -> list[str]:
    present = storage.list_files("")
    copied = []
    for name in names:
        if name in present:
            (folder / name).write_bytes(storage.read_bytes(name))
            copied.append(name)
    return copied
