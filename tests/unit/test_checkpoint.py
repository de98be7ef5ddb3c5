"""Checkpoints: manifest verification, choosing the newest good one, RNG round-trip, weights_only loading."""

from __future__ import annotations

import io
import json
import pickle
import random
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ray_app.shared import catalog
from ray_app.shared.catalog import (
    MANIFEST,
    SINGLE_FILE_FORMAT,
    checkpoint_dir_name,
    choose,
    list_checkpoints,
    manifest_format,
    newest_good,
    verified,
    verify,
)
from ray_app.shared.errors import CheckpointError, StorageError
from ray_app.shared.storage import LocalStorage
from ray_app.worker.checkpoint import (
    Checkpointer,
    capture_rng_state,
    load,
    load_uri,
    needed,
    restore_rng_state,
    upload_checkpoint_dir,
    write_manifest,
)
from tests.support.checkpoints import CheckpointPayload, save_tiny_shards, write_single_file_dir
from tests.support.checkpoints import tiny_payload as checkpoint_payload

RUN = "run-a"


def tiny_payload(step: int, seed: int = 0, ranks: int = 2) -> CheckpointPayload:
    """This module's checkpoints: two ranks of run-a, 5 batches into epoch 2."""
    return checkpoint_payload(step, seed=seed, ranks=ranks, epoch=2, batches_done=5, config={"run": {"name": RUN}},
                              metrics={"global_step": step, "eval_accuracy": 0.9})


@pytest.fixture
def storage(tmp_path):
    return LocalStorage(str(tmp_path / "runs"))


def commit(storage: LocalStorage, step: int, seed: int = 0, name: str | None = None) -> str:
    """Write a checkpoint locally, then upload it (manifest last) like the trainer does. Returns rel."""
    name = name or checkpoint_dir_name(step)
    local = storage.root.parent / f"local-{name}"
    write_single_file_dir(local, tiny_payload(step, seed))
    upload_checkpoint_dir(local, storage, f"{RUN}/{name}")
    shutil.rmtree(local)
    return f"{RUN}/{name}"


def load_verified(storage, rel: str, rank: int | None = 0, model_only: bool = False):
    """The checkpoint at ``rel`` verified (``catalog.verified``) and loaded as the kit does."""
    return load(verified(storage, rel, keep=needed(rank, model_only)), rank, model_only=model_only)


def step_of(loaded) -> int:
    return loaded.train_state().pos.global_step


def flip_byte(path, offset=-20):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_written_checkpoint_verifies_and_loads(storage):
    rel = commit(storage, 12)
    v = verify(storage, rel)
    assert v.ok and v.reason == "ok"
    files = set(v.manifest["files"])
    assert files == {"model.pt", "optimizer.pt", "scheduler.pt", "state.json", "config.json", "metrics.json",
                     "rng/rank_0.pt", "rng/rank_1.pt"}
    loaded = load_verified(storage, rel, rank=1)
    expected = tiny_payload(12)
    assert all(torch.equal(loaded.model[k], expected.model[k]) for k in expected.model)
    assert step_of(loaded) == 12 and loaded.train_state().pos.batches_done == 5
    assert loaded.optimizer["state"][0]["momentum_buffer"].shape == (4, 5)
    assert loaded.rng is not None and loaded.uri == storage.uri(rel)


def test_an_older_checkpoint_with_a_scaler_file_still_verifies_and_loads(storage, tmp_path):
    """Checkpoints written before the never-enabled GradScaler was dropped hold scaler.pt (its empty state):
    it is verified like every file the manifest lists, and the rest loads as before."""
    local = tmp_path / "old"
    write_single_file_dir(local, tiny_payload(6))
    torch.save(torch.amp.GradScaler("cuda", enabled=False).state_dict(), local / "scaler.pt")
    write_manifest(local, global_step=6, epoch=2, fmt=SINGLE_FILE_FORMAT)  # re-commit: the manifest lists scaler.pt as the old ones do
    upload_checkpoint_dir(local, storage, f"{RUN}/old")
    v = verify(storage, f"{RUN}/old")
    assert v.ok and "scaler.pt" in v.manifest["files"]
    loaded = load_verified(storage, f"{RUN}/old", rank=0)
    assert step_of(loaded) == 6 and loaded.optimizer["state"][0]["momentum_buffer"].shape == (4, 5)
    flip_byte(storage.root / RUN / "old" / "scaler.pt", offset=-1)
    assert "scaler.pt does not match its manifest (sha256)" in verify(storage, f"{RUN}/old").reason


