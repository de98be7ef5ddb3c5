"""Shards: a map-style data set packed into Parquet files under a manifest, to be read where the data lives.

Layout under DEST (``s3://bucket/prefix`` or a folder), written by ``ray-app data write DEST``::

    train/shard-00000-<write>.parquet ...   the train set's samples, in index order, cut at --shard-mb
    eval/shard-00000-<write>.parquet  ...   the eval set's
    manifest.json                           format, encoding, info, every shard's path, samples, bytes,
                                            sha256 (written last: without it there is no data set)

Why Parquet: an open columnar format every data tool reads (pyarrow, pandas, Spark, DuckDB, Polars); its row
groups let a reader fetch part of a file, and each column is compressed on its own (zstd here).

The encoding (``ENCODING``), one row per sample: ``index`` (int64, the sample's index in its split, which is
its index in the map-style data set), then one column group per field of the sample. A sample is a tensor
(field ``sample``), a tuple or list (fields ``0``, ``1``, ...) or a dict (its keys) of tensors, ints, floats
and bools. A tensor field ``f`` is three columns: ``f`` (binary: the tensor's bytes, C-contiguous, in the
machine's byte order: little-endian on x86-64 and ARM64), ``f.dtype`` (string: ``float32``,
``int64``, ``bfloat16``, ...) and ``f.shape`` (list of int64); an int is an int64 column, a float a float64
column, a bool a bool column. Decoding gives back the sample ``__getitem__`` gave, bit for bit.

Every shard's bytes are hashed as they are read (``iter_shard``, ``verify``) and a shard that does not match
its manifest entry is never decoded. Shard names carry the write's id, so a new write (``--overwrite``)
replaces only the manifest: readers of the old one keep reading consistent shards.

torch and pyarrow are imported inside functions, as in ``ray_app.shared.plugins``: the command line imports this
module for every ``data`` command, and reading or verifying a manifest needs neither.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ray_app.shared.errors import ShardError
from ray_app.shared.storage import LocalStorage, open_storage

MANIFEST = "manifest.json"
FORMAT = "ray_app.shards/1"
ENCODING = "ray_app.tensor-columns/1"
SPLITS = ("train", "eval")
KINDS = ("tensor", "int", "float", "bool")
ROW_GROUP_BYTES = 4 << 20  # sample bytes per Parquet row group: the unit a partial read fetches
DEFAULT_SHARD_MB = 64.0
_SHA256 = re.compile(r"[0-9a-f]{64}")


def open_dest(dest: str, retry_s: float = 0.0):
    """DEST -> the kit's storage for it (S3 with the AWS chain's credentials and endpoint, transient errors
    retried for ``retry_s`` as a worker's checkpoints are, or a folder); ShardError for a URI that is
    neither, or a bucket without a prefix."""
    if "://" in dest and not dest.startswith("s3://"):
        raise ShardError(f"DEST {dest}: not a folder or s3:// URI; use s3://bucket/prefix or a local folder")
    if dest.startswith("s3://") and "/" not in dest[len("s3://"):].strip("/"):
        raise ShardError(f"DEST {dest}: name a prefix under the bucket, e.g. {dest.rstrip('/')}/datasets/NAME")
    return open_storage(dest, retry_s=retry_s)


# ---------------------------------------------------------------- the encoding of a sample

@dataclass(frozen=True)
class SampleEncoding:
    """How a sample maps to columns: its structure (``tensor``, ``tuple``, ``list``, ``dict``) and its fields'
    names and kinds (``KINDS``), the same for every sample of both splits."""

    structure: str
    fields: tuple[tuple[str, str], ...]  # (name, kind)

    @classmethod
    def of(cls, sample, where: str) -> SampleEncoding:
        """The encoding of ``sample`` (the first of the train set); ShardError naming it if it has none."""
        import torch

        if isinstance(sample, torch.Tensor):
            return cls("tensor", (("sample", "tensor"),))
        if isinstance(sample, (tuple, list)) and not hasattr(sample, "_fields"):
            items = [(str(i), v) for i, v in enumerate(sample)]
        elif isinstance(sample, dict) and all(isinstance(k, str) and k != "index" and "." not in k for k in sample):
            items = list(sample.items())
        else:
            raise ShardError(f"{where} is {_type(sample)}; shards hold a tensor, or a tuple, list or dict (str keys "
                             "without '.', not 'index') of tensors, ints, floats and bools")
        if not items:
            raise ShardError(f"{where} is empty; a sample needs at least one field")
        structure = "dict" if isinstance(sample, dict) else "tuple" if isinstance(sample, tuple) else "list"
        return cls(structure, tuple((name, _kind_of(v, f"{where}, field {name}")) for name, v in items))

    def columns(self) -> list[str]:
        out = ["index"]
        for name, kind in self.fields:
            out += [name, f"{name}.dtype", f"{name}.shape"] if kind == "tensor" else [name]
        return out

    def schema(self):
        import pyarrow as pa

        types = {"int": pa.int64(), "float": pa.float64(), "bool": pa.bool_()}
        cols = [("index", pa.int64())]
        for name, kind in self.fields:
            if kind == "tensor":
                cols += [(name, pa.binary()), (f"{name}.dtype", pa.string()), (f"{name}.shape", pa.list_(pa.int64()))]
            else:
                cols.append((name, types[kind]))
        return pa.schema(cols)

    def _items(self, sample) -> dict | None:
        """The fields of ``sample`` by name, if it has this encoding's structure."""
        if self.structure == "tensor":
            return {"sample": sample}
        if self.structure == "dict":
            return sample if isinstance(sample, dict) else None
        if isinstance(sample, (tuple, list)) and ("tuple" if isinstance(sample, tuple) else "list") == self.structure:
            return {str(i): v for i, v in enumerate(sample)}
        return None

    def encode(self, sample, index: int, where: str, row: dict) -> int:
        """Append the columns of ``sample`` to ``row`` (column -> list); returns its bytes. ShardError naming
        the sample if its fields differ from the first sample's."""
        items = self._items(sample)
        if items is None or set(items) != {n for n, _ in self.fields}:
            raise ShardError(f"{where} is {_shape(sample)}, the first sample a {self.structure} {self.describe()}; "
                             "every sample of a shard set has the same fields")
        row["index"].append(index)
        size = 8
        for name, kind in self.fields:
            value = items[name]
            found = _kind_of(value, f"{where}, field {name}")
            if found != kind:
                raise ShardError(f"{where}, field {name} is a {found}, the first sample's a {kind}; "
                                 "a field has one kind in every sample")
            if kind == "tensor":
                data, dtype, shape = _tensor_bytes(value)
                row[name].append(data)
                row[f"{name}.dtype"].append(dtype)
                row[f"{name}.shape"].append(shape)
                size += len(data)
            else:
                row[name].append(value)
                size += 8
        return size

    def decode_table(self, table) -> Iterator[tuple[int, object]]:
        """(index, sample) of each row of a Parquet table in this encoding."""
        cols = {name: table.column(name).to_pylist() for name in self.columns()}
        for r, index in enumerate(cols["index"]):
            values = [_tensor(cols[n][r], cols[f"{n}.dtype"][r], cols[f"{n}.shape"][r]) if kind == "tensor"
                      else cols[n][r] for n, kind in self.fields]
            yield index, self._assemble(values)

    def _assemble(self, values: list):
        if self.structure == "tensor":
            return values[0]
        if self.structure == "dict":
            return dict(zip((n for n, _ in self.fields), values))
        return tuple(values) if self.structure == "tuple" else values

    def describe(self) -> str:
        return "(" + ", ".join(f"{n}: {k}" for n, k in self.fields) + ")"

    def to_json(self) -> dict:
        return {"name": ENCODING, "structure": self.structure,
                "fields": [{"name": n, "kind": k} for n, k in self.fields]}

    @classmethod
    def from_json(cls, data: dict) -> SampleEncoding:
        if data.get("name") != ENCODING:
            raise ValueError(f"encoding {data.get('name')!r}, not {ENCODING}")
        structure = data["structure"]
        fields = tuple((str(f["name"]), str(f["kind"])) for f in data["fields"])
        if structure not in ("tensor", "tuple", "list", "dict") or not fields or \
                any(k not in KINDS for _, k in fields):
            raise ValueError("encoding.structure or encoding.fields")
        return cls(structure, fields)


