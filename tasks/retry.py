"""Retry policies of the tasks, one per kind of failure.

- `TRANSIENT_IO`: a task that reads or writes storage (local disk, a network mount, S3) or calls a
  server is retried when, and only when, the failure is transient: a dropped or refused connection,
  a timeout, an I/O error of the device, S3 throttling or a 5xx, the Prefect API answering 429/5xx.
  The storage layer already retries each request a few times within seconds; a failure that
  reaches the task means an outage of tens of seconds or more, hence the task-level backoff of
  30 s, 60 s, 120 s with jitter (about 3.5 min in all; jitter spreads the retries of concurrent
  workers so they do not hit a recovering service at once).
- deterministic errors are never retried: bad config, bad data, failed verification, a smoke run
  whose loss did not fall, a checksum that does not match, a rejected gate (`ValueError` and its
  many eyas subclasses, `ShardVerificationError`, `TrainingRejected`, `FileNotFoundError`, ...).
  Anything not known to be transient counts as deterministic: the run fails loudly, and a re-run
  resumes from the durable state.
- the trainer is not retried blindly: see `relaunch_if_progressed` (tasks/train.py).
"""

from __future__ import annotations

import errno

from prefect.tasks import exponential_backoff

# errno values of an I/O call that can succeed when repeated (network mounts, flaky devices)
TRANSIENT_ERRNOS = {
    errno.EAGAIN,
    errno.EIO,
    errno.ETIMEDOUT,
    errno.ESTALE,
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.ENETDOWN,
    errno.ENETUNREACH,
    errno.EHOSTUNREACH,
}
# S3 error codes that mean "try again later"
TRANSIENT_S3_CODES = {
    "Throttling",
    "ThrottlingException",
    "SlowDown",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
    "RequestTimeTooSkewed",
}


def _http_status_transient(status: int | None) -> bool:
    return status is not None and (status == 429 or status >= 500)


def is_transient(exc: BaseException | None) -> bool:
    """True for a failure that may pass when the same call is repeated; follows `raise ... from` causes,
    except through a `ValueError` (a verdict on the data or config, whatever caused it)."""
    while exc is not None:
        if isinstance(exc, ValueError):
            return False
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return True
        if isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS:
            return True
        if _third_party_transient(exc):
            return True
        exc = exc.__cause__
    return False


def _third_party_transient(exc: BaseException) -> bool:
    """Transport errors of the HTTP clients eyas and Prefect use (imported only if already loaded)."""
    import sys

    if "httpx" in sys.modules:
        import httpx

        if isinstance(exc, httpx.TransportError):
            return True
        if isinstance(exc, httpx.HTTPStatusError):
            return _http_status_transient(exc.response.status_code)
    if "botocore" in sys.modules:
        from botocore.exceptions import ClientError, ConnectionError, HTTPClientError

        if isinstance(exc, (ConnectionError, HTTPClientError)):
            return True
        if isinstance(exc, ClientError):
            error = exc.response.get("Error", {})
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return error.get("Code") in TRANSIENT_S3_CODES or _http_status_transient(status)
    return False


def failure_of(state) -> BaseException | None:
    """The exception a failed task state carries."""
    if isinstance(state.data, BaseException):
        return state.data
    result = state.result(raise_on_failure=False)
    return result if isinstance(result, BaseException) else None


def log_to_run(message: str) -> None:
    """To the task run's log (shown in the UI) when there is one."""
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_logger, get_run_logger

    try:
        get_run_logger().info(message)
    except MissingContextError:
        get_logger("eyas.retry").info(message)


def retry_if_transient(task, task_run, state) -> bool:
    """Prefect `retry_condition_fn`: retry transient failures only."""
    exc = failure_of(state)
    transient = is_transient(exc)
    log_to_run(
        f"{task.name}: {type(exc).__name__} is {'transient: retrying' if transient else 'not transient: not retried'}"
    )
    return transient


TRANSIENT_IO = {
    "retries": 3,
    "retry_delay_seconds": exponential_backoff(backoff_factor=30),  # 30 s, 60 s, 120 s
    "retry_jitter_factor": 0.5,
    "retry_condition_fn": retry_if_transient,
}
