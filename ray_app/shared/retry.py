"""What counts as transient, and the retry budget: the one home of storage retries.

``transient`` tells an unreachable store (connection refused or reset, timeouts, throttling, 5xx) from
an answer that will not change (a missing bucket, access denied). ``Retrying`` waits a transient error
out for ``failure.storage_retry_s`` seconds from its first failure, then raises ``StorageUnavailable``;
``sdk_attempts_for`` is the same budget spelled as the AWS SDK's attempt count, for the pyarrow
filesystem Ray Train writes with (``ray_app.shared.s3fs``). Both the kit's own S3 calls (``ray_app.shared.storage``)
and that filesystem use these, so imports run one way: storage -> s3fs -> retry.
"""

from __future__ import annotations

import random
import re
import sys
import time

from ray_app.shared.errors import StorageUnavailable

# S3 error codes that say "try again" (throttling, a server-side blip); 5xx statuses count too
_TRANSIENT_CODES = {"SlowDown", "RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable",
                    "Throttling", "ThrottlingException", "503", "500", "502", "504"}


# pyarrow's S3 errors are OSErrors whose text names the AWS error; these say the store is unreachable
_PYARROW_TRANSIENT = re.compile(r"NETWORK_CONNECTION|curlCode|Could not connect|timed out|SLOW_DOWN|SlowDown|"
                                r"SERVICE_UNAVAILABLE|ServiceUnavailable|INTERNAL_FAILURE|InternalError|Throttl")


def transient(exc: BaseException) -> bool:
    """True for an error of the store or the network that a later attempt may not see (connection
    refused or reset, timeouts, throttling, 5xx), looking through boto3's wrappers (S3UploadFailedError);
    pyarrow's S3 errors by their text."""
    from botocore.exceptions import ClientError, ConnectionError, HTTPClientError, IncompleteReadError

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (ConnectionError, HTTPClientError, IncompleteReadError, TimeoutError,
                            ConnectionRefusedError, ConnectionResetError)):
            return True
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            return str(err.get("Code", "")) in _TRANSIENT_CODES or int(status) >= 500
        if type(exc) is OSError and _PYARROW_TRANSIENT.search(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


_WAITED_OUT: list = []  # called with (where, what, seconds) each time an outage is waited out


def on_waited_out(listener) -> None:
    """Call ``listener(where, what, seconds)`` whenever this process waits an outage out (the run journal
    records it); a listener that raises is ignored."""
    _WAITED_OUT.append(listener)


def _tell_waited_out(where: str, what: str, seconds: float) -> None:
    for listener in list(_WAITED_OUT):
        try:
            listener(where, what, seconds)
        except Exception:
            pass


class Retrying:
    """Runs a storage operation again, with exponential backoff and jitter, while it fails with a
    transient error, for at most ``budget_s`` seconds from its first failure; then StorageUnavailable.
    One line when an outage starts and one when it ends (the store's address, never credentials).
    ``budget``: how the lines name the budget; ``then``: what follows when it is spent."""

    def __init__(self, budget_s: float, where: str, say=None, sleep=time.sleep, clock=time.monotonic,
                 budget: str = "failure.storage_retry_s",
                 then: str = "the worker group restarts from the newest committed checkpoint"):
        self.budget_s, self.where, self.budget, self.then = budget_s, where, budget, then
        self.say = say or (lambda m: print(m, file=sys.stderr, flush=True))
        self.sleep, self.clock = sleep, clock

    def __call__(self, what: str, fn, *args, **kwargs):
        first = None
        delay = 0.5
        while True:
            try:
                out = fn(*args, **kwargs)
            except Exception as exc:
                if not transient(exc):
                    raise
                now = self.clock()
                if first is None:
                    first = now
                    self.say(f"ray-app: storage {self.where} unreachable ({type(exc).__name__}) during {what}; "
                             f"retrying for up to {self.budget_s:g} s ({self.budget})")
                if now - first + delay > self.budget_s:
                    raise StorageUnavailable(f"storage {self.where}: no answer for {now - first:.0f} s during {what} "
                                             f"({type(exc).__name__}); {self.then}") from exc
                self.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, 8.0)
                continue
            if first is not None:
                self.say(f"ray-app: storage {self.where} answers again after {self.clock() - first:.1f} s ({what})")
                _tell_waited_out(self.where, what, self.clock() - first)
            return out


def sdk_attempts_for(budget_s: float) -> int:
    """Attempts of the AWS SDK's default strategy (waits 25 ms x 2^k before retry k+1) that span
    ``budget_s`` seconds."""
    attempts, waited = 1, 0.0
    while waited < budget_s:
        waited += 0.025 * 2 ** (attempts - 1)
        attempts += 1
    return attempts
