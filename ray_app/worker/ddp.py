"""The DDP pieces the loop is made of, each one collective or one rule (practices 1-5 of ``ray_app.worker.loop``).

Seeding, the resumable train sampler (DistributedSampler's order, from any point of an epoch, at any world
size), the check that every rank holds the same parameters, the sample-weighted global mean, exact
padding-masked eval sums and the gather of eval rows, the LR schedule's shape, moving a batch to the
device. Each function that runs a collective says so (``sync point``): every rank must call it.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, Sampler

from ray_app.worker.collectives import entered


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start part-way into an epoch, at the world size it stopped at or another.

    An epoch's order is DistributedSampler's: one permutation of the dataset (seeded by ``seed + epoch``,
    the same at every world size) padded to a multiple of the world size W, rank r reading every W-th
    sample from r. After b batches of B on every rank, all ranks together have read exactly its first
    b * B * W samples, so ``set_start(samples_done)`` resumes any world size W' on the rest: it is padded
    to a multiple of W' (from its own beginning, as DistributedSampler pads) and dealt out the same way.
    At an unchanged world size that is DistributedSampler's own order from batch b on, sample for sample.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start = 0  # samples of this epoch's order already read, by all ranks together
        self.epoch_world = self.num_replicas  # the world size the epoch started at (the order may depend on it)

    def set_start(self, samples_done: int, epoch_world: int | None = None) -> None:
        """Resume the epoch after ``samples_done`` samples of its order; ``epoch_world``: the world size the
        epoch started at (this sampler's order does not depend on it; the streamed shards' does)."""
        self.start = samples_done
        self.epoch_world = epoch_world or self.num_replicas

    def _epoch_size(self) -> int:
        """The length of the epoch's whole order (padded)."""
        return self.total_size

    def _epoch_order(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=g).tolist()
        else:
            order = list(range(len(self.dataset)))
        return _pad_or_trim(order, self.total_size)  # = DistributedSampler's

    def _rest(self) -> list[int]:
        rest = self._epoch_order()[self.start:]
        return rest[:len(rest) - len(rest) % self.num_replicas] if self.drop_last else \
            _pad_or_trim(rest, math.ceil(len(rest) / self.num_replicas) * self.num_replicas)

    def __iter__(self):
        return iter(self._rest()[self.rank::self.num_replicas])

    def __len__(self):
        rest = max(self._epoch_size() - self.start, 0)
        return rest // self.num_replicas if self.drop_last else math.ceil(rest / self.num_replicas)


class StreamedShardSampler(ResumableDistributedSampler):
    """The train order of streamed shards (``data.name: shards``): the data set's ``epoch_order(seed, epoch,
    W0)``, W0 the world size the epoch started at, so that rank r of W0 reads block r, a contiguous run of
    shards (``ray_app.shared.shards.ShardDataset``). Everything else is ResumableDistributedSampler's: after b batches
    all ranks together have read the order's first b * B * W samples, and ``set_start(samples_done, W0)``
    deals the rest out over any world size (padded to a multiple of it from the rest's own beginning); a rank
    then reads from several of the W0 blocks, for the rest of that epoch only. The sampler tells the data set
    what this rank reads (``plan``), so its shards are fetched ahead in that order."""

    def __init__(self, dataset, num_replicas: int, rank: int, seed: int = 0):
        super().__init__(dataset, num_replicas, rank, shuffle=True, seed=seed, drop_last=False)

    def _epoch_size(self) -> int:
        return math.ceil(len(self.dataset) / self.epoch_world) * self.epoch_world

    def _epoch_order(self) -> list[int]:
        return self.dataset.epoch_order(self.seed, self.epoch, self.epoch_world)

    def __iter__(self):
        mine = self._rest()[self.rank::self.num_replicas]
        _plan(self.dataset, mine)
        return iter(mine)


class EvalSampler(DistributedSampler):
    """DistributedSampler's eval order (no shuffle, the last round padded with the first samples), yielded
    one index at a time: position p of the padded order is sample p % n, dealt to rank p % W. Its
    ``__iter__`` builds no list of all n indices at every evaluation pass (O(1) memory, not O(n))."""

    def __init__(self, dataset, num_replicas: int, rank: int):
        super().__init__(dataset, num_replicas, rank, shuffle=False, drop_last=False)

    def __iter__(self):
        return map(len(self.dataset).__rmod__, range(self.rank, self.total_size, self.num_replicas))


