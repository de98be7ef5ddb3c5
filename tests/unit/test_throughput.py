"""The figures a large-model team reads, from real runs of the loop on two gloo ranks (no Ray): a token
task's tokens/s counted from its tokens and samples/s from its samples, in the progress lines and the summary;
FLOPs per step counted by FlopCounterMode on the rank's real module and batch, equal to a hand count under DDP
and FSDP alike; MFU with ``train.peak_tflops`` on a CPU and absent without it; each attempt's seconds from its
worker group's start to its first step, journaled and shown by ``ray-app runs show``."""

from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch

from ray_app.shared import journal
from ray_app.shared.config import load_config
from ray_app.shared.storage import LocalStorage
from ray_app.shared.tasks import CausalLM
from ray_app.worker.checkpoint import Checkpointer
from ray_app.worker.flops import StepFlops
from ray_app.worker.loop import Trainer
from ray_app.worker.parts import build_parts
from tests.unit.test_loop_ddp import NO_CKPT, FakeRuntime, RecordingMetrics, _finish, _init, _spawn

pytestmark = pytest.mark.timeout(180)

V, D, T, N, B = 13, 6, 9, 64, 4  # vocabulary, width, sequence length, train samples, batch per rank
STEPS = 2 * N // (2 * B)  # 2 epochs at 2 ranks: 8 steps each, no padding


class TinyLM(torch.nn.Module):
    """An embedding and a Linear head: the head's matmul is the only FLOPs (2*B*T*D*V forward, 3x with backward:
    its input, the embedding's output, needs a gradient too)."""

    def __init__(self, vocab: int = V, width: int = D):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.out = torch.nn.Linear(width, vocab)

    def forward(self, input_ids, attention_mask=None):
        return self.out(self.emb(input_ids))


def _sample(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(0, V, (T,), generator=g)
    labels = ids.clone()
    labels[: i % 4] = -100  # a prompt of 0-3 tokens
    mask = torch.ones(T, dtype=torch.long)
    if i % 3:
        mask[T - i % 3:] = 0  # 1-2 padding tokens at the end
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def token_data():
    """The data plug-in (tests.unit.test_throughput:token_data): samples whose numbers of target tokens differ."""
    return [_sample(i) for i in range(N)], [_sample(1000 + i) for i in range(6)]


def target_tokens(samples) -> int:
    return sum(int(CausalLM().split({k: v[None] for k, v in s.items()})[1][:, 1:].ne(-100).sum()) for s in samples)


CAUSAL = ["data.name=tests.unit.test_throughput:token_data", "model.name=tests.unit.test_throughput:TinyLM",
          "task.name=causal_lm", f"data.batch_size={B}", "train.epochs=2", "train.log_every_steps=2",
          "train.optimizer=adamw", "train.lr=0.01", "metrics.enabled=false", *NO_CKPT]
PEAK = ["train.peak_tflops=0.001"]  # 1 GFLOP/s: a CPU's MFU is then a ratio worth printing
RUNS = {"ddp": PEAK, "no-peak": [], "fsdp": PEAK + ["train.strategy=fsdp"]}


class StorageRuntime(FakeRuntime):
    """The fake runtime with the storage the worker's entry reads (its journal, its checkpointer)."""

    def __init__(self, rank: int, world_size: int, storage):
        super().__init__(rank, world_size)
        self.storage = storage


def _fit(rank: int, world: int, cfg) -> dict:
    rt = FakeRuntime(rank, world)
    metrics = RecordingMetrics()
    ckpt = Checkpointer(LocalStorage(cfg.run.storage), cfg.run.name, rt.report, every_epochs=0, every_steps=0)
    trainer = Trainer(cfg, rt, build_parts(cfg, rt), ckpt, metrics)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        summary = trainer.fit()
    return {"summary": summary, "progress": metrics.progress,
            "lines": [line for line in said.getvalue().splitlines() if line.startswith("epoch ") and " step " in line]}


def _worker(rank: int, world: int, port: int, out: str, storage: str) -> None:
    from ray_app.worker import entry
    from ray_app.worker.progress import RunStats

    _init(rank, world, port)
    results = {}
    for name, more in RUNS.items():
        results[name] = _fit(rank, world, load_config(None, CAUSAL + more + [f"run.name={name}", f"run.storage={storage}"]))
    # the worker's own entry for one attempt: rank 0 journals its first step's seconds from the worker's start
    cfg = load_config(None, CAUSAL + ["train.epochs=1", "run.name=journaled", f"run.storage={storage}"])
    with contextlib.redirect_stdout(io.StringIO()):
        results["journaled"] = entry._train(cfg, StorageRuntime(rank, world, LocalStorage(storage)), RunStats(),
                                            {"launch_id": "L1"})[0]
    journal.flush(10.0)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    _finish()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, port_picker):
    out = tmp_path_factory.mktemp("throughput")
    storage = str(out / "runs")
    _spawn(_worker, 2, port_picker(), str(out), storage)
    return torch.load(out / "rank0.pt", weights_only=True), storage