def test_dir_names_sort_by_step():
    names = [checkpoint_dir_name(s) for s in (5, 100, 20, 3000)]
    assert sorted(names) == [names[0], names[2], names[1], names[3]]
    assert len({checkpoint_dir_name(1) for _ in range(20)}) == 20  # never the same name twice


@pytest.mark.parametrize("damage, reason", [
    ("flip", "model.pt does not match its manifest (sha256)"),
    ("truncate", "optimizer.pt does not match its manifest (size)"),
    ("missing", "missing file rng/rank_1.pt"),
    ("no_manifest", "no manifest"),
    ("bad_manifest", "manifest unreadable"),
])
def test_damaged_checkpoint_is_not_verified_and_not_loaded(storage, damage, reason):
    rel = commit(storage, 3)
    d = storage.root / rel
    if damage == "flip":
        flip_byte(d / "model.pt")
    elif damage == "truncate":
        (d / "optimizer.pt").write_bytes((d / "optimizer.pt").read_bytes()[:-1])
    elif damage == "missing":
        (d / "rng" / "rank_1.pt").unlink()
    elif damage == "no_manifest":
        (d / MANIFEST).unlink()
    else:
        (d / MANIFEST).write_text("{not json")
    v = verify(storage, rel)
    assert not v.ok
    assert reason in v.reason
    with pytest.raises(CheckpointError, match="failed verification"):
        load_verified(storage, rel, rank=0)


def test_manifest_must_list_the_model(storage):
    rel = commit(storage, 3)
    man_path = storage.root / rel / MANIFEST
    man = json.loads(man_path.read_text())
    del man["files"]["model.pt"]
    man_path.write_text(json.dumps(man))
    v = verify(storage, rel)
    assert not v.ok and "manifest lists no model.pt" in v.reason


def _rewrite_format(storage, rel: str, fmt) -> None:
    man_path = storage.root / rel / MANIFEST
    man = json.loads(man_path.read_text())
    man["format"] = fmt
    man_path.write_text(json.dumps(man))


@pytest.mark.parametrize("fmt", ["ray_app.checkpoint/9", None])
def test_a_manifest_of_an_unknown_format_is_refused_by_name(storage, fmt):
    rel = commit(storage, 3)
    _rewrite_format(storage, rel, fmt)
    v = verify(storage, rel)
    assert not v.ok and f"manifest of an unknown format {fmt!r}" in v.reason and "ray_app.checkpoint/1" in v.reason
    with pytest.raises(CheckpointError, match=r"failed verification: manifest of an unknown format"):
        load_verified(storage, rel, rank=0)
    with pytest.raises(CheckpointError, match="unknown format"):
        manifest_format({"format": fmt, "files": {}})
    assert manifest_format({"format": "ray_app.script/1"}) == "ray_app.script/1"


def test_the_format_check_holds_under_python_optimize(storage):
    """``python -O`` drops asserts: the format check is not one."""
    rel = commit(storage, 3)
    _rewrite_format(storage, rel, "ray_app.checkpoint/9")
    code = ("import sys; from ray_app.shared.catalog import verify; from ray_app.shared.storage import LocalStorage; "
            f"v = verify(LocalStorage({str(storage.root)!r}), {rel!r}); print(v.ok, v.reason)")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("False manifest of an unknown format 'ray_app.checkpoint/9'"), out.stdout


def test_upload_writes_manifest_last(storage, tmp_path):
    local = tmp_path / "local"
    write_single_file_dir(local, tiny_payload(1))
    order = []

    class RecordingStorage(LocalStorage):
        def upload_file(self, src, rel):
            order.append(rel.rsplit("/", 1)[-1])
            super().upload_file(src, rel)

    upload_checkpoint_dir(local, RecordingStorage(str(storage.root)), f"{RUN}/x")
    assert order[-1] == MANIFEST and order.count(MANIFEST) == 1