def _kind_of(value, where: str) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return "tensor"
    for kind, typ in (("bool", bool), ("int", int), ("float", float)):
        if isinstance(value, typ):
            return kind
    raise ShardError(f"{where} is {_type(value)}; a field is a tensor, an int, a float or a bool")


def _type(value) -> str:
    return f"a {type(value).__module__}.{type(value).__qualname__}".replace("a builtins.", "a ")


def _shape(sample) -> str:
    if isinstance(sample, dict):
        return "a dict (" + ", ".join(map(str, sample)) + ")"
    return f"a {type(sample).__name__} of {len(sample)} items" if isinstance(sample, (tuple, list)) else _type(sample)


def _tensor_bytes(t) -> tuple[bytes, str, list[int]]:
    """A tensor's bytes (C-contiguous), dtype name and shape: what decodes to an equal tensor, bit for bit."""
    import torch

    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes(), str(t.dtype).removeprefix("torch."), list(t.shape)


def _tensor(data: bytes, dtype: str, shape: list[int]):
    import torch

    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype):
        raise ShardError(f"a tensor of dtype {dtype!r}, which this torch does not know; write the shards again")
    if not data:  # torch.frombuffer refuses an empty buffer
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(bytearray(data), dtype=dt).reshape(shape)


# ---------------------------------------------------------------- the manifest

