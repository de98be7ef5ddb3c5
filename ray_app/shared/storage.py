"""Where runs live: a local folder or ``s3://bucket/prefix``.

One place resolves the S3 settings (credentials only from the standard AWS
chain, endpoint from ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``) and builds
from them the boto3 client the kit uses (the pyarrow filesystem Ray Train uses is
``ray_app.shared.s3fs``'s, from the same settings; retries are ``ray_app.shared.retry``'s). Secrets are never logged: messages name the bucket and endpoint.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from ray_app.shared.errors import StorageError, StorageUnavailable
from ray_app.shared.retry import BUDGET_KEY, Retrying, call_timeouts, sdk_attempts

READ_CHUNK = 1 << 20  # bytes a streamed read (``read_into``) holds at a time


@dataclass(frozen=True)
class S3Settings:
    bucket: str
    prefix: str
    endpoint: str | None  # None = AWS default endpoint
    region: str

    @classmethod
    def resolve(cls, uri: str) -> "S3Settings":
        parsed = urlparse(uri)
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        return cls(parsed.netloc, parsed.path.strip("/"), endpoint, region)

    @property
    def where(self) -> str:
        return f"s3://{self.bucket}" + (f" at {self.endpoint}" if self.endpoint else "")


def _join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


class LocalStorage:
    """Runs under a local folder."""

    def __init__(self, root: str):
        self.root = Path(root).expanduser().resolve()

    def uri(self, *parts: str) -> str:
        return str(self.root.joinpath(*[p for p in parts if p]))

    def _p(self, rel: str) -> Path:
        return self.root / rel

    def list_dirs(self, rel: str) -> list[str]:
        p = self._p(rel)
        return sorted(c.name for c in p.iterdir() if c.is_dir()) if p.is_dir() else []

    def list_files(self, rel: str) -> dict[str, int]:
        base = self._p(rel)
        if not base.is_dir():
            return {}
        return {str(f.relative_to(base)): f.stat().st_size for f in sorted(base.rglob("*")) if f.is_file()}

    def read_bytes(self, rel: str) -> bytes:
        return self._p(rel).read_bytes()

    def read_range(self, rel: str, start: int, length: int) -> bytes:
        """``length`` bytes of a file from byte ``start``."""
        with open(self._p(rel), "rb") as f:
            f.seek(start)
            return f.read(length)

    def read_range_into(self, rel: str, start: int, out) -> int:
        """Bytes of a file from byte ``start`` straight into the writable buffer ``out`` (no copy between),
        until it is full or the file ends; returns how many."""
        view = memoryview(out).cast("B")
        done = 0
        with open(self._p(rel), "rb") as f:
            f.seek(start)
            while done < len(view) and (n := f.readinto(view[done:])):
                done += n
        return done

    def read_into(self, rel: str, out) -> None:
        """Copy a file into the binary file ``out`` (from its start), a chunk at a time: memory stays bounded."""
        out.seek(0)
        out.truncate()
        with open(self._p(rel), "rb") as f:
            shutil.copyfileobj(f, out, READ_CHUNK)

    def upload_file(self, local: str, rel: str) -> None:
        dst = self._p(rel)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            shutil.copyfile(local, tmp)
            os.replace(tmp, dst)
        except OSError as exc:
            tmp.unlink(missing_ok=True)  # no partial file left behind
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):  # the same on every retry
                raise StorageError(f"run.storage {self.root}: {exc.strerror} writing {rel}; free space there (or "
                                   "fix its permissions), or point run.storage elsewhere; the same run then "
                                   "resumes from its newest committed checkpoint") from None
            raise

    def write_bytes(self, rel: str, data: bytes) -> None:
        """A small object, written whole (a file of its own renamed into place: no reader sees it half-written)."""
        dst = self._p(rel)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, dst)
        finally:
            tmp.unlink(missing_ok=True)

    def delete_tree(self, rel: str) -> None:
        """Remove a folder and everything under it (an uncommitted checkpoint's: ``ray_app.shared.catalog``)."""
        shutil.rmtree(self._p(rel), ignore_errors=True)

    def ray_storage(self):
        """(storage_path, storage_filesystem) for Ray Train's RunConfig."""
        return str(self.root), None

    def ray_checkpoint_location(self, rel: str):
        return str(self._p(rel)), None


def explain_s3_error(exc: BaseException, settings: S3Settings) -> str | None:
    """What an error of boto3 means for the user and what would fix it, in one line naming the store
    (never credentials); None if it is no S3 error."""
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        ConnectionError,
        EndpointConnectionError,
        NoCredentialsError,
        PartialCredentialsError,
    )

    if isinstance(exc, S3UploadFailedError) and isinstance(exc.__context__, Exception):
        exc = exc.__context__  # upload_file's wrapper of the transfer's ClientError (a refused PutObject)
    where = settings.endpoint or "AWS"
    if isinstance(exc, (EndpointConnectionError, ConnectionError)):
        return f"cannot reach the S3 endpoint {where}; check AWS_ENDPOINT_URL_S3 and that the store is running"
    if isinstance(exc, PartialCredentialsError):  # botocore names the variable that is missing, never a value
        return (f"the AWS credentials are incomplete ({exc}); set both AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or neither (AWS_PROFILE, a role)")
    if isinstance(exc, NoCredentialsError):
        return ("no AWS credentials found; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE "
                "or a role for this machine")
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("NoSuchBucket",):
            return f"bucket {settings.bucket} does not exist at {where}; create it or fix the URI"
        if code in ("403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "Forbidden",
                    "ExpiredToken", "InvalidToken") or status == 403:
            return f"access denied at {where} ({code or 403}); check the AWS credentials and the bucket policy"
        return f"{code or type(exc).__name__} at {where}; check the endpoint, the bucket and the credentials"
    if isinstance(exc, BotoCoreError):
        return f"{type(exc).__name__} at {where}; check AWS_ENDPOINT_URL_S3, the network and the credentials"
    return None