def test_the_newest_good_checkpoint_skips_a_broken_newer_one_and_says_so_once(storage):
    old = commit(storage, 10, seed=1)
    new = commit(storage, 20, seed=2)
    flip_byte(storage.root / new / "model.pt")
    incomplete = commit(storage, 30, seed=3)
    (storage.root / incomplete / MANIFEST).unlink()  # an upload that died before its commit
    lines, said = [], set()
    assert newest_good(storage, RUN, say=lines.append, said=said).rel == old
    assert lines == [f"ray-app: skipped {storage.uri(incomplete)}: no manifest (incomplete or not a ray_app checkpoint)",
                     f"ray-app: skipped {storage.uri(new)}: model.pt does not match its manifest (sha256)"]
    # a Checkpointer given what was said already (the driver's) resumes from the older good one, silently
    cp = Checkpointer(storage, RUN, report=None, warn=lines.append, said=said)
    loaded = cp.restore(rank=0)
    assert step_of(loaded) == 10 and cp.last_uri == storage.uri(old) and len(lines) == 2


def test_no_good_checkpoint_means_fresh_start(storage):
    rel = commit(storage, 10)
    (storage.root / rel / MANIFEST).unlink()
    assert newest_good(storage, RUN) is None
    assert Checkpointer(storage, RUN, report=None).restore(0) is None
    with pytest.raises(CheckpointError, match="passes verification"):
        choose(storage.uri(RUN))


def test_choose_a_run_and_a_checkpoint_uri(storage):
    a = commit(storage, 1)
    b = commit(storage, 2)
    found = choose(storage.uri(RUN))
    assert found.rel == b and found.storage.root == storage.root
    assert choose(storage.uri(a)).rel.endswith(a.rsplit("/", 1)[-1])
    with pytest.raises(StorageError):
        choose(storage.uri("no-such-run"))
    assert list_checkpoints(storage, RUN) == [a.rsplit("/", 1)[-1], b.rsplit("/", 1)[-1]]


def _draws():
    return (torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)], np.random.randn(1))


def test_rng_round_trip_reproduces_draws(storage, tmp_path):
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    np.random.randn(1)  # leaves a cached gaussian in numpy's state
    payload = tiny_payload(1, ranks=1)
    payload.rng_per_rank = [capture_rng_state()]
    expected = _draws()
    write_single_file_dir(tmp_path / "c", payload)
    upload_checkpoint_dir(tmp_path / "c", storage, f"{RUN}/c")
    _draws()  # move every generator on
    loaded = load_verified(storage, f"{RUN}/c", rank=0)
    restore_rng_state(loaded.rng)
    got = _draws()
    assert torch.equal(got[0], expected[0])
    assert np.array_equal(got[1], expected[1]) and np.array_equal(got[3], expected[3])
    assert got[2] == expected[2]


def test_every_file_loads_with_weights_only(storage):
    rel = commit(storage, 5)
    d = storage.root / rel
    written = sorted(f.relative_to(d).as_posix() for f in d.rglob("*.pt"))
    assert written == ["model.pt", "optimizer.pt", "rng/rank_0.pt", "rng/rank_1.pt", "scheduler.pt"]
    for name in written:
        torch.load(d / name, weights_only=True)  # raises if anything but tensors and plain containers


class Payload:
    """Not a tensor: loading it needs arbitrary unpickling."""

    def __reduce__(self):
        return (print, ("arbitrary code ran",))


def test_a_pickled_object_in_a_checkpoint_is_refused(storage, tmp_path, capsys):
    local = tmp_path / "evil"
    payload = tiny_payload(9)
    write_single_file_dir(local, payload)
    torch.save({"weight": Payload()}, local / "model.pt")
    # re-commit with a matching manifest: verification alone cannot catch it, weights_only must
    files = {}
    import hashlib
    for f in sorted(p for p in local.rglob("*") if p.is_file() and p.name != MANIFEST):
        files[f.relative_to(local).as_posix()] = {"sha256": hashlib.sha256(f.read_bytes()).hexdigest(),
                                                  "bytes": f.stat().st_size}
    man = json.loads((local / MANIFEST).read_text())
    man["files"] = files
    (local / MANIFEST).write_text(json.dumps(man))
    upload_checkpoint_dir(local, storage, f"{RUN}/evil")
    assert verify(storage, f"{RUN}/evil").ok
    with pytest.raises(CheckpointError, match="model.pt cannot be loaded with torch.load\\(weights_only=True\\)"):
        load_verified(storage, f"{RUN}/evil", rank=0)
    assert "arbitrary code ran" not in capsys.readouterr().out


