"""Streamed shards (``data.name: shards``): the order is a pure function of (seed, epoch, world size, manifest),
every sample is read once per epoch (train, modulo DistributedSampler's padding; eval exactly, the padding out
of the metrics), a run stopped at 2 ranks and resumed at 3 reads the rest of the epoch once, a rank fetches
about 1/W of the bytes, the cache never holds more than prefetch + 1 shards (peak RSS measured), a shard
whose bytes changed is bad input naming it, and the DDP loop (real gloo groups, no Ray) resumes a streamed
run mid-epoch bit-identical and at another world size.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from ray_app.shared import shards
from ray_app.shared.config import load_config
from ray_app.shared.data import digits
from ray_app.shared.errors import ShardError
from ray_app.shared.plugins import build_data
from ray_app.shared.storage import LocalStorage
from ray_app.worker.ddp import BlockEvalSampler, StreamedShardSampler
from ray_app.worker.resume import Position, reshard
from tests.unit.test_loop_ddp import BASE, NO_CKPT, _finish, _fit, _init, _load_ranks, _same_params, _spawn
from tests.unit.test_shards import one_error_line, ray_app  # noqa: F401  (a fixture)

REPO = Path(__file__).resolve().parents[2]
SHARD_MB = 0.05  # digits: 1,438 train samples in 8 shards, 359 eval samples in 2


@pytest.fixture(scope="module")
def digit_shards(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("digits-shards")
    train, ev, info = digits()
    shards.write_shards(LocalStorage(str(dest)), {"train": train, "eval": ev}, info, {"data.name": "digits"},
                        shard_mb=SHARD_MB, say=lambda line: None)
    return dest


def stream(dest: Path, split: str = "train", prefetch: int = shards.DEFAULT_PREFETCH, storage=None):
    storage = storage or LocalStorage(str(dest))
    return shards.ShardDataset(storage, shards.read_manifest(storage), split, prefetch)


def read_all(ds, indices: list[int]) -> list[int]:
    """Read ``indices`` as a rank does (planned, then in order, through the cache); the indices read."""
    ds.plan(indices)
    for i in indices:
        ds[i]
    return list(indices)


def rank_indices(ds, world: int, epoch: int, seed: int = 0, start: int = 0, epoch_world: int | None = None):
    """Each rank's indices for the rest of the epoch after ``start`` samples of the order of ``epoch_world``."""
    out = []
    for rank in range(world):
        sampler = StreamedShardSampler(ds, world, rank, seed=seed)
        sampler.set_epoch(epoch)
        sampler.set_start(start, epoch_world or world)
        out.append(list(iter(sampler)))
    return out


# ---------------------------------------------------------------- the order

@pytest.mark.timeout(60)
def test_the_order_is_a_pure_function_of_seed_epoch_world_size_and_manifest(digit_shards):
    a, b = stream(digit_shards), stream(digit_shards)  # two readers of the same manifest
    assert a.epoch_order(7, 3, 2) == b.epoch_order(7, 3, 2)
    assert a.epoch_order(7, 3, 2) != a.epoch_order(7, 4, 2)  # another epoch, another order
    assert a.epoch_order(7, 3, 2) != a.epoch_order(8, 3, 2)
    assert a.epoch_order(7, 3, 2) != a.epoch_order(7, 3, 3)  # cut into another number of blocks
    order = a.epoch_order(7, 3, 3)
    assert len(order) == math.ceil(len(a) / 3) * 3 and sorted(set(order)) == list(range(len(a)))
    # rank r's stream (every 3rd position from r) is a contiguous run of whole shards, in a seeded order
    ranks = rank_indices(a, 3, epoch=3, seed=7)
    for r, mine in enumerate(ranks):
        runs = [a.shard_of(i) for i in mine]
        changes = [s for k, s in enumerate(runs) if k == 0 or runs[k - 1] != s]
        assert len(changes) == len(set(changes)) or r == 2, (r, changes)  # the last rank adds the padding's shard


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_train_sample_is_read_once_per_epoch_modulo_the_padding(digit_shards, world):
    ds = stream(digit_shards)
    n = len(ds)
    for epoch in (0, 1):
        ranks = rank_indices(ds, world, epoch)
        assert len({len(m) for m in ranks}) == 1  # equal batches on every rank: the collectives line up
        seen = [i for m in ranks for i in read_all(ds, m)]
        padding = math.ceil(n / world) * world - n
        assert sorted(set(seen)) == list(range(n)) and len(seen) == n + padding
        # the padded duplicates are the concatenated sequence's first samples (rank 0's), as DistributedSampler pads
        twice = sorted(i for i in set(seen) if seen.count(i) > 1)
        assert twice == sorted(ranks[0][:padding])
    train, _, _ = digits()
    assert all(torch.equal(ds[i][0], train[i][0]) and ds[i][1] == train[i][1] for i in (0, 700, n - 1))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_eval_reads_every_sample_once_and_masks_the_padding(digit_shards, world):
    ds = stream(digit_shards, "eval")
    kept = []
    for rank in range(world):
        sampler = BlockEvalSampler(ds, world, rank)
        mine = list(iter(sampler))
        assert len(mine) == math.ceil(len(ds) / world)
        kept += [i for i, keep in zip(read_all(ds, mine), sampler.keep.tolist()) if keep]
    assert kept == list(range(len(ds)))  # every eval sample once, in index order, no padding kept


