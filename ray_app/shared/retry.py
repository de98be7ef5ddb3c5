"""What counts as transient, and the retry budget: the one home of storage retries.

``transient`` tells an unreachable store (connection refused or reset, timeouts, throttling, 5xx) from
an answer that will not change (a missing bucket, access denied). ``Retrying`` waits a transient error
out for ``failure.storage_retry_s`` seconds, then raises ``StorageUnavailable``. ``call_timeouts`` bounds
each single request by the same budget: an endpoint that accepts connections and never answers costs one
timeout per attempt, and the loop's clock counts it, so such a call ends within the budget plus one timeout.
The SDKs' own retries are off under a budget (``sdk_attempts``: one attempt): only this loop retries, so
nothing multiplies the wait. Both the kit's own S3 calls (``ray_app.shared.storage``) and the pyarrow
filesystem Ray Train writes with (``ray_app.shared.s3fs``) use these, so imports run one way: storage ->
s3fs -> retry.
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
_PYARROW_TRANSIENT = re.compile(r"NETWORK_CONNECTION|curlCode|Could not connect|timed out|Timeout was reached|"
                                r"SLOW_DOWN|SlowDown|"
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


# a single request's timeouts without a budget (the fail-fast calls): connect, then each wait for an answer
CONNECT_S, READ_S = 3.0, 30.0
BUDGET_KEY = "failure.storage_retry_s"


def call_timeouts(budget_s: float) -> tuple[float, float]:
    """(connect, read) seconds of one request under a retry budget: a quarter of the budget, at least 1 s,
    at most ``CONNECT_S`` / ``READ_S`` (3 s and 30 s: the default budget of 120 s keeps them). An endpoint
    that never answers then fails an attempt after one read timeout, and the budget holds about four."""
    if budget_s <= 0:
        return CONNECT_S, READ_S
    quarter = max(1.0, budget_s / 4)
    return min(CONNECT_S, quarter), min(READ_S, quarter)


def attempt_s(budget_s: float) -> float:
    """The longest one attempt waits without an answer: its connect, then twice its read timeout (a PUT
    waits for "100 Continue", then for its answer)."""
    connect, read = call_timeouts(budget_s)
    return connect + 2 * read


def sdk_attempts(budget_s: float) -> int:
    """Attempts the AWS SDK makes per call itself: one under a budget (``Retrying`` retries, on its clock),
    three without (a fail-fast call still rides out a dropped connection)."""
    return 1 if budget_s > 0 else 3


class Retrying:
    """Runs a storage operation again, with exponential backoff and jitter, while it fails with a
    transient error, for at most ``budget_s`` seconds; then StorageUnavailable. The clock starts when the
    store stopped answering: at the failed attempt's start, or ``timeout_s`` (``attempt_s``) before its
    failure if the attempt ran longer (a long transfer that broke). No attempt starts past the budget, so
    an operation ends within ``budget_s`` plus one attempt's timeouts.
    One line when an outage starts and one when it ends (the store's address, never credentials).
    ``budget``: how the lines name the budget in force (the config key, or how a smaller one derives from
    it); ``then``: what follows when it is spent."""

    def __init__(self, budget_s: float, where: str, say=None, sleep=time.sleep, clock=time.monotonic,
                 budget: str = BUDGET_KEY,
                 then: str = "the worker group restarts from the newest committed checkpoint",
                 timeout_s: float | None = None):
        self.budget_s, self.where, self.budget, self.then = budget_s, where, budget, then
        self.timeout_s = attempt_s(budget_s) if timeout_s is None else timeout_s
        self.say = say or (lambda m: print(m, file=sys.stderr, flush=True))
        self.sleep, self.clock = sleep, clock

    @property
    def in_force(self) -> str:
        """The budget as the lines name it: its seconds and where they come from."""
        return f"{self.budget_s:g} s ({self.budget})"

    def __call__(self, what: str, fn, *args, **kwargs):
        first = None
        delay = 0.5
        while True:
            started = self.clock()
            try:
                out = fn(*args, **kwargs)
            except Exception as exc:
                if not transient(exc):
                    raise
                now = self.clock()
                if first is None:
                    first = now - min(now - started, self.timeout_s)
                    silent = f"no answer for {now - first:.0f} s, " if now - first >= 1 else ""
                    self.say(f"ray-app: storage {self.where} unreachable ({type(exc).__name__}) during {what}; "
                             f"{silent}retrying for up to {self.in_force}")
                if now - first + delay > self.budget_s:
                    raise StorageUnavailable(f"storage {self.where}: no answer for {now - first:.0f} s during {what} "
                                             f"({type(exc).__name__}), retried for up to {self.in_force}; "
                                             f"{self.then}") from exc
                self.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, 8.0)
                continue
            if first is not None:
                self.say(f"ray-app: storage {self.where} answers again after {self.clock() - first:.1f} s ({what})")
                _tell_waited_out(self.where, what, self.clock() - first)
            return out
