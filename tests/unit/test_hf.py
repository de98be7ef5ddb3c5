"""``model.name: hf``: a Hugging Face model made from its config on the meta device, each rank reading only
the rows of the weights it holds after sharding; the bad inputs of its folder as one line before Ray."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ray_app.shared.errors import ConfigError
from ray_app.shared.hf import INDEX, check_pretrained
from tests.support.hf import tiny_llama
from tests.support.ports import free_port
from tests.support.ranks import rank_context

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(180)
IDS = torch.arange(24).view(2, 12) % 97


@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("llama"), vocab_size=97, shard="40KB", layers=3)


def _rank(rank: int, world: int, port: int, folder: str, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    from ray_app.shared.hf import pretrained
    from ray_app.worker.pretrained import load_pretrained
    from ray_app.worker.strategy import fully_shard_model

    model = pretrained(folder)
    on_meta = all(p.device.type == "meta" for p in model.parameters())
    model = fully_shard_model(model, torch.device("cpu"), world)
    read = load_pretrained(model, torch.device("cpu"))
    with torch.no_grad():
        logits = model(IDS).logits
    whole = {k: v.full_tensor().numpy() for k, v in model.state_dict().items()}  # a collective: every rank
    whole = whole if rank == 0 else None
    out.put((rank, on_meta, read, model.lm_head.weight is model.model.embed_tokens.weight, logits.numpy(), whole))
    out.close()
    out.join_thread()  # before os._exit: what was put must reach the parent
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def test_fsdp_ranks_read_only_their_rows_and_give_from_pretrained_s_model(sharded_llama):
    reference = transformers.AutoModelForCausalLM.from_pretrained(sharded_llama)
    with torch.no_grad():
        want = reference(IDS).logits
    total = sum(p.numel() * p.element_size() for p in reference.parameters())  # the tied weight once
    ctx = rank_context()
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, str(sharded_llama), out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted((out.get(timeout=150) for _ in procs), key=lambda r: r[0])
    for p in procs:
        p.join(30)
    for rank, on_meta, read, tied, logits, _ in results:
        assert on_meta, "the model was made without memory for its parameters"
        assert read <= 0.55 * total, (rank, read, total)  # about half each, never the whole model
        assert tied, "the tied output weight is still the embedding"
        assert torch.equal(torch.from_numpy(logits), want), rank
    assert sum(r[2] for r in results) >= total * 0.99  # together they read every tensor
    whole = results[0][5]
    for name, value in reference.state_dict().items():
        assert torch.equal(torch.from_numpy(whole[name]), value), name


def test_ddp_s_whole_model_equals_from_pretrained_s_and_keeps_its_buffers(tmp_path):
    from ray_app.shared.hf import pretrained
    from ray_app.worker.pretrained import load_pretrained

    folder = tiny_llama(tmp_path / "one", vocab_size=97, tied=False, layers=3)  # one model.safetensors, untied
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model = pretrained(str(folder), dtype="bfloat16")
    load_pretrained(model, torch.device("cpu"))
    for name, value in reference.state_dict().items():
        got = model.state_dict()[name]
        assert got.dtype == torch.bfloat16 and torch.equal(got, value.to(torch.bfloat16)), name
    for (name, b), (_, ref) in zip(model.named_buffers(), reference.named_buffers()):
        assert torch.equal(b.float(), ref.float()), name  # the rotary table, computed as transformers does


def test_each_bad_folder_is_one_line_naming_the_key(tmp_path, sharded_llama):
    with pytest.raises(ConfigError, match=r"model.args.path: .* has no config.json; point it at a folder"):
        check_pretrained({"path": str(tmp_path)})
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in sharded_llama.iterdir():
        if not f.name.endswith("00002-of-00004.safetensors"):
            (broken / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ConfigError, match=rf"model.args.path: .*{INDEX} names model-00002-of-00004.safetensors, "
                                          "which is not in"):
        check_pretrained({"path": str(broken)})
    with pytest.raises(ConfigError, match=r"model.args.dtype: 'fp8' is not one of float32, bfloat16, float16"):
        check_pretrained({"path": str(sharded_llama), "dtype": "fp8"})
    remote = tmp_path / "remote"
    remote.mkdir()
    config = json.loads((sharded_llama / "config.json").read_text())
    (remote / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "m.M"}}))
    with pytest.raises(ConfigError, match=r"model.args.trust_remote_code: .* needs the model's own code"):
        check_pretrained({"path": str(remote)})


def test_a_bad_folder_ends_ray_app_train_before_ray_with_exit_2(run_cli, tmp_path):
    rc, out, err = run_cli(["train", "--set", f"run.storage={tmp_path / 'runs'}", "--set", "model.name=hf",
                            "--set", f"model.args.path={tmp_path}"], env={"RAY_ADDRESS": None}, timeout=60)
    assert rc == 2, (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1].startswith("ray-app: error: config key model.args.path:") and "no config.json" in lines[-1]
    assert "Traceback" not in err and "Ray" not in err.replace("ray-app", "")


def _recorded(read_range_into, reads: list):
    """``read_range_into`` that notes where each read lands (address, bytes)."""
    def recorded(rel, start, out):
        reads.append((out.ctypes.data, out.nbytes))
        return read_range_into(rel, start, out)
    return recorded


def test_weights_go_straight_into_the_parameters_in_pieces_from_a_folder_and_from_s3(tmp_path, s3, monkeypatch):
    import ray_app.shared.hf as hf
    from ray_app.worker.pretrained import load_pretrained

    folder = tiny_llama(tmp_path / "one", vocab_size=97, tied=False, layers=2)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder)
    for f in folder.iterdir():
        s3.client().upload_file(str(f), s3.bucket, f"models/one/{f.name}")
    for key, value in s3.env().items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)
    monkeypatch.setattr(hf, "READ_PIECE", 1000)  # several pieces per tensor, cut mid-row
    for path in (str(folder), f"s3://{s3.bucket}/models/one"):
        for dtype in ("float32", "bfloat16"):
            model = hf.pretrained(path, dtype=dtype)
            storage, reads = model.ray_app_weights.storage, []
            monkeypatch.setattr(storage, "read_range_into", _recorded(storage.read_range_into, reads))
            load_pretrained(model, torch.device("cpu"))
            assert reads and max(n for _, n in reads) <= 1000, (path, dtype)
            if dtype == "float32":  # each piece lands in a parameter's own storage, no buffer between
                spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in model.state_dict().values()]
                assert all(any(a <= at and at + n <= b for a, b in spans) for at, n in reads), path
            for name, value in reference.state_dict().items():
                assert torch.equal(model.state_dict()[name], value.to(getattr(torch, dtype))), (path, dtype, name)
    cut = tmp_path / "cut"
    cut.mkdir()
    for f in folder.iterdir():
        (cut / f.name).write_bytes(f.read_bytes()[:-100] if f.name.endswith(".safetensors") else f.read_bytes())
    with pytest.raises(ConfigError, match=r"model.args.path: .*model.safetensors ends inside tensor .* cut short"):
        load_pretrained(hf.pretrained(str(cut)), torch.device("cpu"))