@pytest.mark.timeout(60)
def test_a_stop_at_two_ranks_and_a_resume_at_three_read_the_rest_of_the_epoch_once(digit_shards):
    ds, batch, b = stream(digit_shards), 16, 9
    n = len(ds)
    before = [m[:b * batch] for m in rank_indices(ds, 2, epoch=1)]  # 9 batches on each of 2 ranks
    done = b * batch * 2
    order = ds.epoch_order(0, 1, 2)
    assert sorted(i for m in before for i in m) == sorted(order[:done])  # the order's first b*B*W samples
    after = rank_indices(ds, 3, epoch=1, start=done, epoch_world=2)
    recorded = [i for m in after for i in read_all(ds, m)]  # each new rank reads from both old blocks at once
    assert ds.peak_cached <= ds.capacity
    seen = [i for m in before for i in m] + recorded
    assert sorted(set(seen)) == list(range(n))
    repeats = len(seen) - n
    assert repeats == (math.ceil(n / 2) * 2 - n) + (-(n - done) % 3)  # the padding of W=2, then of the rest at W=3
    # each of the 2 ranks' blocks is read by the 3 new ranks from where it stopped: the rest, in order
    assert order[done:] == [x for k in range(len(after[0])) for x in (m[k] for m in after)][:n - done]
    # the loop's side: the checkpoint's position re-shards the rest (ray_app.worker.resume.reshard)
    cfg = load_config(None, ["data.batch_size=16"])
    sampler = StreamedShardSampler(ds, 3, 0, seed=0)
    sampler.set_epoch(1)
    parts = type("Parts", (), {"train_sampler": sampler, "batches_per_epoch": math.ceil(math.ceil(n / 3) / 16),
                               "steps_per_epoch": 30, "scheduler": type("S", (), {"last_epoch": 0})()})()
    pos = Position(epoch=1, batches_done=b, global_step=45 + b, samples_done=done, epoch_world_size=2)
    reshard(cfg, parts, pos, 2, 3, say=lambda line: None)
    assert list(iter(sampler)) == after[0]
    assert parts.batches_per_epoch - pos.batches_done == math.ceil(len(after[0]) / 16)


@pytest.mark.timeout(60)
def test_a_resume_at_the_same_world_size_reads_what_the_uninterrupted_epoch_would(digit_shards):
    ds = stream(digit_shards)
    whole = rank_indices(ds, 2, epoch=2)
    rest = rank_indices(ds, 2, epoch=2, start=5 * 32 * 2)
    assert all(r == w[5 * 32:] for r, w in zip(rest, whole))


# ---------------------------------------------------------------- bytes and memory