def test_raw_weights_only_refuses_objects():
    buf = io.BytesIO()
    torch.save({"x": Payload()}, buf)
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(buf, weights_only=True)


# ---------------------------------------------------------------- cadence and blocked time

def pos(global_step: int, batches_done: int, epoch: int = 0):
    return SimpleNamespace(global_step=global_step, batches_done=batches_done, epoch=epoch)


def planned(storage, **cadence) -> Checkpointer:
    cp = Checkpointer(storage, RUN, report=None, **cadence)
    cp.plan(batches_per_epoch=8, epochs=3, max_steps=cadence.pop("max_steps", 0))
    return cp


def test_step_cadence_is_every_n_optimizer_steps_and_leaves_epoch_ends_alone(storage):
    cp = planned(storage, every_steps=5)
    assert cp.due(pos(10, 3))
    assert not cp.due(pos(11, 4))
    assert not cp.due(pos(10, 8))  # the epoch's end: due(epoch_end=True) / final_due decide
    assert not planned(storage).due(pos(10, 3))  # every_steps=0: off
    limited = Checkpointer(storage, RUN, report=None, every_steps=5)
    limited.plan(batches_per_epoch=8, epochs=3, max_steps=10)
    assert not limited.due(pos(10, 3))  # train.max_steps reached: the final checkpoint's


@pytest.mark.parametrize("every, done, total, due", [
    (1, 1, 3, True), (1, 2, 3, True), (1, 3, 3, False),  # the last epoch is the final checkpoint's
    (2, 1, 5, False), (2, 2, 5, True), (2, 4, 4, False), (3, 3, 7, True), (0, 1, 3, False),
])
def test_epoch_cadence(storage, every, done, total, due):
    cp = Checkpointer(storage, RUN, report=None, every_epochs=every)
    cp.plan(batches_per_epoch=8, epochs=total)
    assert cp.due(pos(done * 8, 0, epoch=done), epoch_end=True) is due


def test_final_checkpoint_unless_off_or_nothing_new_was_trained(storage):
    fresh = Checkpointer(storage, RUN, report=None)
    assert fresh.final_due(global_step=30, resumed_from_step=0)
    assert not Checkpointer(storage, RUN, report=None, every_epochs=0).final_due(30, 0)  # checkpoints off
    assert Checkpointer(storage, RUN, report=None, every_epochs=0, every_steps=7).final_due(30, 0)
    commit(storage, 30)
    resumed = Checkpointer(storage, RUN, report=None, warn=lambda m: None)
    assert step_of(resumed.restore(rank=0)) == 30
    assert not resumed.final_due(global_step=30, resumed_from_step=30)  # a resume that trained nothing
    assert resumed.final_due(global_step=31, resumed_from_step=30)


def _reporter(calls, defer=None):
    def report(metrics, local_dir, dir_name, upload):
        calls.append((metrics, local_dir, dir_name))
        if local_dir is not None:
            if defer is None:
                upload(local_dir, dir_name)
            else:
                defer.append(lambda: upload(local_dir, dir_name))
    return report


def test_save_shards_reports_the_name_it_was_given_and_accounts_the_blocked_time(storage):
    """Every rank reports the one name rank 0 chose (the checkpoint's URI in its metrics), rank 0 commits it in
    the upload function the runtime runs, and the seconds training was blocked are accounted per checkpoint."""
    calls = []
    cp = Checkpointer(storage, RUN, _reporter(calls))
    assert (cp.blocked_seconds, cp.written) == (0.0, 0)
    first_name, first = save_tiny_shards(cp, 4)
    second_name, second = save_tiny_shards(cp, 8, seed=1)
    assert first > 0 and second > 0
    assert cp.written == 2 and cp.blocked_seconds == pytest.approx(first + second)
    assert [c[2] for c in calls] == [first_name, second_name]
    assert calls[1][0]["checkpoint"] == cp.last_uri == storage.uri(RUN, second_name)
    assert newest_good(storage, RUN).name == second_name
    assert step_of(load_verified(storage, f"{RUN}/{second_name}", rank=0)) == 8