def test_a_causal_lm_runs_tokens_per_second_counts_its_target_tokens_and_samples_per_second_its_samples(runs):
    r = runs[0]["ddp"]
    tokens = 2 * target_tokens(token_data()[0])  # two epochs of every sample, once each
    progress = r["progress"]
    assert sum(p["tokens"] for p in progress) == tokens != 2 * N * (T - 1)  # not one per position
    assert sum(p["samples"] for p in progress) == 2 * N
    assert [p["global_step"] for p in progress] == list(range(2, STEPS + 1, 2))
    for p in progress:  # both rates over the same seconds: their ratio is the counts'
        assert p["samples"] == 2 * B * 2  # 2 ranks x batch 4 x 2 steps
        assert p["tokens_per_second"] / p["samples_per_second"] == pytest.approx(p["tokens"] / p["samples"], rel=1e-9)
    assert len(r["lines"]) == len(progress)
    for line, p in zip(r["lines"], progress):
        assert f" {p['samples_per_second']:,.0f} samples/s {p['tokens_per_second']:,.0f} tokens/s MFU " in line, line
    s = r["summary"]
    assert s["train_tokens"] == tokens
    steady = [p for p in progress if p["global_step"] - 2 >= 5]  # the intervals after the 5 warm-up steps
    seconds = sum(p["tokens"] / p["tokens_per_second"] for p in steady)
    assert s["steady_tokens_per_second"] == pytest.approx(sum(p["tokens"] for p in steady) / seconds, rel=1e-9)


def test_flops_per_step_equal_the_hand_count_under_ddp_and_fsdp_and_mfu_needs_a_peak_on_a_cpu(runs):
    results = runs[0]
    hand = 3 * 2 * B * T * D * V  # the head's matmul: forward, and backward's two (input and weight gradients)
    for name in ("ddp", "fsdp"):  # FSDP's gathered parameters: the whole model's FLOPs, nothing halved or doubled
        s = results[name]["summary"]
        assert s["flops_per_step"] == hand, name
        steady = [p for p in results[name]["progress"] if p["global_step"] - 2 >= 5]
        steps = 2 * len(steady)
        seconds = sum(p["samples"] / p["samples_per_second"] for p in steady)
        assert s["steady_mfu"] == pytest.approx(hand * steps / seconds / 1e9, rel=1e-9), name
        assert all(p["mfu"] is not None for p in results[name]["progress"])  # counted in step 2, the first logged
    plain = results["no-peak"]
    assert "steady_mfu" not in plain["summary"] and "flops_per_step" not in plain["summary"]
    assert all(p["mfu"] is None for p in plain["progress"]) and not any("MFU" in line for line in plain["lines"])
    assert plain["summary"]["train_tokens"] == results["ddp"]["summary"]["train_tokens"]


def test_step_flops_count_one_micro_batch_of_the_attempts_second_step_times_the_micro_batches():
    model, batch = TinyLM(), {"input_ids": torch.randint(0, V, (B, T))}
    flops = StepFlops(torch.device("cpu"), peak_tflops=1.0)
    for step, micro in ((11, 0), (11, 1), (12, 1)):  # resumed after step 10: its first step is 11, and 12 is counted
        with flops.counting(step, micro, 3):
            CausalLM().loss(model, batch)[0].backward()
    assert flops.per_step is None
    with flops.counting(12, 0, 3):
        CausalLM().loss(model, batch)[0].backward()
    assert flops.per_step == 3 * (3 * 2 * B * T * D * V)
    assert flops.mfu(steps=4, seconds=2.0) == pytest.approx(flops.per_step * 4 / 2.0 / 1e12)
    assert StepFlops(torch.device("cpu")).peak is None  # a CPU has no peak of its own: nothing counted, no MFU


def test_a_compiled_model_is_counted_eagerly_and_runs_compiled_again_after_the_counted_step():
    """train.compile's fullgraph compile refuses to be skipped under FlopCounterMode's dispatch mode: the counted
    step runs it eagerly (the hand count), the steps around it run compiled."""
    model, batch = TinyLM(), {"input_ids": torch.randint(0, V, (B, T))}
    compiled, calls = [], []

    def backend(gm, example_inputs):
        compiled.append(gm)
        return lambda *args: (calls.append(1), gm.forward(*args))[1]

    model.forward = torch.compile(model.forward, fullgraph=True, backend=backend)
    flops = StepFlops(torch.device("cpu"), peak_tflops=1.0)
    for step in (1, 2, 3):  # the attempt's first step compiles, its second is counted
        with flops.counting(step, 0, 1):
            CausalLM().loss(model, batch)[0].backward()
    assert flops.per_step == 3 * 2 * B * T * D * V
    assert len(compiled) == 1 and len(calls) == 2  # compiled at the first step, run at the first and the third


def test_the_first_attempts_seconds_to_its_first_step_are_journaled_and_runs_show_lists_them(runs, capsys):
    from ray_app.driver import runs as runs_cmd

    summary, storage = runs[0]["journaled"], runs[1]
    (first,) = [e for e in journal.read_events(LocalStorage(storage), "journaled") if e["kind"] == "first_step"]
    took = first["seconds_to_first_step"]
    assert 0 < took == pytest.approx(summary["first_step_unix"] - summary["worker_start_unix"], abs=0.5)
    shown = runs_cmd.show_run(f"{storage}/journaled", retry_s=5)
    (attempt,) = shown["attempts"]
    assert attempt["seconds_to_first_step"] == took and attempt["after"] == "first"
    lines = runs_cmd.show_lines(shown)
    assert any(line.endswith(f"first step: step 1, {took:.1f} s after the worker group's start") for line in lines)
    assert f"  1. attempt {attempt['attempt']}, first of its launch, from step 0: {took:.1f} s" in lines