class S3Storage:
    """Runs under ``s3://bucket/prefix``, reached with boto3 (and pyarrow for Ray)."""

    def __init__(self, uri: str, retry_s: float = 0.0, then: str | None = None, budget: str = BUDGET_KEY):
        self.settings = S3Settings.resolve(uri)
        self._client = None
        self.retry_s = max(retry_s, 0.0)
        # 0: fail at once, an S3 error as a StorageError of one line; everything else retries transient errors
        # for failure.storage_retry_s (``budget``: how the lines name a smaller budget derived from it)
        self._retrying = Retrying(retry_s, self.settings.where, budget=budget, **({"then": then} if then else {})) \
            if retry_s > 0 else None

    def retry_raw(self, what: str, fn, *args, **kwargs):
        """``fn`` within the retry budget, its errors as boto3 raised them (the lease reads their codes)."""
        return (self._retrying or _once)(what, fn, *args, **kwargs)

    def _retry(self, what: str, fn, *args, **kwargs):
        """``fn`` within the retry budget (none: at once); an S3 error that will not change (access denied,
        a missing bucket) or one left after the budget as a StorageError of one line naming the store."""
        try:
            return self.retry_raw(what, fn, *args, **kwargs)
        except StorageUnavailable:
            raise
        except Exception as exc:
            error = self.as_storage_error(exc, what)
            if error is None:
                raise
            raise error from None

    def as_storage_error(self, exc: BaseException, what: str) -> StorageError | None:
        """An S3 error as one line naming the store and the fix (never credentials); None if it is none."""
        explained = explain_s3_error(exc, self.settings)
        if explained is None:
            return None
        return StorageError(f"storage s3://{_join(self.settings.bucket, self.settings.prefix)}: {explained} ({what})")

    @property
    def client(self):
        if self._client is None:
            import boto3
            from botocore.config import Config as BotoConfig
            from botocore.exceptions import BotoCoreError

            # each request bounded by the budget; botocore retries only without one (Retrying's loop does)
            connect, read = call_timeouts(self.retry_s)
            cfg = BotoConfig(connect_timeout=connect, read_timeout=read,
                             retries={"total_max_attempts": sdk_attempts(self.retry_s), "mode": "standard"})
            try:
                self._client = boto3.session.Session().client(
                    "s3", endpoint_url=self.settings.endpoint, region_name=self.settings.region, config=cfg
                )
            except BotoCoreError as exc:  # e.g. AWS_ACCESS_KEY_ID set and AWS_SECRET_ACCESS_KEY empty
                raise self.as_storage_error(exc, "reading the AWS credentials") from None
        return self._client

    def _key(self, rel: str) -> str:
        return _join(self.settings.prefix, rel)

    def uri(self, *parts: str) -> str:
        return "s3://" + _join(self.settings.bucket, self.settings.prefix, *parts)

    def list_dirs(self, rel: str) -> list[str]:
        return self._retry(f"listing {rel}/", self._list_dirs, rel)

    def _list_dirs(self, rel: str) -> list[str]:
        prefix = self._key(rel) + "/"
        out = set()
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.settings.bucket, Prefix=prefix, Delimiter="/"
        ):
            for cp in page.get("CommonPrefixes", []):
                out.add(cp["Prefix"][len(prefix):].strip("/"))
        return sorted(out)

    def list_files(self, rel: str) -> dict[str, int]:
        return self._retry(f"listing {rel}/", self._list_files, rel)

    def _list_files(self, rel: str) -> dict[str, int]:
        prefix = self._key(rel) + "/"
        out = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.settings.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                out[obj["Key"][len(prefix):]] = obj["Size"]
        return dict(sorted(out.items()))

    def read_bytes(self, rel: str) -> bytes:
        return self._retry(f"reading {rel}", lambda: self.client.get_object(
            Bucket=self.settings.bucket, Key=self._key(rel))["Body"].read())

    def read_range(self, rel: str, start: int, length: int) -> bytes:
        """``length`` bytes of an object from byte ``start`` (one ranged GET)."""
        if length <= 0:
            return b""
        return self._retry(f"reading {rel}", lambda: self.client.get_object(
            Bucket=self.settings.bucket, Key=self._key(rel), Range=f"bytes={start}-{start + length - 1}")["Body"].read())

    def read_range_into(self, rel: str, start: int, out) -> int:
        """Bytes of an object from byte ``start`` into the writable buffer ``out`` (one ranged GET of its size,
        streamed in a chunk at a time), until it is full or the object ends; returns how many. A transient error
        reads the range again, within the retry budget."""
        view = memoryview(out).cast("B")
        return self._retry(f"reading {rel}", self._read_range_into, rel, start, view) if len(view) else 0

    def _read_range_into(self, rel: str, start: int, view: memoryview) -> int:
        body = self.client.get_object(Bucket=self.settings.bucket, Key=self._key(rel),
                                      Range=f"bytes={start}-{start + len(view) - 1}")["Body"]
        done = 0
        for chunk in body.iter_chunks(READ_CHUNK):
            chunk = chunk[:len(view) - done]
            view[done:done + len(chunk)] = chunk
            done += len(chunk)
        return done

    def read_into(self, rel: str, out) -> None:
        """Copy an object into the binary file ``out`` a chunk at a time (memory stays bounded); a transient
        error starts the copy over, ``out`` from its start again, within the retry budget."""
        self._retry(f"reading {rel}", self._read_into, rel, out)

    def _read_into(self, rel: str, out) -> None:
        out.seek(0)
        out.truncate()
        body = self.client.get_object(Bucket=self.settings.bucket, Key=self._key(rel))["Body"]
        for chunk in body.iter_chunks(READ_CHUNK):
            out.write(chunk)

    def upload_file(self, local: str, rel: str) -> None:
        # one object per call: a retry re-sends the whole file (a multipart upload restarts cleanly)
        self._retry(f"upload of {rel}", self.client.upload_file, local, self.settings.bucket, self._key(rel))

    def write_bytes(self, rel: str, data: bytes) -> None:
        """A small object, written whole (one PUT)."""
        self._retry(f"writing {rel}", lambda: self.client.put_object(
            Bucket=self.settings.bucket, Key=self._key(rel), Body=data))

    def delete_tree(self, rel: str) -> None:
        """Remove every object under ``rel/`` (an uncommitted checkpoint's: ``ray_app.shared.catalog``)."""
        def delete() -> None:
            keys = [self._key(f"{rel}/{name}") for name in self._list_files(rel)]
            for i in range(0, len(keys), 1000):
                self.client.delete_objects(Bucket=self.settings.bucket,
                                           Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})

        self._retry(f"deleting {rel}/", delete)

    def pyarrow_fs(self):
        """The filesystem Ray Train writes its own files with (``ray_app.shared.s3fs.pyarrow_s3``)."""
        from ray_app.shared.s3fs import pyarrow_s3

        return pyarrow_s3(self.settings.endpoint, self.settings.region, self.retry_s)

    def ray_storage(self):
        return _join(self.settings.bucket, self.settings.prefix), self.pyarrow_fs()

    def ray_checkpoint_location(self, rel: str):
        return _join(self.settings.bucket, self.settings.prefix, rel), self.pyarrow_fs()