def test_warm_start_only_when_the_checkpoint_comes_from_resume_from(storage):
    commit(storage, 5)  # in run-a
    source = storage.uri(RUN)
    warm = Checkpointer(storage, "run-b", report=None, resume_from=source, warn=lambda m: None)
    assert step_of(warm.restore(rank=0)) == 5
    assert warm.warm_start and warm.last_uri.startswith(source)
    own = Checkpointer(storage, RUN, report=None, resume_from=storage.uri("elsewhere"), warn=lambda m: None)
    assert own.restore(rank=0) is not None and not own.warm_start
    assert not Checkpointer(storage, "run-c", report=None).warm_start


def test_the_config_the_driver_compares_is_that_of_the_newest_checkpoint_that_verifies(storage):
    assert newest_good(storage, RUN) is None
    old = commit(storage, 10)
    found = newest_good(storage, RUN, keep="config.json".__eq__)
    assert found.uri == storage.uri(old) and found.config == {"run": {"name": RUN}}
    assert set(found.verification.contents) == {"config.json"}  # kept: not read again
    new = commit(storage, 20)
    flip_byte(storage.root / new / "model.pt")  # a file the config check does not need: skipped all the same
    assert newest_good(storage, RUN).uri == storage.uri(old)
    uncommitted = commit(storage, 30)
    (storage.root / uncommitted / MANIFEST).unlink()
    assert newest_good(storage, RUN).uri == storage.uri(old)


# ---------------------------------------------------------------- each byte read once; storage errors propagate

class CountingStorage(LocalStorage):
    """A local folder that counts the bytes read of each file (rel -> [bytes of each read])."""

    def __init__(self, root: str):
        super().__init__(root)
        self.reads: dict[str, list[int]] = {}

    def read_bytes(self, rel: str) -> bytes:
        data = super().read_bytes(rel)
        self.reads.setdefault(rel, []).append(len(data))
        return data


def _sizes(storage, rel: str) -> dict[str, int]:
    return {f"{rel}/{name}": size for name, size in storage.list_files(rel).items()}


@pytest.mark.timeout(30)
def test_a_restore_reads_every_byte_of_the_checkpoint_once(storage):
    old = commit(storage, 10, seed=1)
    new = commit(storage, 20, seed=2)
    counting = CountingStorage(str(storage.root))
    loaded = Checkpointer(counting, RUN, report=None).restore(rank=1)
    assert step_of(loaded) == 20 and loaded.rng is not None
    assert counting.reads == {rel: [size] for rel, size in _sizes(storage, new).items()}  # once each, nothing of old
    assert not any(rel.startswith(old) for rel in counting.reads)
    # a damaged newer one is read (at most) once too, then skipped for the older one
    flip_byte(storage.root / new / "model.pt")
    counting = CountingStorage(str(storage.root))
    warnings = []
    assert step_of(Checkpointer(counting, RUN, report=None, warn=warnings.append).restore(rank=0)) == 10
    assert all(len(sizes) == 1 for sizes in counting.reads.values()), counting.reads
    assert len(warnings) == 1 and "model.pt does not match its manifest (sha256)" in warnings[0]