class CountingStorage:
    """The kit's storage, counting the bytes each read brings."""

    def __init__(self, inner):
        self.inner, self.bytes_read = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def read_into(self, rel: str, out) -> None:
        counter = self

        class Tee:
            def seek(self, pos):
                out.seek(pos)

            def truncate(self):
                out.truncate()

            def write(self, data):
                counter.bytes_read += len(data)
                out.write(data)
        self.inner.read_into(rel, Tee())


@pytest.fixture(scope="module")
def fine_shards(tmp_path_factory) -> Path:
    """Digits in 20 small shards (about 73 samples each)."""
    dest = tmp_path_factory.mktemp("fine-shards")
    train, ev, info = digits()
    shards.write_shards(LocalStorage(str(dest)), {"train": train, "eval": ev}, info, {}, shard_mb=0.02,
                        say=lambda line: None)
    return dest


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_rank_reads_about_1_over_w_of_the_bytes(fine_shards, world):
    manifest = shards.read_manifest(LocalStorage(str(fine_shards)))
    total, largest = sum(s.bytes for s in manifest.splits["train"]), max(s.bytes for s in manifest.splits["train"])
    assert len(manifest.splits["train"]) >= 18
    per_rank = []
    for rank in range(world):
        storage = CountingStorage(LocalStorage(str(fine_shards)))
        ds = stream(fine_shards, storage=storage)
        sampler = StreamedShardSampler(ds, world, rank, seed=3)
        sampler.set_epoch(1)
        for _batch in DataLoader(ds, batch_size=16, sampler=sampler):
            pass
        per_rank.append(storage.bytes_read)
    print(f"\n[shards] W={world}: bytes per rank {per_rank} of {total} ({[round(b / total, 3) for b in per_rank]})")
    # its block, the two shards it shares with its neighbours, and (the last rank) the padding's shard
    assert all(b <= total / world + 3 * largest for b in per_rank), (per_rank, total)


@pytest.mark.timeout(60)
def test_the_cache_never_holds_more_than_prefetch_plus_one_shards(fine_shards):
    ds = stream(fine_shards, prefetch=2)
    sampler = StreamedShardSampler(ds, 1, 0, seed=0)
    held = []
    for k, i in enumerate(iter(sampler)):
        ds[i]
        held.append(len(ds.cached_shards()))
        if k % 16 == 0:
            time.sleep(0.02)  # a training step: the fetch thread gets ahead
    assert max(held) <= ds.capacity == 3 and ds.peak_cached <= 3
    assert ds.cached_shards() == []  # the epoch's last sample read: its shard is let go
    assert max(held) >= 2  # and it did fetch ahead


RSS_SCRIPT = textwrap.dedent("""
    import json, sys
    import psutil
    from ray_app.shared import shards
    from ray_app.worker.ddp import StreamedShardSampler
    from ray_app.shared.storage import LocalStorage
    storage = LocalStorage(sys.argv[1])
    ds = shards.ShardDataset(storage, shards.read_manifest(storage), "train", prefetch=2)
    ds[0]; ds._loose = None  # pyarrow and the decoding code loaded, then let go
    me = psutil.Process()
    base = peak = me.memory_info().rss  # the peak of import time is not this reader's: sampled while reading
    sampler = StreamedShardSampler(ds, 1, 0, seed=0)
    n = 0
    for i in iter(sampler):
        n += ds[i][0].numel()
        peak = max(peak, me.memory_info().rss)
    print(json.dumps({"base_kb": base // 1024, "peak_kb": peak // 1024, "peak_cached": ds.peak_cached, "values": n}))
""")


