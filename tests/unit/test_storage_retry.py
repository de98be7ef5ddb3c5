"""Retries of the object store: which errors are transient, and the budget (a fake clock: no sleeping)."""

from __future__ import annotations

import pytest
from boto3.exceptions import S3UploadFailedError
from botocore.exceptions import ClientError, ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError

from ray_app.shared.errors import StorageUnavailable
from ray_app.shared.retry import Retrying, transient


def client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "x"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "PutObject")


def wrapped(inner: Exception) -> S3UploadFailedError:
    """What boto3's upload_file raises: S3UploadFailedError from the transfer's error."""
    try:
        try:
            raise inner
        except Exception as exc:
            raise S3UploadFailedError("Failed to upload x to b/k: ...") from exc
    except S3UploadFailedError as outer:
        return outer


@pytest.mark.parametrize("exc", [
    EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
    ConnectTimeoutError(endpoint_url="http://127.0.0.1:1"),
    ReadTimeoutError(endpoint_url="http://127.0.0.1:1"),
    client_error("SlowDown", 503), client_error("InternalError", 500), client_error("Weird", 502),
    wrapped(EndpointConnectionError(endpoint_url="http://127.0.0.1:1")), wrapped(client_error("SlowDown", 503)),
    ConnectionResetError(),
])
def test_outages_and_throttling_are_transient(exc):
    assert transient(exc)


@pytest.mark.parametrize("exc", [
    client_error("AccessDenied", 403), client_error("NoSuchBucket", 404), client_error("InvalidAccessKeyId", 403),
    wrapped(client_error("AccessDenied", 403)), FileNotFoundError("model.pt"), ValueError("x"),
])
def test_what_a_retry_cannot_fix_is_not(exc):
    assert not transient(exc)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s


def flaky(failures: int, exc: Exception):
    calls = []

    def op(x):
        calls.append(x)
        if len(calls) <= failures:
            raise exc
        return f"ok {x}"
    return op, calls


def test_a_short_outage_is_waited_out_with_backoff_and_two_lines():
    clock, said = Clock(), []
    retry = Retrying(30, "s3://b at http://proxy", say=said.append, sleep=clock.sleep, clock=clock)
    op, calls = flaky(4, EndpointConnectionError(endpoint_url="http://proxy"))
    assert retry("upload of run/ckpt/model.pt", op, 7) == "ok 7"
    assert len(calls) == 5 and 0.8 * (0.5 + 1 + 2 + 4) <= clock.now <= 1.2 * (0.5 + 1 + 2 + 4)
    assert len(said) == 2 and "unreachable (EndpointConnectionError) during upload of run/ckpt/model.pt" in said[0]
    assert "retrying for up to 30 s" in said[0] and "answers again after" in said[1]


def test_an_outage_longer_than_the_budget_gives_up_near_it():
    clock, said = Clock(), []
    retry = Retrying(20, "s3://b", say=said.append, sleep=clock.sleep, clock=clock)
    op, calls = flaky(10 ** 6, EndpointConnectionError(endpoint_url="http://proxy"))
    with pytest.raises(StorageUnavailable, match="no answer for .* during listing run/") as info:
        retry("listing run/", op, 1)
    assert clock.now <= 20 and clock.now >= 20 - 8 * 1.2  # stops before the next sleep would pass the budget
    assert isinstance(info.value.__cause__, EndpointConnectionError) and len(said) == 1


def test_a_permanent_error_is_raised_at_once():
    clock = Clock()
    retry = Retrying(60, "s3://b", say=lambda m: None, sleep=clock.sleep, clock=clock)
    op, calls = flaky(1, client_error("AccessDenied", 403))
    with pytest.raises(ClientError):
        retry("upload", op, 1)
    assert len(calls) == 1 and clock.now == 0


def test_the_filesystem_ray_train_gets_keeps_its_retry_budget_through_pickling():
    import pickle

    import pyarrow.fs

    from ray_app.shared.retry import sdk_attempts_for
    from ray_app.shared.storage import S3Storage

    assert sdk_attempts_for(5) == 9 and sdk_attempts_for(120) == 14  # 25 ms x (2^8 - 1) = 6.4 s >= 5 s, ...
    fs = S3Storage("s3://bucket/prefix", retry_s=120).pyarrow_fs()
    again = pickle.loads(pickle.dumps(fs))  # what Ray Train's controller and workers get
    assert isinstance(again, pyarrow.fs.PyFileSystem) and again.type_name == "py::s3"
    assert again.handler.attempts == 14 and again.equals(fs)
    assert isinstance(S3Storage("s3://bucket/prefix").pyarrow_fs(), pyarrow.fs.S3FileSystem)  # no budget: plain