@pytest.mark.timeout(60)
def test_a_restore_from_s3_fetches_every_byte_of_the_checkpoint_once(s3, tmp_path, monkeypatch):
    """The same on a real S3 API server: every GET's body size counted as the server sends it."""
    from ray_app.shared.storage import S3Storage

    for key, value in s3.env().items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)
    storage = S3Storage(f"s3://{s3.bucket}/byte-count", retry_s=10)
    rels = []
    for step, seed in ((10, 1), (20, 2)):
        local = tmp_path / f"local-{step}"
        write_single_file_dir(local, tiny_payload(step, seed))
        rels.append(f"{RUN}/{checkpoint_dir_name(step)}")
        upload_checkpoint_dir(local, storage, rels[-1])
    fetched: dict[str, list[int]] = {}

    def before(params, context, **_):
        context["counted_key"] = params["url_path"].split("/byte-count/", 1)[-1]

    def after(parsed, context, **_):
        fetched.setdefault(context["counted_key"], []).append(parsed["ContentLength"])

    storage.client.meta.events.register("before-call.s3.GetObject", before)
    storage.client.meta.events.register("after-call.s3.GetObject", after)
    loaded = Checkpointer(storage, RUN, report=None).restore(rank=1)
    assert step_of(loaded) == 20
    assert fetched == {f"{rels[1]}/{name}": [size] for name, size in storage.list_files(rels[1]).items()}, fetched


@pytest.mark.timeout(30)
def test_evaluation_and_export_verify_every_file_and_read_each_once(storage):
    rel = commit(storage, 10)
    counting = CountingStorage(str(storage.root))
    load_verified(counting, rel, rank=None, model_only=True)
    assert counting.reads == {f"{rel}/{name}": [size] for name, size in storage.list_files(rel).items()}


@pytest.mark.timeout(30)
def test_the_choice_of_a_uri_reads_each_file_once_and_keeps_the_config(storage, monkeypatch):
    from ray_app.shared import storage as storage_mod

    rel = commit(storage, 10)
    made = []

    def counting_open(uri, retry_s=0.0, then=None):
        made.append(CountingStorage(uri))
        return made[-1]

    monkeypatch.setattr(storage_mod, "open_storage", counting_open)
    for uri in (storage.uri(rel), storage.uri(RUN)):
        made.clear()
        found = catalog.choose(uri, keep="config.json".__eq__)
        assert (found.uri, found.config) == (storage.uri(rel), {"run": {"name": RUN}})
        reads = {r: sizes for s in made for r, sizes in s.reads.items()}
        assert reads == {f"{rel}/{name}": [size] for name, size in storage.list_files(rel).items()}, reads


class Outage(LocalStorage):
    """A local folder whose listing or reading of the paths that contain ``broken`` fails as S3 does when its
    endpoint does not answer."""

    def __init__(self, root: str, broken: str, op: str):
        super().__init__(root)
        self.broken, self.op = broken, op

    def _fail(self, rel: str):
        from botocore.exceptions import EndpointConnectionError

        if self.broken in rel:
            raise EndpointConnectionError(endpoint_url="http://127.0.0.1:9")

    def list_files(self, rel: str):
        if self.op == "list":
            self._fail(rel)
        return super().list_files(rel)

    def read_bytes(self, rel: str):
        if self.op == "read" and rel.endswith(MANIFEST):
            self._fail(rel)
        return super().read_bytes(rel)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("op", ["list", "read"])
def test_a_storage_error_is_raised_not_taken_for_a_bad_checkpoint(storage, op):
    from botocore.exceptions import EndpointConnectionError

    commit(storage, 10, seed=1)
    new = commit(storage, 20, seed=2)
    down = Outage(str(storage.root), new.rsplit("/", 1)[-1], op)
    with pytest.raises(EndpointConnectionError):
        verify(down, new)
    with pytest.raises(EndpointConnectionError):  # not a resume from the older checkpoint
        Checkpointer(down, RUN, report=None, warn=lambda m: None).restore(rank=0)
    with pytest.raises(EndpointConnectionError):
        newest_good(down, RUN)


@pytest.mark.timeout(30)
def test_a_resume_from_checkpoint_that_does_not_load_is_an_error_not_a_fresh_start(storage):
    rel = commit(storage, 5)
    flip_byte(storage.root / rel / "model.pt")
    warm = Checkpointer(storage, "run-b", report=None, resume_from=storage.uri(rel), warn=lambda m: None)
    with pytest.raises(CheckpointError,
                       match=r"run.resume_from .* failed verification: model.pt does not match its manifest \(sha256\)"):
        warm.restore(rank=0)


