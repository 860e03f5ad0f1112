"""What the S3 backend and its lock share: error translation, retry facts, backoff.

boto3 errors become this project's errors in one place, by table: the first
rule whose S3 error code or HTTP status matches decides the error class (as
s3fs maps codes to ``OSError`` kinds), so a new code is one row, not a branch.
Neither the backend nor the lock imports the other for these.
"""

from __future__ import annotations

import dataclasses
import errno
import random
from collections.abc import Callable
from typing import Any

from storage_backends.errors import (
    AccessDeniedError,
    BackendUnavailableError,
    InvalidArgumentError,
    KeyExistsError,
    KeyNotFoundError,
    StorageError,
)

try:
    import botocore.exceptions as bce
except ImportError:  # pragma: no cover - the backend reports the missing boto3
    bce = None

__all__ = ["ENDPOINT_ENV", "ConflictError", "Where", "backoff", "retried", "translate"]

#: Environment variable read when no ``endpoint_url`` option is given.
ENDPOINT_ENV = "YOGASTORE_S3_ENDPOINT_URL"


class ConflictError(StorageError):
    """S3 answered 409 to a conditional write racing another one: try again."""


def backoff(attempt: int, cap: float) -> float:
    """Return the seconds to sleep before retry ``attempt``: capped exponential, full jitter."""
    return float(min(cap, 0.05 * 2**attempt) * random.random())


def retried(err: BaseException) -> bool:
    """Return whether the boto3 error behind ``err`` came after botocore retries.

    A retried conditional write may meet its own first try, which had landed
    although its answer was lost.
    """
    cause = err.__cause__
    if bce is None or not isinstance(cause, bce.ClientError):
        return False
    return bool(cause.response.get("ResponseMetadata", {}).get("RetryAttempts", 0))


@dataclasses.dataclass(frozen=True, slots=True)
class Where:
    """What a translated error names: the request, the store, how often it was tried."""

    action: str
    key: str | None
    store: str  # bucket, prefix and endpoint, as ``S3Backend.where``
    bucket: str
    prefix: str
    max_attempts: int

    @property
    def target(self) -> str:
        if self.key:
            return f"{self.action} {self.key!r} in {self.store}"
        return f"{self.action} in {self.store}"


@dataclasses.dataclass(frozen=True, slots=True)
class _Answer:
    """One S3 error answer: code, HTTP status, attempts made, readable detail."""

    code: str
    status: int | None
    attempts: int
    detail: str


_Make = Callable[[Where, _Answer], Exception]

#: S3 error answers, first match wins: (codes, HTTP status, error to raise).
_ANSWERS: tuple[tuple[frozenset[str], int | None, _Make], ...] = (
    (
        frozenset({"NoSuchBucket"}),
        None,
        lambda w, a: BackendUnavailableError(
            errno.ENOENT,
            f"S3 bucket {w.bucket!r} does not exist ({w.target}); create it or fix the URL",
        ),
    ),
    (
        frozenset(
            {
                "AccessDenied",
                "AllAccessDisabled",
                "AccountProblem",
                "ExpiredToken",
                "InvalidAccessKeyId",
                "InvalidToken",
                "SignatureDoesNotMatch",
                "403",
                "Forbidden",
            }
        ),
        403,
        lambda w, a: AccessDeniedError(
            errno.EACCES,
            f"access denied to {w.target} ({a.detail}); check the credentials and the "
            f"bucket policy for s3://{w.bucket}/{w.prefix}",
        ),
    ),
    (
        frozenset({"NoSuchKey", "404", "NotFound"}),
        404,
        lambda w, a: KeyNotFoundError(errno.ENOENT, f"no key {w.key!r} in {w.store}"),
    ),
    (
        frozenset({"PreconditionFailed"}),
        412,
        lambda w, a: KeyExistsError(errno.EEXIST, f"condition failed for {w.target}"),
    ),
    (
        frozenset({"ConditionalRequestConflict"}),
        409,
        lambda w, a: ConflictError(errno.EAGAIN, f"concurrent conditional write to {w.target}"),
    ),
    (
        frozenset({"InvalidRange"}),
        416,
        lambda w, a: InvalidArgumentError(f"byte range is past the end of the object: {w.target}"),
    ),
)


_Rule = tuple[tuple[type[BaseException], ...], Callable[[Where, Any], Exception]]


def _client_side() -> tuple[_Rule, ...]:
    """Failures before any answer came (credentials, region, network), first match wins."""
    if bce is None:  # pragma: no cover - the backend refuses to start without boto3
        return ()
    return (
        (
            (bce.NoCredentialsError, bce.PartialCredentialsError, bce.CredentialRetrievalError),
            lambda w, err: AccessDeniedError(
                errno.EACCES,
                f"no usable AWS credentials for {w.target}: set AWS_ACCESS_KEY_ID and "
                f"AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run with an instance role ({err})",
            ),
        ),
        (
            (bce.NoRegionError,),
            lambda w, err: BackendUnavailableError(
                errno.EINVAL, f"no AWS region for {w.target}: set AWS_DEFAULT_REGION or region="
            ),
        ),
        (
            (bce.ReadTimeoutError,),
            lambda w, err: BackendUnavailableError(
                errno.ETIMEDOUT,
                f"the S3 endpoint for {w.target} took each request but sent no answer within "
                f"read_timeout, {w.max_attempts} attempts: {err}; the store is stalled or "
                "overloaded (read_timeout= and max_attempts= of Store bound how long a request "
                "waits)",
            ),
        ),
        (
            (bce.ConnectionError, bce.HTTPClientError),
            lambda w, err: BackendUnavailableError(
                errno.EHOSTUNREACH,
                f"cannot reach the S3 endpoint for {w.target} after {w.max_attempts} "
                f"attempts: {err}; check endpoint_url / ${ENDPOINT_ENV} and the network",
            ),
        ),
    )


def translate(err: Exception, where: Where) -> Exception:
    """Return this project's error for a boto3 error (the caller raises it ``from err``)."""
    for kinds, make in _client_side():
        if isinstance(err, kinds):
            return make(where, err)
    if bce is not None and isinstance(err, bce.ClientError):
        error = err.response.get("Error", {})
        meta = err.response.get("ResponseMetadata", {})
        code = str(error.get("Code", ""))
        status = meta.get("HTTPStatusCode")
        answer = _Answer(
            code=code,
            status=status,
            attempts=int(meta.get("RetryAttempts", 0)) + 1,
            detail=f"{code or status}: {error.get('Message', '')}".rstrip(": "),
        )
        for codes, status_code, make_error in _ANSWERS:
            if code in codes or (status_code is not None and status == status_code):
                return make_error(where, answer)
        return StorageError(
            errno.EIO,
            f"S3 request failed: {where.target} after {answer.attempts} attempt(s): "
            f"{answer.detail}",
        )
    return StorageError(errno.EIO, f"S3 request failed: {where.target}: {err}")