@dataclass(frozen=True)
class Shard:
    """One Parquet file of a split: ``path`` relative to DEST; ``first`` is the index of its first sample
    (the samples of the shards before it in the manifest), derived, not stored."""

    split: str
    path: str
    samples: int
    bytes: int
    sha256: str
    first: int

    def to_json(self) -> dict:
        return {"path": self.path, "samples": self.samples, "bytes": self.bytes, "sha256": self.sha256}


@dataclass(frozen=True)
class ShardManifest:
    """What ``manifest.json`` says: the encoding, the data set's info (``num_classes``, ...: what a model takes
    by name), and each split's shards in index order."""

    encoding: SampleEncoding
    splits: dict[str, tuple[Shard, ...]]
    info: dict
    source: dict
    created: float

    def samples(self, split: str) -> int:
        return sum(s.samples for s in self.splits[split])

    @property
    def shards(self) -> list[Shard]:
        return [s for split in SPLITS for s in self.splits[split]]

    @property
    def total_samples(self) -> int:
        return sum(self.samples(split) for split in SPLITS)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def to_json(self) -> dict:
        return {"format": FORMAT, "created": self.created, "encoding": self.encoding.to_json(), "info": self.info,
                "source": self.source, "samples": self.total_samples,
                "splits": {split: {"samples": self.samples(split), "bytes": sum(s.bytes for s in shards),
                                   "shards": [s.to_json() for s in shards]} for split, shards in self.splits.items()}}

    @classmethod
    def from_json(cls, data, where: str) -> ShardManifest:
        """Parse a manifest; ShardError (one line naming ``where`` and the fix) unless it is one of this format
        and version, with shards in both splits and counts that add up."""
        found = data.get("format") if isinstance(data, dict) else None
        if found != FORMAT:
            hint = "written by another version of ray-app" if str(found).startswith("ray_app.shards/") else \
                "not a ray_app shard manifest"
            raise ShardError(f"{where}: format {found!r}, not {FORMAT} ({hint}); write the data set again with "
                             "`ray-app data write DEST --overwrite`")
        try:
            encoding = SampleEncoding.from_json(data["encoding"])
            splits = {split: _shards_of(split, data["splits"][split]) for split in SPLITS}
            info, source, created = dict(data.get("info", {})), dict(data.get("source", {})), float(data["created"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ShardError(f"{where}: malformed manifest ({type(exc).__name__}: {exc}); see README "
                             "'Shards' for its fields, or write it again with `ray-app data write`") from None
        for split, shards in splits.items():
            if not shards:
                raise ShardError(f"{where}: split {split} lists no shards; a shard set needs samples in train "
                                 "and eval (write it again with `ray-app data write`)")
        manifest = cls(encoding, splits, info, source, created)
        for split in SPLITS:
            stated = data["splits"][split].get("samples", manifest.samples(split))
            if stated != manifest.samples(split):
                raise ShardError(f"{where}: split {split} says {stated} samples, its shards hold "
                                 f"{manifest.samples(split)}; fix splits.{split}.samples, or write the data set again "
                                 "with `ray-app data write`")
        return manifest


def _shards_of(split: str, data: dict) -> tuple[Shard, ...]:
    out, first = [], 0
    for i, entry in enumerate(data["shards"]):
        path, samples, size, sha = str(entry["path"]), int(entry["samples"]), int(entry["bytes"]), str(entry["sha256"])
        if samples < 1 or size < 1 or not _SHA256.fullmatch(sha) or path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"splits.{split}.shards[{i}]: needs a relative path, samples >= 1, bytes >= 1 and "
                             "a hex sha256")
        out.append(Shard(split, path, samples, size, sha, first))
        first += samples
    return tuple(out)


def read_manifest(storage_or_uri) -> ShardManifest:
    """The manifest at DEST (a URI or the kit's storage for it); ShardError if there is none or it is not
    one this version reads. Storage errors (unreachable, refused) propagate as the storage raises them."""
    storage = open_dest(storage_or_uri) if isinstance(storage_or_uri, str) else storage_or_uri
    return _read_manifest(storage, storage.list_files(""))


def _read_manifest(storage, present: dict[str, int]) -> ShardManifest:
    where = storage.uri(MANIFEST)
    if MANIFEST not in present:
        raise ShardError(f"{storage.uri()}: no {MANIFEST} (not a shard set, or its write did not finish); "
                         f"write one with `ray-app data write {storage.uri()}`")
    try:
        data = json.loads(storage.read_bytes(MANIFEST))
    except (ValueError, UnicodeDecodeError):
        raise ShardError(f"{where}: not JSON; write the data set again with `ray-app data write DEST --overwrite`") \
            from None
    return ShardManifest.from_json(data, where)


# ---------------------------------------------------------------- reading and verifying

class _Hashing:
    """What ``storage.read_into`` writes to: hashes and counts the bytes on their way into ``file`` (if
    any); a read the storage starts over (a retry) starts the hash over too."""

    def __init__(self, file=None):
        self.file = file
        self.truncate()

    def seek(self, pos: int) -> None:
        if self.file is not None:
            self.file.seek(pos)

    def truncate(self) -> None:
        self.sha, self.bytes = hashlib.sha256(), 0
        if self.file is not None:
            self.file.truncate()

    def write(self, data: bytes) -> None:
        self.sha.update(data)
        self.bytes += len(data)
        if self.file is not None:
            self.file.write(data)


def _check_read(storage, shard: Shard, sink: _Hashing) -> None:
    if sink.bytes != shard.bytes:
        raise ShardError(f"shard {storage.uri(shard.path)}: {sink.bytes} bytes, the manifest says {shard.bytes}; "
                         "write the data set again (`ray-app data write DEST --overwrite`)")
    if sink.sha.hexdigest() != shard.sha256:
        raise ShardError(f"shard {storage.uri(shard.path)}: sha256 mismatch (its bytes changed after the manifest "
                         "was written); write the data set again (`ray-app data write DEST --overwrite`)")


def iter_shard(storage, shard: Shard, encoding: SampleEncoding, tmp_dir: str | None = None) \
        -> Iterator[tuple[int, object]]:
    """(index, sample) of every row of ``shard``, in index order, each sample as the map-style data set's
    ``__getitem__`` gave it, bit for bit.

    The shard is copied into a temporary file (under ``tmp_dir``; deleted at the end) and hashed as it
    arrives; a shard that does not match its manifest entry raises ShardError before any sample is decoded.
    Then one Parquet row group at a time is decoded: memory holds a row group, the disk one shard."""
    import pyarrow.parquet as pq

    with tempfile.TemporaryFile(dir=tmp_dir) as f:
        sink = _Hashing(f)
        if not _present(storage, shard):
            raise ShardError(f"shard {storage.uri(shard.path)} is missing; write the data set again "
                             "(`ray-app data write DEST --overwrite`)")
        storage.read_into(shard.path, sink)
        _check_read(storage, shard, sink)
        f.seek(0)
        parquet = pq.ParquetFile(f)
        _check_layout(storage, shard, encoding, parquet)
        expected = shard.first
        for group in range(parquet.num_row_groups):
            for index, sample in encoding.decode_table(parquet.read_row_group(group, columns=encoding.columns())):
                if index != expected:
                    raise ShardError(f"shard {storage.uri(shard.path)}: row {expected - shard.first} has index {index}, "
                                     f"not {expected}; a split's rows hold indices 0, 1, ... in manifest order")
                expected += 1
                yield index, sample


def _present(storage, shard: Shard) -> bool:
    """Whether a local shard's file is there (reading a missing one is then a ShardError, not an OSError);
    on S3 a missing object is the storage's one-line error."""
    return not isinstance(storage, LocalStorage) or (storage.root / shard.path).is_file()


def _check_layout(storage, shard: Shard, encoding: SampleEncoding, parquet) -> None:
    missing = [c for c in encoding.columns() if c not in parquet.schema_arrow.names]
    if missing or parquet.metadata.num_rows != shard.samples:
        what = f"has no column {missing[0]}" if missing else \
            f"holds {parquet.metadata.num_rows} rows, the manifest says {shard.samples}"
        raise ShardError(f"shard {storage.uri(shard.path)} {what}; see README 'Shards' for the columns")


def verify(storage) -> tuple[ShardManifest, list[str]]:
    """(the manifest, one line per problem): every shard present at its size, its bytes streamed through
    sha256 (nothing kept). ShardError for a manifest that cannot be read; storage errors propagate."""
    present = storage.list_files("")
    manifest = _read_manifest(storage, present)
    problems = []
    for shard in manifest.shards:
        if shard.path not in present:
            problems.append(f"{shard.path}: missing")
        elif present[shard.path] != shard.bytes:
            problems.append(f"{shard.path}: {present[shard.path]} bytes, the manifest says {shard.bytes}")
        else:
            sink = _Hashing()
            storage.read_into(shard.path, sink)
            if sink.bytes != shard.bytes or sink.sha.hexdigest() != shard.sha256:
                problems.append(f"{shard.path}: sha256 mismatch (its bytes changed after the manifest was written)")
    return manifest, problems


# ---------------------------------------------------------------- writing

def check_dest(storage, overwrite: bool) -> dict[str, int]:
    """The files already at DEST; ShardError if it holds a manifest and ``overwrite`` is not set, or (a
    folder) cannot be written. Called before the data set is built, so a refusal costs nothing."""
    if isinstance(storage, LocalStorage):
        existing = next((p for p in [storage.root, *storage.root.parents] if p.exists()), None)
        if existing is not None and not existing.is_dir():
            raise ShardError(f"DEST {storage.root}: {existing} is a file, not a folder; choose a folder")
    present = storage.list_files("")
    if MANIFEST in present and not overwrite:
        raise ShardError(f"DEST {storage.uri()} already holds a shard set ({MANIFEST}); pass --overwrite to "
                         "replace its manifest (its shards stay until you delete them) or choose another DEST")
    return present


def write_shards(storage, datasets: dict, info: dict, source: dict, shard_mb: float = DEFAULT_SHARD_MB,
                 say=print) -> ShardManifest:
    """Pack ``datasets`` (``{"train": ..., "eval": ...}``, map-style) into shards of about ``shard_mb`` MB of
    sample bytes each, upload each as it is closed, then the manifest, last. A failure before the end
    (a data set raising, the store refusing) leaves shards of this write but no manifest for them.

    ``info``: the data set's info; its JSON entries are kept (``num_classes``, ...; not ``collate_fn``)."""
    name = source.get("data.name", "the data set")
    first = datasets["train"][0]
    encoding = SampleEncoding.of(first, f"sample 0 of the train set of {name}")
    write_id = uuid.uuid4().hex[:8]
    shard_bytes = max(1, int(shard_mb * 1e6))
    splits = {}
    with tempfile.TemporaryDirectory(prefix="ray-app-shards-") as tmp:
        for split in SPLITS:
            writer = _SplitWriter(storage, split, encoding, shard_bytes, write_id, Path(tmp), say)
            for index in range(len(datasets[split])):
                sample = first if split == "train" and index == 0 else datasets[split][index]
                writer.add(sample, index, f"sample {index} of the {split} set of {name}")
            splits[split] = writer.close()
        manifest = ShardManifest(encoding, splits, _json_entries(info), source, time.time())
        local = Path(tmp) / MANIFEST
        local.write_text(json.dumps(manifest.to_json(), indent=1))
        storage.upload_file(str(local), MANIFEST)
    return manifest


def _json_entries(info: dict) -> dict:
    out = {}
    for key, value in info.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        out[str(key)] = value
    return out


class _SplitWriter:
    """One split's shards: rows buffered into row groups of ``ROW_GROUP_BYTES``, a shard closed, hashed and
    uploaded once it holds ``shard_bytes`` of sample bytes. Memory holds one row group."""

    def __init__(self, storage, split: str, encoding: SampleEncoding, shard_bytes: int, write_id: str, tmp: Path, say):
        self.storage, self.split, self.encoding, self.shard_bytes = storage, split, encoding, shard_bytes
        self.write_id, self.tmp, self.say = write_id, tmp, say
        self.shards: list[Shard] = []
        self.samples = 0  # samples in the shards already closed
        self.writer, self.local = None, None
        self.in_shard, self.rows_in_shard = 0, 0  # sample bytes and rows of the open shard, its buffered rows too
        self._start_group()

    def _start_group(self) -> None:
        self.row = {c: [] for c in self.encoding.columns()}
        self.group_bytes = 0

    def add(self, sample, index: int, where: str) -> None:
        size = self.encoding.encode(sample, index, where, self.row)
        self.group_bytes += size
        self.in_shard += size
        self.rows_in_shard += 1
        if self.in_shard >= self.shard_bytes:
            self._close_shard()
        elif self.group_bytes >= ROW_GROUP_BYTES:
            self._flush_group()

    def _flush_group(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self.row["index"]:
            return
        if self.writer is None:
            self.local = self.tmp / f"{self.split}-{len(self.shards):05d}.parquet"
            dtypes = [f"{n}.dtype" for n, k in self.encoding.fields if k == "tensor"]
            self.writer = pq.ParquetWriter(self.local, self.encoding.schema(), compression="zstd",
                                           use_dictionary=dtypes, write_statistics=["index"])
        self.writer.write_table(pa.table(self.row, schema=self.encoding.schema()))
        self._start_group()

    def _close_shard(self) -> None:
        self._flush_group()
        if self.writer is None:
            return
        self.writer.close()
        rows = self.rows_in_shard
        rel = f"{self.split}/shard-{len(self.shards):05d}-{self.write_id}.parquet"
        sha, size = _sha256_file(self.local)
        self.storage.upload_file(str(self.local), rel)
        os.remove(self.local)
        self.shards.append(Shard(self.split, rel, rows, size, sha, self.samples))
        self.say(f"wrote {self.storage.uri(rel)}: {rows} samples, {size / 1e6:.2f} MB")
        self.samples += rows
        self.writer, self.local, self.in_shard, self.rows_in_shard = None, None, 0, 0

    def close(self) -> tuple[Shard, ...]:
        self._close_shard()
        return tuple(self.shards)


def _sha256_file(path: Path) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


# ---------------------------------------------------------------- streaming: data.name=shards

DEFAULT_PREFETCH = 2  # shards fetched ahead of the one being read: memory holds at most this + 1 decoded shards


def prefetch_problem(prefetch) -> str | None:
    """The one line for a ``data.args.prefetch`` that is not an int from 1 to 64, else None."""
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or not 1 <= prefetch <= 64:
        return f"config key data.args.prefetch: {prefetch!r}; the shards fetched ahead, an int from 1 to 64"
    return None


def shard_data(path: str, prefetch: int = DEFAULT_PREFETCH, storage_retry_s: float = 0.0):
    """``data.name: shards``: the shard set at ``data.path`` (a folder or ``s3://bucket/prefix``) as
    ``(train, eval, info)``, each split a :class:`ShardDataset` that streams its shards through the kit's
    storage (``storage_retry_s``: the kit passes ``failure.storage_retry_s``, as for checkpoints);
    ``info`` is the manifest's (``num_classes``, ...)."""
    problem = prefetch_problem(prefetch)
    if problem:
        raise ShardError(problem)
    storage = open_dest(path, retry_s=storage_retry_s)
    manifest = read_manifest(storage)
    return (ShardDataset(storage, manifest, "train", prefetch), ShardDataset(storage, manifest, "eval", prefetch),
            dict(manifest.info))


class ShardDataset:
    """One split of a shard set as a map-style data set (``__getitem__(index)``, ``len``) that a rank reads in
    the order its sampler plans (``plan``), shard after shard, never the whole set.

    The epoch's order (``epoch_order``) is a pure function of (seed, epoch, world size W at the epoch's start,
    the manifest): the shards in a seeded permutation, each shard's samples in a seeded permutation of their
    own, concatenated; that sequence padded to a multiple of W by repeating it from its start (as
    DistributedSampler pads) and cut into W contiguous blocks of equal length; position k*W + r of the order is
    block r's k-th sample. Rank r of W reads every W-th position from r, so its stream is block r: about 1/W of
    the shards' bytes (plus the shards its block shares with its neighbours, and the padding's).

    Reading: a background thread fetches the shards of the plan in the order they are first needed, each one
    copied into a temporary file as it is hashed (``iter_shard``), decoded, and its file deleted; a shard is
    dropped from memory right after its last sample in the plan was read. Memory holds at most ``prefetch + 1``
    decoded shards (the one being read and those fetched ahead), the disk one shard (the one arriving). Only in
    the rest of an epoch resumed at another world size does a rank read from the W blocks of the epoch's start
    at once: then the shards it reads from at the same time are kept too (about W). A read outside the plan
    (none in training) loads its shard in the calling thread and keeps that one shard besides.

    A shard that does not match its manifest entry raises ``ShardError`` naming it when its first sample is
    read (found by the fetch thread, raised in the reader); storage errors are raised there as the storage
    raises them."""

    def __init__(self, storage, manifest: ShardManifest, split: str, prefetch: int = DEFAULT_PREFETCH,
                 tmp_dir: str | None = None):
        self.storage, self.encoding, self.split, self.tmp_dir = storage, manifest.encoding, split, tmp_dir
        self.shards = manifest.splits[split]
        self.firsts = [s.first for s in self.shards]
        self.samples = manifest.samples(split)
        self.prefetch = prefetch
        self.capacity = prefetch + 1  # decoded shards in memory, the one arriving counted
        self.peak_cached = 0  # the most shards held at once (the fetch thread's one arriving counted)
        self._reset_process_state()

    def _reset_process_state(self) -> None:
        import threading

        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._cache: dict[int, list] = {}  # shard number -> its samples, in index order
        self._arriving = 0  # shards being fetched (0 or 1)
        self._errors: dict[int, BaseException] = {}
        self._loose: tuple[int, list] | None = None  # the shard of a read outside the plan
        self._thread = None
        self._set_plan([])

    def __len__(self) -> int:
        return self.samples

    def __getstate__(self) -> dict:  # a DataLoader worker process gets the data set without its thread
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset_process_state()

    def shard_of(self, index: int) -> int:
        import bisect

        return bisect.bisect_right(self.firsts, index) - 1

    # ------------------------------------------------------------ the order
    def epoch_order(self, seed: int, epoch: int, world_size: int) -> list[int]:
        """The epoch's global order (length: the samples padded to a multiple of ``world_size``); see the
        class docstring. Pure: the same arguments and manifest give the same list on every rank and host."""
        import numpy as np
        import torch

        g = torch.Generator().manual_seed(seed + epoch)
        shard_order = torch.randperm(len(self.shards), generator=g).tolist()
        # each shard's own order, drawn in manifest order from the same generator (one stream, no seed arithmetic)
        inner = [torch.randperm(s.samples, generator=g).numpy() + s.first for s in self.shards]
        seq = np.concatenate([inner[i] for i in shard_order])
        block = -(-self.samples // world_size)
        padded = np.resize(seq, block * world_size)  # repeats seq from its start: DistributedSampler's padding
        return padded.reshape(world_size, block).T.reshape(-1).tolist()

    # ------------------------------------------------------------ the plan and the cache
    def plan(self, indices) -> None:
        """The indices this process reads next, in order (its sampler's whole pass). Fetching starts at the
        first read; shards of the old plan that the new one does not need are dropped."""
        if os.getpid() != self._pid:  # a forked process: the parent's lock and thread are not ours
            self._reset_process_state()
        with self._cond:
            self._set_plan(list(indices))
            for s in [s for s in self._cache if s not in self._last_use]:
                del self._cache[s]
            self._errors.clear()
            self._cond.notify_all()

    def _set_plan(self, indices: list[int]) -> None:
        import numpy as np

        self._plan = indices
        shards = np.searchsorted(np.asarray(self.firsts), np.asarray(indices, dtype=np.int64), side="right") - 1
        self._plan_shards = shards.tolist()
        self._last_use = {s: p for p, s in enumerate(self._plan_shards)}
        first_use: dict[int, int] = {}
        for p, s in enumerate(self._plan_shards):
            first_use.setdefault(s, p)
        self._first_use = first_use
        self._fetch_order = list(first_use)  # in the order first needed
        self._pos = 0  # plan positions read
        self._reading = False  # fetching starts at the first read of the plan
        self._generation = getattr(self, "_generation", 0) + 1

    def cached_shards(self) -> list[int]:
        with self._cond:
            return sorted(self._cache)

    def __getitem__(self, index: int):
        if os.getpid() != self._pid:
            self._reset_process_state()
        s = self.shard_of(index)
        if not 0 <= index < self.samples:
            raise IndexError(f"index {index} out of range for the {self.split} shards ({self.samples} samples)")
        with self._cond:
            if self._pos < len(self._plan) and self._plan[self._pos] == index:
                return self._planned(s, index)
        return self._unplanned(s, index)

    def _planned(self, s: int, index: int):
        """Under the lock: the plan's next sample, waiting for its shard; the shard dropped after its last."""
        pos = self._pos
        self._pos += 1
        if not self._reading:
            self._reading = True
            self._start_thread()
        if s not in self._cache:  # needed now: the fetch thread may be waiting for room (no wake-up per sample)
            self._cond.notify_all()
        while s not in self._cache:
            if s in self._errors:
                raise self._errors[s]
            self._cond.wait()
        sample = self._cache[s][index - self.shards[s].first]
        if self._last_use[s] == pos:
            del self._cache[s]
            self._cond.notify_all()  # room for the next fetch
        return sample

    def _unplanned(self, s: int, index: int):
        if self._loose is None or self._loose[0] != s:
            self._loose = None
            self._loose = (s, self._load(s))
        return self._loose[1][index - self.shards[s].first]

    def _start_thread(self) -> None:
        import threading

        if self._thread is None:
            self._thread = threading.Thread(target=self._fetch_loop, name=f"shards-{self.split}-prefetch", daemon=True)
            self._thread.start()

    def _next_fetch(self) -> int | None:
        """Under the lock: the next shard to fetch: the first of the plan not yet held, needed later than now;
        one needed now is fetched whatever the cache holds, one ahead only if there is room."""
        if not self._reading:
            return None
        for s in self._fetch_order:
            if s in self._cache or s in self._errors or self._last_use[s] < self._pos:
                continue
            if self._first_use[s] <= self._pos or len(self._cache) + 1 <= self.capacity:
                return s
            return None
        return None

    def _fetch_loop(self) -> None:
        while True:
            with self._cond:
                s = self._next_fetch()
                while s is None:
                    self._cond.wait()
                    s = self._next_fetch()
                generation = self._generation
                self._arriving = 1
                self.peak_cached = max(self.peak_cached, len(self._cache) + 1)
            try:
                samples, error = self._load(s), None
            except BaseException as exc:  # handed to the reader of this shard's samples
                samples, error = None, exc
            with self._cond:
                self._arriving = 0
                if generation == self._generation:
                    if error is not None:
                        self._errors[s] = error
                    else:
                        self._cache[s] = samples
                self._cond.notify_all()

    def _load(self, s: int) -> list:
        shard = self.shards[s]
        return [sample for _, sample in iter_shard(self.storage, shard, self.encoding, self.tmp_dir)]
