"""``task.name: causal_lm``: transformers' label convention, prompt and padding tokens not counted, the logged
loss the token-weighted mean over every rank and micro-batch, eval exact over the distinct samples' tokens."""

from __future__ import annotations

import math
import os
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ray_app.shared.plugins import resolve
from ray_app.shared.tasks import CausalLM
from ray_app.worker.progress import Progress
from tests.support.ports import free_port
from tests.support.ranks import rank_context

pytestmark = pytest.mark.timeout(120)
V = 11


class TinyLM(torch.nn.Module):
    """Logits from each token alone (enough to check which positions count)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(V, 8)
        self.out = torch.nn.Linear(8, V)
        self.masks = []

    def forward(self, input_ids, attention_mask=None):
        self.masks.append(attention_mask)
        return self.out(self.emb(input_ids))


def by_hand(model, ids, labels, mask=None):
    """Every target token's loss as transformers counts it: position t predicts labels[t + 1]."""
    logits = model.out(model.emb(ids))
    targets = labels.clone()
    if mask is not None:
        targets[mask == 0] = -100
    losses, n = [], 0
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1] - 1):
            if targets[b, t + 1] != -100:
                losses.append(F.cross_entropy(logits[b, t][None], targets[b, t + 1][None]))
                n += 1
    return torch.stack(losses).sum(), n


def test_labels_align_with_input_ids_the_task_shifts_and_prompt_and_padding_do_not_count():
    task, model = resolve("task", "causal_lm")(), TinyLM()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt: its tokens are no target
    loss, n = task.loss(model, {"input_ids": ids, "labels": labels, "attention_mask": mask})
    want_sum, want_n = by_hand(model, ids, labels, mask)
    assert int(n) == want_n == 3 + 3  # row 0: targets at 3, 4, 5; row 1: at 1, 2, 3 (4, 5 are padding)
    assert torch.allclose(loss, want_sum / want_n)
    assert model.masks[-1] is mask  # the model that takes a mask is given it
    loss_plain, n_plain = task.loss(model, {"input_ids": ids})  # no labels: input_ids are the labels
    want_sum, want_n = by_hand(model, ids, ids)
    assert int(n_plain) == want_n == 10 and torch.allclose(loss_plain, want_sum / want_n)
    loss.backward()  # a loss the optimizer can use
    assert model.out.weight.grad is not None


def test_a_model_without_an_attention_mask_argument_and_transformers_like_outputs():
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = TinyLM()

        def forward(self, x):  # no attention_mask: not passed one
            return (self.lm(x),)  # a tuple whose first item is the logits

    task, model = CausalLM(), Plain()
    ids = torch.tensor([[1, 2, 3, 0]])
    loss, n = task.loss(model, {"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 1, 0]])})
    want_sum, want_n = by_hand(model.lm, ids, ids, torch.tensor([[1, 1, 1, 0]]))
    assert int(n) == want_n == 2 and torch.allclose(loss, want_sum / want_n)


def test_eval_loss_is_every_target_tokens_loss_over_their_number_and_perplexity_its_exp():
    task, model = CausalLM(), TinyLM()
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0], [7, 8, 9, 0]])
    mask = (ids != 0).long()
    with torch.no_grad():  # as the kit evaluates
        values = task.evaluate(model, {"input_ids": ids, "attention_mask": mask})
    means = {k: float(v.mean()) for k, v in values.items()}
    out = task.summarize(means)
    want_sum, want_n = by_hand(model, ids, ids, mask)
    assert want_n == 3 + 1 + 2
    # float32 token losses summed in another order: equal to float32's precision
    assert out["loss"] == pytest.approx(float(want_sum) / want_n, rel=1e-6)
    per_sample = float((values["token_loss_sum"] / values["target_tokens"]).mean())
    assert abs(per_sample - out["loss"]) > 1e-3  # not the mean of per-sample means
    assert out["perplexity"] == pytest.approx(math.exp(out["loss"]), rel=1e-12)


# ---------------------------------------------------------------- two gloo ranks, different token counts

def _rank(rank: int, world: int, port: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    task, model = CausalLM(), TinyLM()
    progress = Progress(_NoMetrics(), torch.device("cpu"), total_steps=2, say=lambda line: None)
    progress.new_epoch(0)
    for batch in _batches()[rank]:  # two micro-batches a rank, each with its own number of targets
        loss, n = task.loss(model, batch)
        progress.add(loss, n)
    logged = progress.epoch_train_loss(epoch=0, global_step=2, lr=0.1)
    out.put((rank, logged))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


class _NoMetrics:
    def __getattr__(self, name):
        return lambda **kw: None


def _batches():
    torch.manual_seed(1)
    ids = torch.randint(1, V, (4, 2, 7))
    masks = torch.ones_like(ids)
    masks[0, 0, 2:] = 0  # rank 0's first micro-batch is mostly padding
    masks[3, 1, 5:] = 0
    labels = ids.clone()
    labels[1, :, :4] = -100  # rank 0's second: a prompt
    batch = lambda i: {"input_ids": ids[i], "labels": labels[i], "attention_mask": masks[i]}  # noqa: E731
    return {0: [batch(0), batch(1)], 1: [batch(2), batch(3)]}


def test_ranks_with_different_token_counts_log_the_single_process_token_weighted_mean():
    batches = _batches()
    model, total, tokens = TinyLM(), 0.0, 0
    for rank_batches in batches.values():
        for b in rank_batches:
            s, n = by_hand(model, b["input_ids"], b["labels"], b["attention_mask"])
            total, tokens = total + float(s), tokens + n
    counts = [int(CausalLM().loss(model, b)[1]) for b in batches[0] + batches[1]]
    assert len(set(counts)) > 2, counts  # the micro-batches really differ in their number of targets
    ctx = rank_context()
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    logged = dict(out.get(timeout=90) for _ in procs)
    for p in procs:
        p.join(30)
    assert logged[0] == logged[1] == pytest.approx(total / tokens, rel=1e-6)
    mean_of_means = sum(float(CausalLM().loss(model, b)[0]) for b in batches[0] + batches[1]) / 4
    assert abs(mean_of_means - total / tokens) > 1e-4  # a per-batch mean would have logged something else