class Constant(Dataset):
    """Samples of 3x32x32 float32 (12 KB), made on demand (the writer holds one row group)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((3, 32, 32), float(i % 251)), i % 10


@pytest.mark.timeout(180)
def test_a_workers_peak_memory_does_not_grow_with_the_data_set(tmp_path):
    shard_mb, per_shard = 0.5, math.ceil(0.5e6 / (3 * 32 * 32 * 4 + 8))
    budget = shard_mb * (shards.DEFAULT_PREFETCH + 1)  # MB of decoded samples the cache may hold
    growth = {}
    for times in (5, 50):
        dest = tmp_path / f"x{times}"
        n = int(times * budget / shard_mb) * per_shard
        shards.write_shards(LocalStorage(str(dest)), {"train": Constant(n), "eval": Constant(8)}, {}, {},
                            shard_mb=shard_mb, say=lambda line: None)
        out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(dest)], capture_output=True, text=True,
                             env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"), timeout=150)
        assert out.returncode == 0, out.stderr[-3000:]
        m = json.loads(out.stdout.strip().splitlines()[-1])
        assert m["peak_cached"] <= shards.DEFAULT_PREFETCH + 1 and m["values"] == n * 3 * 32 * 32
        growth[times] = (m["peak_kb"] - m["base_kb"]) / 1024
        print(f"\n[shards] {times}x the prefetch budget ({times * budget:.1f} MB decoded, {n} samples): "
              f"peak RSS {m['peak_kb'] / 1024:.1f} MB, +{growth[times]:.1f} MB while reading")
    data_50 = 50 * budget
    assert growth[50] < data_50 / 2, growth  # nowhere near the whole set
    assert growth[50] <= growth[5] + 16, growth  # and about what a set of 5x the budget takes


# ---------------------------------------------------------------- bad input

def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.timeout(60)
def test_a_shard_whose_bytes_changed_is_the_bad_input_error_naming_it(digit_shards, tmp_path):
    import shutil

    dest = tmp_path / "copy"
    shutil.copytree(digit_shards, dest)
    manifest = shards.read_manifest(LocalStorage(str(dest)))
    bad = manifest.splits["train"][3]
    flip_a_byte(dest / bad.path)
    cfg = load_config(None, ["data.name=shards", f"data.path={dest}"])
    train, _, info = build_data(cfg)  # as a worker builds it: the guarded data set of the loop
    assert info["num_classes"] == 10
    sampler = StreamedShardSampler(train, 1, 0, seed=0)
    with pytest.raises(ShardError) as err:
        for _batch in DataLoader(train, batch_size=32, sampler=sampler, collate_fn=info["collate_fn"]):
            pass
    message = str(err.value)
    assert bad.path in message and "sha256 mismatch" in message and "\n" not in message


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case, says", [
    ("no manifest", "no manifest.json"),
    ("no shards", "split train lists no shards"),
    ("another format", "not a ray_app shard manifest"),
])
def test_a_shard_set_that_cannot_be_read_stops_train_before_ray_starts(ray_app, digit_shards, tmp_path,  # noqa: F811
                                                                       case, says):
    import shutil

    dest = tmp_path / "copy"
    shutil.copytree(digit_shards, dest)
    path = dest / shards.MANIFEST
    m = json.loads(path.read_text())
    if case == "no manifest":
        path.unlink()
    else:
        m.update(format="ray_app.checkpoint/1") if case == "another format" else \
            m["splits"]["train"].update(shards=[], samples=0)
        path.write_text(json.dumps(m))
    rc, out, err = ray_app(["train", "--set", "data.name=shards", "--set", f"data.path={dest}",
                            "--set", f"run.storage={tmp_path / 'runs'}"], env={"RAY_ADDRESS": None})
    assert rc == 2 and says in one_error_line(err), err
    assert not (tmp_path / "runs").exists()  # nothing started: no lease, no run folder


@pytest.mark.timeout(30)
def test_shards_args_are_checked_on_the_driver_and_loader_workers_are_named_once(digit_shards):
    from ray_app.shared.errors import ConfigError
    from ray_app.shared.plugins import loader_workers_note, validate

    base = ["data.name=shards", f"data.path={digit_shards}"]
    validate(load_config(None, base + ["data.args.prefetch=4"]))
    for arg, says in (("data.args.prefetch=0", "data.args.prefetch: 0"),
                      ("data.args.storage_retry_s=5", "takes no argument 'storage_retry_s'")):
        with pytest.raises(ConfigError, match=says):
            validate(load_config(None, base + [arg]))
    assert loader_workers_note(load_config(None, base)) is None
    note = loader_workers_note(load_config(None, base + ["data.loader_workers=2"]))
    assert "data.loader_workers=2 is not used" in note and "\n" not in note
    assert loader_workers_note(load_config(None, ["data.loader_workers=2"])) is None  # map-style: used


# ---------------------------------------------------------------- the DDP loop on streamed shards (gloo, no Ray)

def _loop_worker(rank: int, world: int, port: int, out: str, storage: str, dest: str, phase: str) -> None:
    _init(rank, world, port)
    shards_cfg = ["data.name=shards", f"data.path={dest}", f"run.storage={storage}"]
    results = {}
    if phase == "two":
        ref = load_config(None, BASE + NO_CKPT + shards_cfg + ["run.name=ref"])
        results["ref"] = _fit(rank, world, ref)
        every5 = ["checkpoint.every_steps=5", "checkpoint.every_epochs=1"]
        # 1438 samples / 2 ranks / 32 = 23 batches an epoch; checkpoints at 5, 10, 15, 20, 23, 25: a stop at 25
        cfg = load_config(None, BASE + every5 + shards_cfg + ["run.name=crash"])
        results["crashed"] = _fit(rank, world, cfg, crash_after=6)
        results["resumed"] = _fit(rank, world, cfg)
        grow = load_config(None, BASE + every5 + shards_cfg + ["run.name=grow"])
        results["grow-stopped"] = _fit(rank, world, grow, crash_after=6)
    else:  # the run stopped at 2 ranks goes on at 3
        grow = load_config(None, BASE + shards_cfg + ["run.name=grow", "checkpoint.every_steps=5"])
        results["grown"] = _fit(rank, world, grow)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    _finish()


@pytest.fixture(scope="module")
def loop_runs(digit_shards, tmp_path_factory, port_picker):
    out2, out3 = tmp_path_factory.mktemp("loop2"), tmp_path_factory.mktemp("loop3")
    storage = tmp_path_factory.mktemp("runs")
    _spawn(_loop_worker, 2, port_picker(), str(out2), str(storage), str(digit_shards), "two")
    _spawn(_loop_worker, 3, port_picker(), str(out3), str(storage), str(digit_shards), "three")
    return _load_ranks(out2, 2), _load_ranks(out3, 3)


@pytest.mark.timeout(240)
def test_a_streamed_run_resumed_mid_epoch_ends_bit_identical(loop_runs):
    two, _ = loop_runs
    ref, crashed, resumed = two[0]["ref"], two[0]["crashed"], two[0]["resumed"]
    assert ref["summary"]["global_step"] == 46 and ref["summary"]["num_samples"] == 359
    assert ref["summary"]["eval_accuracy"] > 0.5
    assert crashed["summary"] is None and resumed["resumed_from_step"] == 25
    assert resumed["last_step_shown"] == ref["last_step_shown"] == 46
    assert not _same_params(crashed["params"], ref["params"])
    assert _same_params(resumed["params"], ref["params"]) and _same_params(two[1]["resumed"]["params"], ref["params"])
    assert resumed["summary"]["eval_accuracy"] == ref["summary"]["eval_accuracy"]
    assert resumed["summary"]["eval_loss"] == ref["summary"]["eval_loss"]


@pytest.mark.timeout(240)
def test_streamed_eval_is_exact_and_a_resume_at_three_ranks_finishes_the_epoch(loop_runs):
    from tests.support.evaluation import default_model_eval

    two, three = loop_runs
    ref = two[0]["ref"]
    acc, _ = default_model_eval(ref["params"])  # the map-style eval set, one process, one batch
    assert ref["summary"]["eval_accuracy"] == acc
    grown = three[0]["grown"]
    assert grown["resumed_from_step"] == 25
    done = 2 * 32 * 2  # epoch 1, 2 batches of 32 on 2 ranks
    left = math.ceil(math.ceil((1438 - done) / 3) / 32)
    assert grown["summary"]["global_step"] == 25 + left and grown["summary"]["num_samples"] == 359
    assert grown["last_step_shown"] == 25 + left  # progress lines count to the step the run ends at
    assert all(_same_params(three[r]["grown"]["params"], grown["params"]) for r in (1, 2))