def _once(what: str, fn, *args, **kwargs):
    return fn(*args, **kwargs)


def open_storage(uri: str, retry_s: float = 0.0, then: str | None = None, budget: str = BUDGET_KEY):
    """``run.storage`` -> LocalStorage or S3Storage (which retries transient errors for ``retry_s``; ``then``:
    what its line says follows once the budget is spent, a worker group's restart by default; ``budget``: how
    its lines name ``retry_s``, the config key unless a smaller budget derives from it)."""
    return S3Storage(uri, retry_s, then, budget) if uri.startswith("s3://") else LocalStorage(uri)


def preflight(storage) -> None:
    """StorageError (one line) unless runs can be written where configured: at once for an answer that will
    not change (a missing bucket, access denied); an unreachable S3 store is waited out within the
    storage's retry budget (a resume's store may be in a short outage), then StorageUnavailable."""
    if isinstance(storage, LocalStorage):
        _preflight_local(storage)
    else:
        _preflight_s3(storage)


def _preflight_local(storage: LocalStorage) -> None:
    root = storage.root
    existing = next((p for p in [root, *root.parents] if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise StorageError(f"run.storage {root}: {existing} is a file, not a folder; point run.storage at a folder")
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".ray-app-probe-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"probe")
        probe.unlink()
    except OSError as exc:
        raise StorageError(f"run.storage {root}: cannot write there ({exc.strerror}); "
                           "choose a writable folder or fix its permissions") from None


def _preflight_s3(storage: S3Storage) -> None:
    from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError, NoCredentialsError

    s = storage.settings
    c = storage.client
    try:
        storage.retry_raw("checking the bucket", c.head_bucket, Bucket=s.bucket)
    except EndpointConnectionError:
        raise StorageError(f"run.storage s3://{s.bucket}: cannot reach the S3 endpoint {s.endpoint or 'of AWS'}; "
                           "check AWS_ENDPOINT_URL_S3 and that the store is running") from None
    except NoCredentialsError:
        raise StorageError(f"run.storage s3://{s.bucket}: no AWS credentials found; set AWS_ACCESS_KEY_ID/"
                           "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or a role for this machine") from None
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("404", "NoSuchBucket", "NotFound"):
            raise StorageError(f"run.storage s3://{s.bucket}: bucket does not exist at {s.endpoint or 'AWS'}; "
                               f"create it (aws s3 mb s3://{s.bucket}) or fix run.storage") from None
        if code in ("403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "Forbidden") or status == 403:
            raise StorageError(f"run.storage s3://{s.bucket}: access denied at {s.endpoint or 'AWS'} ({code}); "
                               "check the AWS credentials and the bucket policy") from None
        raise StorageError(f"run.storage {s.where}: {code or exc}; check the endpoint, bucket and credentials") from None
    except BotoCoreError as exc:
        raise StorageError(f"run.storage {s.where}: {type(exc).__name__}; check AWS_ENDPOINT_URL_S3, "
                           "the network and credentials") from None
    _probe_s3_write(storage)


def _probe_s3_write(storage: S3Storage) -> None:
    from botocore.exceptions import BotoCoreError, ClientError

    s = storage.settings
    key = _join(s.prefix, f".ray-app-probe-{uuid.uuid4().hex[:8]}")
    try:
        storage.retry_raw("writing a probe", storage.client.put_object, Bucket=s.bucket, Key=key, Body=b"probe")
    except (ClientError, BotoCoreError) as exc:
        code = getattr(exc, "response", {}).get("Error", {}).get("Code", type(exc).__name__)
        raise StorageError(f"run.storage s3://{s.bucket}/{s.prefix}: cannot write under the prefix ({code}); "
                           "grant s3:PutObject/s3:DeleteObject on it or choose another prefix") from None
    try:
        storage.retry_raw("deleting the probe", storage.client.delete_object, Bucket=s.bucket, Key=key)
    except (ClientError, BotoCoreError) as exc:
        code = getattr(exc, "response", {}).get("Error", {}).get("Code", type(exc).__name__)
        raise StorageError(f"run.storage s3://{s.bucket}/{s.prefix}: can write but not delete ({code}); "
                           "grant s3:DeleteObject so old checkpoints can be pruned") from None
