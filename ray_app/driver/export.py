"""``ray-app checkpoints export RUN_OR_CHECKPOINT --out PATH [--format pt|hf]``: a checkpoint's model, offline.

``pt`` (default): the model's ``state_dict`` in one file (``torch.load(..., weights_only=True)`` reads it).

``hf``: a folder that transformers' ``AutoModelForCausalLM.from_pretrained(PATH)`` and serving stacks read:
``config.json`` (and ``generation_config.json``) from the run's ``model.args.path``, the weights as safetensors
files of at most ``--max-shard-gb`` (5 by default) each, with ``model.safetensors.index.json`` when there are
several, and the tokenizer's files when the run read ``data.name: text`` (or shards written from it). A checkpoint every rank wrote (of any
world size, either strategy) is consolidated one output file at a time: this process holds the tensors of
the file being written, never the whole model. The folder is written beside PATH and renamed into place last.
A ``model.lora`` run's checkpoint holds its adapters only: ``hf`` writes the base from ``model.args.path`` with
the adapters merged (peft's ``merge_and_unload``; this process holds the whole model).

``peft``: a ``model.lora`` run's adapter folder (``adapter_config.json``, ``adapter_model.safetensors``), as
``PeftModel.save_pretrained`` writes it; ``PeftModel.from_pretrained(base, PATH)`` loads it.
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


def _hf_run(uri: str, retry_s: float, fmt: str):
    """The checkpoint ``uri`` chooses, its run's config, and a reader of its model tensors:
    (found, run, shapes, read)."""
    from ray_app.shared import catalog
    from ray_app.worker import checkpoint as ck
    from ray_app.worker.checkpoint import SHARDED_FORMAT
    from ray_app.worker.sharded import ShardedRef

    found = catalog.choose(uri, keep=ck.needed(None, model_only=True), retry_s=retry_s, then=catalog.AT_START,
                           say=say)
    run = found.json("config.json")
    model = run.get("model", {})
    if model.get("name") != "hf":
        raise UserError(f"--format {fmt}: {found.uri} is a checkpoint of model.name {model.get('name')!r}; --format "
                        f"{fmt} writes a model.name hf run's model (its config.json comes from model.args.path); use "
                        "--format pt for this one")
    if fmt == "peft" and not model.get("lora"):
        raise UserError(f"--format peft: {found.uri} is a checkpoint of a run without model.lora; it holds no "
                        "adapters: use --format hf for its model")
    if found.manifest["format"] == SHARDED_FORMAT:
        ref = ShardedRef(found.storage, found.rel, found.manifest["files"], found.verification.contents)
        shapes = ref.model_tensors()
        return found, run, shapes, lambda names: ref.consolidate_some(names, shapes)
    whole = ck.load(found, None, model_only=True).model  # the earlier single-file format: the state is one file already
    return found, run, {k: (tuple(v.shape), v.dtype) for k, v in whole.items()}, lambda names: {k: whole[k] for k in names}


def _adapted(run: dict, adapters: dict, retry_s: float):
    """The run's model in this process: the base read from ``model.args.path``, the checkpoint's adapters in."""
    import torch

    from ray_app.shared.hf import pretrained
    from ray_app.worker.lora import apply_lora
    from ray_app.worker.pretrained import load_pretrained

    args = run["model"].get("args", {})
    model = pretrained(args["path"], args.get("dtype", "float32"), args.get("trust_remote_code", False), retry_s)
    model = apply_lora(model, run["model"]["lora"])
    load_pretrained(model, torch.device("cpu"))
    missing = set(adapters) - set(model.state_dict())
    if missing:
        raise UserError(f"the checkpoint holds {len(missing)} tensors this run's model.lora does not make "
                        f"(e.g. {sorted(missing)[0]}); it is not this config's")
    model.load_state_dict(adapters, strict=False)
    return model


def export_peft(uri: str, out: Path, retry_s: float) -> dict:
    found, run, shapes, read = _hf_run(uri, retry_s, "peft")
    model = _adapted(run, read(list(shapes)), retry_s)
    model.peft_config["default"].base_model_name_or_path = run["model"]["args"]["path"]
    tmp = _fresh(out)
    model.save_pretrained(str(tmp))
    _into_place(tmp, out)
    return {"checkpoint": found.uri, "out": str(out), "format": "peft", "tensors": len(shapes),
            "global_step": found.manifest.get("global_step")}


def export_hf(uri: str, out: Path, retry_s: float, max_shard_gb: float = SAFE_MAX_GB) -> dict:
    import torch
    from safetensors.torch import save_file

    from ray_app.shared.hf import _storage

    found, run, shapes, read = _hf_run(uri, retry_s, "hf")
    model, data = run["model"], run.get("data", {})
    source = _storage(model["args"]["path"], retry_s)
    hf_config = json.loads(source.read_bytes("config.json"))
    if model.get("lora"):  # the adapters merged into the base
        merged = _adapted(run, read(list(shapes)), retry_s).merge_and_unload().state_dict()
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in merged.items()}
        read = lambda names: {k: merged[k] for k in names}  # noqa: E731
    if hf_config.get("tie_word_embeddings") and "lm_head.weight" in shapes:
        shapes.pop("lm_head.weight")  # as save_pretrained writes a tied model: the embedding once
    sizes = {k: int(torch.Size(s).numel()) * torch.empty((), dtype=d).element_size() for k, (s, d) in shapes.items()}
    groups = plan_files(sizes, int(max_shard_gb * 1e9))
    tmp = _fresh(out)
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
    tokenizer = _tokenizer_of(data, retry_s)
    if tokenizer:
        copied += _copy_small(_storage(tokenizer, retry_s), tmp, TOKENIZER_FILES)
    _into_place(tmp, out)
    return {"checkpoint": found.uri, "out": str(out), "format": "hf", "tensors": len(weight_map),
            "files": len(groups), "bytes": sum(sizes.values()), "copied": copied,
            "global_step": found.manifest.get("global_step")}


def _tokenizer_of(data: dict, retry_s: float) -> str | None:
    """Where the run's tokenizer is: ``data.args.tokenizer`` of a run that read ``data.name: text``, or of the
    text a ``data.name: shards`` run's shard set was written from (its manifest's source)."""
    if data.get("name") == "shards" and data.get("path"):
        from ray_app.shared.hf import _storage
        from ray_app.shared.shards import read_manifest

        source = read_manifest(_storage(data["path"], retry_s)).source
        data = {"name": source.get("data.name"), "args": source.get("data.args") or {}}
    if data.get("name") == "text":
        return (data.get("args") or {}).get("tokenizer") or None
    return None


def _fresh(out: Path) -> Path:
    """An empty folder beside ``out`` to write into."""
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _into_place(tmp: Path, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    os.replace(tmp, out)


def _copy_small(storage, folder: Path, names) -> list[str]:
    present = storage.list_files("")
    copied = []
    for name in names:
        if name in present:
            (folder / name).write_bytes(storage.read_bytes(name))
            copied.append(name)
    return copied