class BlockEvalSampler(Sampler):
    """Eval over streamed shards, in index order: rank r of W reads the r-th of W contiguous blocks of
    ceil(n / W) indices (so each eval shard is fetched by one rank, or two where a block boundary cuts it),
    the last blocks padded to that length with their own last index; ``keep`` is False at the padding, which
    the Evaluator masks out (practice 5)."""

    def __init__(self, dataset, num_replicas: int, rank: int):
        n = len(dataset)
        size = math.ceil(n / num_replicas)
        lo, hi = min(rank * size, n), min((rank + 1) * size, n)
        real = list(range(lo, hi))
        self.dataset = dataset
        self.indices = real + [real[-1] if real else n - 1] * (size - len(real))
        self.keep = torch.arange(size) < len(real)

    def __iter__(self):
        _plan(self.dataset, self.indices)
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def _plan(dataset, indices: list[int]) -> None:
    """Tell a streamed data set what this rank reads next, in order (it fetches ahead), if it asks."""
    plan = getattr(dataset, "plan", None)
    if callable(plan):
        plan(indices)


def data_samplers(train_set, eval_set, world: int, rank: int, seed: int):
    """(train sampler, eval sampler, eval keep mask, streamed): streamed shards (a data set with
    ``epoch_order``, ``ray_app.shared.shards.ShardDataset``) read blocks of shards; any other map-style data set is
    DistributedSampler's, resumable. ``keep`` is False at the eval sampler's padded duplicates (practice 5)."""
    if callable(getattr(train_set, "epoch_order", None)):
        eval_sampler = BlockEvalSampler(eval_set, world, rank)
        return StreamedShardSampler(train_set, world, rank, seed=seed), eval_sampler, eval_sampler.keep, True
    train = ResumableDistributedSampler(train_set, world, rank, shuffle=True, seed=seed, drop_last=False)
    eval_sampler = EvalSampler(eval_set, world, rank)
    # DistributedSampler deals position p of the padded order to rank p % world; positions past the
    # data set's end are the padding (repeats of its first samples)
    keep = torch.arange(eval_sampler.num_samples) * world + rank < len(eval_set)
    return train, eval_sampler, keep, False


def _pad_or_trim(indices: list[int], size: int) -> list[int]:
    """``indices`` cut to ``size``, or padded to it by repeating them from the start."""
    if size <= len(indices) or not indices:
        return indices[:size]
    return (indices * math.ceil(size / len(indices)))[:size]


def param_fingerprint(model: torch.nn.Module) -> torch.Tensor:
    """Per-tensor (sum, sum of squares) in float64: equal on all ranks iff (practically) identical."""
    with torch.no_grad():
        rows = [torch.stack([p.double().sum(), p.double().pow(2).sum()]) for p in model.parameters()]
    return torch.stack(rows).flatten()


def assert_identical_parameters(model: torch.nn.Module) -> None:
    """Practice 1: after DDP's broadcast every rank must hold rank 0's parameters."""
    fp = param_fingerprint(model)
    lo, hi = fp.clone(), fp.clone()
    with entered("parameter check (all_reduce)"):
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)  # sync point: all ranks
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    if not torch.equal(lo, hi):
        raise RuntimeError("ranks hold different parameters after DDP wrapping")


def global_sum_and_count(loss_sum: torch.Tensor, count: torch.Tensor) -> tuple[float, float]:
    """Practice 4: (sum, n) over all ranks (one all_reduce of [sum, n])."""
    total, n = global_sums(loss_sum, count)
    return total, n


def global_sums(first: torch.Tensor, *more) -> list[float]:
    """Each value summed over all ranks (one all_reduce of them all, in float64); ``first`` a tensor on the
    device, the others tensors or numbers."""
    t = torch.stack([torch.as_tensor(first).double(),
                     *(torch.as_tensor(v, device=first.device).double() for v in more)])
    with entered("global loss (all_reduce)"):
        dist.all_reduce(t)  # sync point: all ranks
    return t.tolist()


def global_mean(loss_sum: torch.Tensor, count: torch.Tensor) -> float:
    """Practice 4: sample-weighted mean over all ranks (one all_reduce of [sum, n])."""
    total, n = global_sum_and_count(loss_sum, count)
    return total / max(n, 1.0)