def test_eval_and_export_of_a_run_take_its_newest_checkpoint_that_loads(storage):
    """A run URI whose newest checkpoint is damaged (a changed byte in model.pt, its manifest intact): the
    newest that loads, with a warning; the damaged one named by its URI is bad input."""
    old = commit(storage, 10, seed=1)
    new = commit(storage, 20, seed=2)
    flip_byte(storage.root / new / "model.pt")
    warnings = []
    loaded = load_uri(storage.uri(RUN), rank=None, model_only=True, say=warnings.append)
    assert loaded.uri == storage.uri(old) and step_of(loaded) == 10
    assert warnings == [f"ray-app: skipped {storage.uri(new)}: model.pt does not match its manifest (sha256)"]
    with pytest.raises(CheckpointError, match=r"model.pt does not match its manifest \(sha256\)"):
        load_uri(storage.uri(new), rank=None, model_only=True)


# ---------------------------------------------------------------- one rule: the newest checkpoint that verifies

def _sharded_run(storage, steps=(4, 8)) -> list[str]:
    """Checkpoints of run-a as the kit writes them (every rank's share; here one rank), committed."""
    cp = Checkpointer(storage, RUN, _reporter([]))
    return [save_tiny_shards(cp, step, seed=step)[0] for step in steps]


@pytest.mark.timeout(60)
def test_a_changed_scheduler_pt_is_skipped_by_eval_export_and_resume_and_said_once(storage):
    """scheduler.pt is a file eval and export do not load: its checkpoint, which `checkpoints verify`
    rejects, is skipped all the same, with one line saying which and why; named, it is bad input."""
    old, new = _sharded_run(storage)
    flip_byte(storage.root / RUN / new / "scheduler.pt", offset=-30)
    assert not verify(storage, f"{RUN}/{new}").ok  # what `ray-app checkpoints verify` says
    line = f"ray-app: skipped {storage.uri(RUN, new)}: scheduler.pt does not match its manifest (sha256)"
    said_lines, said = [], set()
    loaded = load_uri(storage.uri(RUN), rank=None, model_only=True, say=said_lines.append, said=said)  # eval, export
    assert loaded.uri == storage.uri(RUN, old) and said_lines == [line]
    with pytest.raises(CheckpointError, match=r"scheduler.pt does not match its manifest \(sha256\)"):
        load_uri(storage.uri(RUN, new), rank=None, model_only=True)
    resumed = Checkpointer(storage, RUN, report=None, warn=said_lines.append, said=said).restore(rank=0)
    assert resumed.uri == storage.uri(RUN, old) and said_lines == [line]  # said once, not again by the workers
    fresh = []
    assert Checkpointer(storage, RUN, report=None, warn=fresh.append).restore(rank=0).uri == storage.uri(RUN, old)
    assert fresh == [line]


# ---------------------------------------------------------------- a write that fails leaves nothing behind

def _big_files(step: int):
    from ray_app.shared.catalog import Position, TrainState
    from ray_app.worker.checkpoint import CheckpointFiles

    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weights: more than the small disk holds
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, CheckpointFiles(sched.state_dict(), TrainState(Position(global_step=step), 1), {}, {})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("full", ["storage", "staging"])
def test_a_full_disk_leaves_no_partial_checkpoint_and_no_temp_file(tmp_path, monkeypatch, full):
    """run.storage (or the rank's local staging) on a 2 MB disk: the write fails, and neither the run's
    folder nor the disk keeps a partial checkpoint or a temp file."""
    import tempfile
    import warnings

    from tests.support.disks import files_under, small_disk

    with small_disk(tmp_path / "disk") as disk:
        storage = LocalStorage(str(disk / "runs" if full == "storage" else tmp_path / "runs"))
        if full == "staging":
            monkeypatch.setattr(tempfile, "tempdir", str(disk))
        cp = Checkpointer(storage, RUN, _reporter([]))
        model, opt, files = _big_files(3)
        with warnings.catch_warnings(), pytest.raises(StorageError, match="free space"):
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            cp.save_shards(model, opt, files, capture_rng_state(), {"global_step": 3}, rank=0, world_size=1,
                           name=cp.new_name(3))
        assert list_checkpoints(storage, RUN) == []
        assert files_under(disk) == []
