"""Shards: `ray-app data write` packs a data set into Parquet shards under a manifest written last, they read back
bit-identical to the map-style data set, `ray-app data verify` catches a changed byte, and bad input is one line
and exit 2, in a local folder and on a real S3 API server (moto_server over HTTP).

The command line runs in this process (torch is imported already: seconds less than a subprocess each).
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
import torch

from ray_app.driver import cli
from ray_app.shared import shards
from ray_app.shared.data import digits, synthetic
from ray_app.shared.errors import ShardError
from ray_app.shared.storage import LocalStorage, open_storage

SYNTHETIC = ["--set", "data.name=synthetic", "--set", "data.args.num_samples=160", "--set", "data.args.image_size=8"]


@pytest.fixture
def ray_app(monkeypatch, capsys, tmp_path):
    """``ray_app(args, env=None) -> (rc, stdout, stderr)``: ``ray-app ARGS`` in this process, from ``tmp_path``
    (no configs/local.yaml there: the built-in defaults, as for a user's own project folder)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # main() would leave its SIGTERM handler here

    def run(args: list[str], env: dict | None = None):
        for key, value in (env or {}).items():
            if value is None:
                monkeypatch.delenv(key, raising=False)
            else:
                monkeypatch.setenv(key, value)
        capsys.readouterr()
        rc = cli.main([str(a) for a in args])
        out, err = capsys.readouterr()
        return rc, out, err

    return run


def one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def same_sample(a, b) -> bool:
    """Equal structure, types, dtypes, shapes and bytes (NaN payloads and -0.0 included)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            a.contiguous().reshape(-1).view(torch.uint8).tolist() == b.contiguous().reshape(-1).view(torch.uint8).tolist()
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(same_sample(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same_sample(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (a == b or a != a and b != b)


def read_back(storage, manifest: shards.ShardManifest, split: str) -> list[tuple[int, object]]:
    return [row for shard in manifest.splits[split] for row in shards.iter_shard(storage, shard, manifest.encoding)]


def assert_round_trip(storage, datasets: dict) -> shards.ShardManifest:
    manifest = shards.read_manifest(storage)
    for split, ds in datasets.items():
        rows = read_back(storage, manifest, split)
        assert manifest.samples(split) == len(ds) == len(rows)
        assert [i for i, _ in rows] == list(range(len(ds)))
        bad = [i for i, sample in rows if not same_sample(ds[i], sample)]
        assert bad == [], f"{split}: samples {bad[:5]} differ from __getitem__"
    return manifest


# ---------------------------------------------------------------- round trips

@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, args, build", [
    ("digits", ["--set", "data.name=digits", "--shard-mb", "0.1"], digits),
    ("synthetic", [*SYNTHETIC, "--shard-mb", "0.05"], lambda: synthetic(160, 8)),
])
def test_a_built_in_data_set_reads_back_bit_identical_from_a_folder(ray_app, tmp_path, name, args, build):
    rc, out, err = ray_app(["data", "write", tmp_path / "shards", *args])
    assert rc == 0, err
    train, evaluation, info = build()
    summary = json.loads(out.strip().splitlines()[-1])
    assert (summary["train_samples"], summary["eval_samples"]) == (len(train), len(evaluation))
    assert summary["info"] == info
    manifest = assert_round_trip(LocalStorage(tmp_path / "shards"), {"train": train, "eval": evaluation})
    assert len(manifest.splits["train"]) > 1, "--shard-mb cut the train set into several shards"
    assert all(s.path.startswith(f"{s.split}/") and s.path.endswith(".parquet") for s in manifest.shards)


class Samples:
    """A plug-in's map-style data set: whatever list of samples it is given."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def tuple_sample(i: int):
    nan_payload = torch.tensor([0x7FC00001, -0x80000000], dtype=torch.int32).view(torch.float32)  # a NaN, -0.0
    return (torch.arange(12, dtype=torch.float64).reshape(3, 4).t()[:, i % 3],  # not contiguous
            torch.tensor(i, dtype=torch.int64),  # 0-d, as TensorDataset gives labels
            torch.full((2, i % 3), i, dtype=torch.bfloat16),  # no numpy dtype; empty at i % 3 == 0
            torch.tensor([i % 2 == 0, True]), nan_payload, i, i / 3, i % 2 == 0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("make", [
    tuple_sample,
    lambda i: {"tokens": torch.arange(i % 5 + 1, dtype=torch.int16), "label": i, "weight": 0.5 * i},
    lambda i: [torch.ones(2, dtype=torch.uint8) * i, float(i)],
    lambda i: torch.full((3,), i, dtype=torch.complex64),
], ids=["tuple", "dict", "list", "tensor"])
def test_a_plugins_samples_of_every_kind_read_back_bit_identical(tmp_path, make):
    datasets = {"train": Samples([make(i) for i in range(40)]), "eval": Samples([make(i) for i in range(40, 47)])}
    storage = LocalStorage(tmp_path)
    shards.write_shards(storage, datasets, {"num_classes": 3, "collate_fn": print}, {"data.name": "acme"},
                        shard_mb=0.0005, say=lambda line: None)
    manifest = assert_round_trip(storage, datasets)
    assert manifest.info == {"num_classes": 3}, "JSON entries of info are kept, a collate_fn is not"


@pytest.mark.timeout(30)
def test_a_sample_unlike_the_first_is_one_line_naming_it(tmp_path):
    datasets = {"train": Samples([(torch.zeros(2), 1), (torch.zeros(2), "one")]), "eval": Samples([(torch.zeros(2), 1)])}
    with pytest.raises(ShardError, match="sample 1 of the train set of acme, field 1 is a str; "):
        shards.write_shards(LocalStorage(tmp_path), datasets, {}, {"data.name": "acme"}, say=lambda line: None)
    assert not (tmp_path / shards.MANIFEST).exists()


# ---------------------------------------------------------------- the manifest is the commit

FAILING_PLUGIN = '''
import torch


class Failing:
    def __len__(self):
        return 400

    def __getitem__(self, i):
        if i == 300:
            raise OSError("the network file system went away")
        return torch.full((64,), float(i)), i % 3


def build():
    return Failing(), Failing(), {"num_classes": 3}
'''


@pytest.mark.timeout(60)
def test_a_data_set_failing_mid_way_leaves_shards_but_no_manifest(ray_app, tmp_path):
    (tmp_path / "acme_failing_data.py").write_text(FAILING_PLUGIN)
    dest = tmp_path / "shards"
    rc, _, err = ray_app(["data", "write", dest, "--set", "data.name=acme_failing_data:build", "--shard-mb", "0.05"])
    assert rc == 1, err
    assert "the network file system went away" in err and "acme_failing_data.py" in err, "the user's frames, once"
    assert err.strip().splitlines()[-1] == \
        f"ray-app: data write failed in data.name acme_failing_data:build; no manifest was written at {dest}"
    assert list((dest / "train").glob("*.parquet")), "shards before the failure were uploaded"
    assert not (dest / shards.MANIFEST).exists()
    rc, _, err = ray_app(["data", "verify", dest])
    assert rc == 2 and "no manifest.json" in one_error_line(err)


@pytest.mark.timeout(60)
def test_write_refuses_an_existing_manifest_and_overwrite_replaces_only_the_manifest(ray_app, tmp_path):
    dest = tmp_path / "shards"
    assert ray_app(["data", "write", dest, *SYNTHETIC])[0] == 0
    before = {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    rc, out, err = ray_app(["data", "write", dest, *SYNTHETIC])
    line = one_error_line(err)
    assert rc == 2 and str(dest) in line and "--overwrite" in line, line
    assert {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()} == before, "nothing changed"
    rc, out, err = ray_app(["data", "write", dest, *SYNTHETIC, "--overwrite"])
    assert rc == 0, err
    assert all(p.read_bytes() == data for p, data in before.items() if p.name != shards.MANIFEST), \
        "the old shards are kept, unchanged, for readers of the old manifest"
    assert "2 files of earlier writes remain" in out
    assert ray_app(["data", "verify", dest])[0] == 0


# ---------------------------------------------------------------- verify and bad input

@pytest.mark.timeout(60)
def test_verify_names_the_shard_with_one_changed_byte_and_exits_2(ray_app, tmp_path):
    dest = tmp_path / "shards"
    assert ray_app(["data", "write", dest, "--shard-mb", "0.1"])[0] == 0
    rc, out, _ = ray_app(["data", "verify", dest])
    assert rc == 0 and re.search(r": 5 shards, 1797 samples, [0-9.]+ MB: verified$", out.strip()), out
    storage = LocalStorage(dest)
    manifest = shards.read_manifest(storage)
    victim = manifest.splits["train"][1]
    data = bytearray((dest / victim.path).read_bytes())
    data[len(data) // 2] ^= 0x01
    (dest / victim.path).write_bytes(bytes(data))
    rc, out, err = ray_app(["data", "verify", dest])
    assert rc == 2
    assert out.splitlines() == [f"BAD {victim.path}: sha256 mismatch (its bytes changed after the manifest was written)"]
    line = one_error_line(err)
    assert "1 of 5 shards failed verification" in line and victim.path in line, line
    with pytest.raises(ShardError, match="sha256 mismatch"):
        next(shards.iter_shard(storage, victim, manifest.encoding))  # never decoded


def rewrite_manifest(dest: Path, change) -> None:
    path = dest / shards.MANIFEST
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


BAD_MANIFESTS = {
    "no manifest": (lambda dest: (dest / shards.MANIFEST).unlink(), "no manifest.json"),
    "another format": (lambda dest: rewrite_manifest(dest, lambda m: m.update(format="ray_app.checkpoint/1")),
                       "not a ray_app shard manifest"),
    "another version": (lambda dest: rewrite_manifest(dest, lambda m: m.update(format="ray_app.shards/2")),
                        "another version of ray-app"),
    "no shards": (lambda dest: rewrite_manifest(dest, lambda m: m["splits"]["eval"].update(shards=[], samples=0)),
                  "split eval lists no shards"),
    "not JSON": (lambda dest: (dest / shards.MANIFEST).write_text("{"), "not JSON"),
    "counts": (lambda dest: rewrite_manifest(dest, lambda m: m["splits"]["train"].update(samples=7)),
               "split train says 7 samples"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(BAD_MANIFESTS))
def test_a_manifest_that_cannot_be_read_is_one_line_and_exit_2(ray_app, tmp_path, case):
    dest = tmp_path / "shards"
    assert ray_app(["data", "write", dest, *SYNTHETIC])[0] == 0
    damage, says = BAD_MANIFESTS[case]
    damage(dest)
    rc, out, err = ray_app(["data", "verify", dest])
    line = one_error_line(err)
    assert rc == 2 and out == ""
    assert line.startswith(f"ray-app: error: {dest}") and says in line and "ray-app data write" in line, line
    with pytest.raises(ShardError, match=says):
        shards.read_manifest(str(dest))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dest, says", [("gs://bucket/data", "not a folder or s3:// URI"),
                                        ("s3://bucket", "name a prefix under the bucket")])
def test_a_dest_that_is_no_folder_or_s3_prefix_is_one_line_and_exit_2(ray_app, dest, says):
    for args in (["data", "write", dest], ["data", "verify", dest]):
        rc, _, err = ray_app(args)
        assert rc == 2 and says in one_error_line(err)


# ---------------------------------------------------------------- on S3

@pytest.mark.timeout(60)
def test_shards_are_written_verified_and_read_back_on_s3(ray_app, s3):
    env = s3.env()
    dest = f"s3://{s3.bucket}/datasets/digits"
    rc, _, err = ray_app(["data", "write", dest, "--shard-mb", "0.1"], env=env)
    assert rc == 0, err
    keys = s3.snapshot("datasets/digits/")
    assert "datasets/digits/manifest.json" in keys and len(keys) == 6
    rc, out, err = ray_app(["data", "verify", dest], env=env)
    assert rc == 0 and out.strip().endswith("verified"), err
    train, evaluation, _ = digits()
    storage = open_storage(dest)
    manifest = shards.read_manifest(storage)
    rows = read_back(storage, manifest, "eval")
    assert all(same_sample(evaluation[i], sample) for i, sample in rows) and len(rows) == len(evaluation)

    victim = manifest.splits["train"][2]
    key = f"datasets/digits/{victim.path}"
    body = bytearray(s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    body[100] ^= 0xFF
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=bytes(body))
    rc, out, err = ray_app(["data", "verify", dest], env=env)
    assert rc == 2 and f"BAD {victim.path}: sha256 mismatch" in out and victim.path in one_error_line(err)
    rc, _, err = ray_app(["data", "write", dest], env=env)
    assert rc == 2 and f"DEST {dest} already holds a shard set" in one_error_line(err)
    assert secret_free(err, env)


def secret_free(text: str, env: dict) -> bool:
    return env["AWS_SECRET_ACCESS_KEY"] not in text and env["AWS_ACCESS_KEY_ID"] not in text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["unreachable", "refused credentials", "missing bucket"])
def test_storage_that_cannot_be_used_is_one_line_and_exit_2(ray_app, s3, case):
    from tests.support.ports import free_port

    env, dest = s3.env(), f"s3://{s3.bucket}/datasets/none"
    if case == "unreachable":
        env = s3.env(endpoint=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    elif case == "refused credentials":
        env = s3.env(creds=("AKIAWRONGWRONGWRONG0", "wrong-secret"))
    else:
        dest = "s3://no-such-bucket-here/datasets/none"
    for args in (["data", "verify", dest], ["data", "write", dest, *SYNTHETIC]):
        rc, out, err = ray_app(args, env=env)
        line = one_error_line(err)
        assert rc == 2 and out == "", err
        says = {"unreachable": "AWS_ENDPOINT_URL_S3", "refused credentials": "credentials",
                "missing bucket": "no-such-bucket-here does not exist"}[case]
        assert says in line and secret_free(err, env), line


@pytest.mark.timeout(60)
def test_a_read_only_user_verifies_but_a_write_is_one_line_and_exit_2(ray_app, s3):
    dest = f"s3://{s3.bucket}/datasets/read-only"
    assert ray_app(["data", "write", dest, *SYNTHETIC], env=s3.env())[0] == 0
    reader = s3.env(creds=s3.reader)
    assert ray_app(["data", "verify", dest], env=reader)[0] == 0
    rc, _, err = ray_app(["data", "write", f"{dest}-copy", *SYNTHETIC], env=reader)
    line = one_error_line(err)
    assert rc == 2 and "access denied" in line and "upload of train/shard-00000-" in line, line
    assert s3.snapshot("datasets/read-only-copy/") == {} and secret_free(err, reader)