def gather_eval_rows(indices: torch.Tensor, values: torch.Tensor, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Practice 5: all_gather (index, value columns...) from every rank, keep each index once.

    DistributedSampler pads the last round with repeated indices so every rank
    gets the same count; keeping each dataset index once makes every metric
    equal a single-process evaluation exactly. Returns (indices, rows) in gather order.
    """
    local = torch.cat([indices.double().unsqueeze(1), values.double()], dim=1)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    with entered("eval rows (all_gather)"):
        dist.all_gather(gathered, local)  # sync point: all ranks
    rows = torch.cat(gathered).cpu()
    _, first = np.unique(rows[:, 0].numpy(), return_index=True)
    unique = rows[torch.from_numpy(np.sort(first))]
    return unique[:, 0].long(), unique[:, 1:]


# Exact sums of float64 values, whatever their order (and so the world size): every finite float64 is
# M * 2^(e - 53) with an integer |M| < 2^53 and e - 53 >= -1126, an integer multiple of 2^-1126; its
# 16-bit pieces are counted in int64 limbs (each add < 2^32: exact for up to 2^31 samples).
_EXACT_SHIFT, _LIMB_BITS = 1126, 16
_LIMBS = (1024 - 53 + _EXACT_SHIFT + 53) // _LIMB_BITS + 2


class ExactSums:
    """Per-metric sums and the sample count of this rank's eval values, padding masked out, exact; one
    ``all_reduce`` makes them every rank's (O(metrics) numbers, not O(samples)). ``means()`` rounds once:
    it equals ``math.fsum(values) / n`` over the distinct samples of a single process, bit for bit."""

    CHUNK_ROWS = 1 << 16  # batches are summed in chunks of this many rows: fewer, larger tensor ops

    def __init__(self, num_metrics: int, device: torch.device):
        self.limbs = torch.zeros(num_metrics, _LIMBS, dtype=torch.int64, device=device)
        self.special = torch.zeros(num_metrics, 3, dtype=torch.int64, device=device)  # nan, +inf, -inf
        self.count = torch.zeros(1, dtype=torch.int64, device=device)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pending_rows = 0

    def add(self, values: torch.Tensor, keep: torch.Tensor) -> None:
        """``values`` [B, K] float64; ``keep`` [B] bool (False: a padded duplicate)."""
        self._pending.append((values, keep.to(values.device)))
        self._pending_rows += values.shape[0]
        if self._pending_rows >= self.CHUNK_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            values, keep = (torch.cat(t) for t in zip(*self._pending))
            self._pending, self._pending_rows = [], 0
            self._add(values, keep)

    def _add(self, values: torch.Tensor, keep: torch.Tensor) -> None:
        k = keep.unsqueeze(1).to(torch.int64)
        finite = torch.isfinite(values)
        self.special += torch.stack([torch.isnan(values), values == math.inf, values == -math.inf], dim=2) \
            .to(torch.int64).mul(k.unsqueeze(2)).sum(dim=0)
        mantissa, exponent = torch.frexp(torch.where(finite, values, torch.zeros_like(values)))
        m = torch.ldexp(mantissa, torch.tensor(53.0, dtype=values.dtype, device=values.device)).to(torch.int64)
        offset = exponent.to(torch.int64) - 53 + _EXACT_SHIFT
        limb, shift = offset // _LIMB_BITS, offset % _LIMB_BITS
        sign, magnitude = torch.sign(m) * k, m.abs()
        for j in range(4):  # 4 x 16 bits >= 53
            piece = torch.bitwise_left_shift(torch.bitwise_right_shift(magnitude, _LIMB_BITS * j) & 0xFFFF, shift)
            self.limbs.scatter_add_(1, (limb + j).T, (piece * sign).T)
        self.count += keep.sum()

    def all_reduce(self) -> None:
        self._flush()
        t = torch.cat([self.limbs.flatten(), self.special.flatten(), self.count])
        with entered("eval sums (all_reduce)"):
            dist.all_reduce(t)  # sync point: all ranks (sums and counts only, padding already masked)
        n_limbs, n_special = self.limbs.numel(), self.special.numel()
        self.limbs = t[:n_limbs].view_as(self.limbs)
        self.special = t[n_limbs:n_limbs + n_special].view_as(self.special)
        self.count = t[-1:]

    def num_samples(self) -> int:
        return int(self.count.item())

    def means(self) -> list[float]:
        limbs, special, n = self.limbs.cpu().tolist(), self.special.cpu().tolist(), self.num_samples()
        out = []
        for row, (nan, pos, neg) in zip(limbs, special):
            if nan or (pos and neg):
                total = math.nan
            elif pos or neg:
                total = math.inf if pos else -math.inf
            else:
                exact = sum(v << (_LIMB_BITS * i) for i, v in enumerate(row))
                try:
                    total = exact / (1 << _EXACT_SHIFT)  # int / int: correctly rounded
                except OverflowError:
                    total = math.copysign(math.inf, exact)
            out.append(total / n if n else math.nan)
        return out


def lr_lambda(warmup_steps: int, total_steps: int):
    """Linear warmup, then cosine decay to zero."""
    def f(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return f


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor of a batch (tensor, tuple, list, namedtuple, dict, nested) to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, dict):
        return type(batch)((k, to_device(v, device)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def first_dim(batch: Any) -> int:
    """The batch size: the length of the first tensor found in the batch."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()
    for item in items:
        n = first_dim(item)
        if n:
            return n
    return 0
