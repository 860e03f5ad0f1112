"""S3 backend: keys and bytes in any S3-compatible object store.

A store URL ``s3://bucket/prefix`` maps key ``k`` to the object
``prefix/k`` of ``bucket``. Credentials come from the standard boto3 chain
(environment, profile, instance role); the endpoint from the ``endpoint_url``
option or ``$YOGASTORE_S3_ENDPOINT_URL`` (MinIO, Ceph, moto server).

Failure handling:

* Throttling (``SlowDown``) and 5xx answers are retried by botocore with
  exponential backoff (``max_attempts``); a failure surfaces only after the
  last attempt, as ``StorageError``. Each request gets its own attempts:
  botocore's retry quota, shared by all requests of a client, is not used
  (``storage_backends.s3_retries``).
* A missing bucket or an unreachable endpoint raise ``BackendUnavailableError``
  naming bucket and prefix; denied access and missing or bad credentials raise
  its subclass ``AccessDeniedError`` (also a ``PermissionError``); a missing
  key raises ``KeyNotFoundError``. The boto3 error is the ``__cause__``.
* Body reads cut short after the headers arrived are retried here, since
  botocore's retries stop at the response headers.
* A server that ignores ``Range`` (whole object, no ``Content-Range``) is
  answered by slicing the whole object.

Build-once coordination uses conditional writes only (``lock`` returns an
``storage_backends.s3_lock.S3Lock``, which sees this backend as a
``storage_backends.conditional.ConditionalStore``): a lock object created with
``If-None-Match: *`` and a lease its holder renews with ``If-Match`` on the
lock's ETag; a waiter that sees the same ETag for longer than the lease takes
the lock over with the same conditional write. Writes under ``<name>/`` of a
lock this process holds are fenced: refused with ``LockLostError`` once the
lease is no longer trusted, and an exclusive write (the commit) renews the
lease first.

A backend can be used on both sides of ``os.fork``: the child gets a new
client, worker pool and internal lock, and holds none of its parent's locks.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import email.utils
import errno
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

from storage_backends.base import Backend, Buffer
from storage_backends.conditional import ObjectHead
from storage_backends.errors import (
    BackendUnavailableError,
    CorruptCacheError,
    InvalidArgumentError,
    KeyExistsError,
    KeyNotFoundError,
    StorageError,
)
from storage_backends.s3_errors import (
    ENDPOINT_ENV,
    ConflictError,
    Where,
    backoff,
    retried,
    translate,
)
from storage_backends.s3_lock import S3Lock, lock_held
from storage_backends.s3_options import MIN_PART, Coordination, S3Options
from storage_backends.s3_probe import check_conditional_writes, conditional_writes_verdict
from storage_backends.s3_retries import use_per_request_retries

try:
    import boto3
    import botocore.exceptions as bce
    from botocore.config import Config
except ImportError as _err:  # pragma: no cover - depends on the environment
    _IMPORT_ERROR: ImportError | None = _err
else:
    _IMPORT_ERROR = None

__all__ = ["ENDPOINT_ENV", "ConflictError", "S3Backend", "S3Options", "retried"]

logger = logging.getLogger(__name__)

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")

# Backends of this process, reset in a fork child before any other code runs
# there: the parent's client, pool threads and locks are not usable in it.
_LIVE: weakref.WeakSet[S3Backend] = weakref.WeakSet()


def _after_fork() -> None:
    for backend in list(_LIVE):
        backend._reset_after_fork()


os.register_at_fork(after_in_child=_after_fork)


def _server_age(head: Mapping[str, Any]) -> float | None:
    """Seconds since the object was last written, on the server's clock."""
    try:
        date = head["ResponseMetadata"]["HTTPHeaders"]["date"]
        now = email.utils.parsedate_to_datetime(date)
        return float((now - head["LastModified"]).total_seconds())
    except (KeyError, TypeError, ValueError):
        return None


def _parse_url(url: str) -> tuple[str, str]:
    if not url.startswith("s3://"):
        raise InvalidArgumentError(f"S3 store URL must start with 's3://', got {url!r}")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise InvalidArgumentError(f"{url!r} does not name a valid S3 bucket ({bucket!r})")
    prefix = prefix.strip("/")
    if prefix:
        for part in prefix.split("/"):
            if part in ("", ".", "..") or not part.isprintable() or "\\" in part:
                raise InvalidArgumentError(f"S3 prefix {prefix!r} of {url!r} has an invalid part")
        prefix += "/"
    return bucket, prefix


class S3Backend(Backend):
    """Key/bytes store in an S3 bucket under a prefix.

    Args:
        url: ``s3://bucket`` or ``s3://bucket/prefix``.
        **options: the fields of ``S3Options``.

    Raises:
        InvalidArgumentError: malformed URL or option.
        BackendUnavailableError: boto3 is not installed.
    """

    schemes = ("s3",)
    remote = True
    put_copies = True

    def __init__(self, url: str, **options: Any) -> None:
        if _IMPORT_ERROR is not None:
            raise BackendUnavailableError(
                f"{url}: the S3 backend needs boto3; install it with pip install 'yogastore[s3]'"
            ) from _IMPORT_ERROR
        try:
            self.options = S3Options(**options)
        except TypeError as err:
            raise InvalidArgumentError(f"unknown S3 backend option for {url!r}: {err}") from err
        super().__init__(url)
        self.bucket, self.prefix = _parse_url(url)
        self.endpoint_url = self.options.endpoint_url or os.environ.get(ENDPOINT_ENV) or None
        self.upload_workers = self.options.upload_workers
        self.max_parallel = self.options.max_parallel
        # With coordination="single-writer" the store is trusted to have one
        # writer, and leftovers of other builds are not swept.
        self.coordinated = self.options.coordination is Coordination.PROBE
        self._client: Any = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self._init_lock = threading.Lock()
        self._held: dict[str, S3Lock] = {}
        _LIVE.add(self)

    def _reset_after_fork(self) -> None:
        """Forget what belongs to the parent process (called in a fork child).

        Its client and pool threads are unusable here, its internal lock may
        have been held by a thread that does not exist here, and its build
        locks are renewed by the parent, not by this process.
        """
        self._init_lock = threading.Lock()
        self._client = None
        self._pool = None
        self._held = {}
        self._pid = os.getpid()

    # Plumbing ----------------------------------------------------------------

    @property
    def where(self) -> str:
        """Text naming bucket, prefix and endpoint, for error messages."""
        at = f" at {self.endpoint_url}" if self.endpoint_url else ""
        return f"s3://{self.bucket}/{self.prefix}{at}"

    @property
    def client(self) -> Any:
        """The boto3 S3 client (created on first use, again after ``fork``)."""
        if self._pid != os.getpid():  # pragma: no cover - the fork hook ran first
            self._reset_after_fork()
        with self._init_lock:
            if self._client is None:
                pool_size = self.options.max_parallel + self.options.upload_workers + 4
                style = self.options.addressing_style or ("path" if self.endpoint_url else "auto")
                config = Config(
                    retries={"mode": "standard", "total_max_attempts": self.options.max_attempts},
                    max_pool_connections=pool_size,
                    connect_timeout=self.options.connect_timeout,
                    read_timeout=self.options.read_timeout,
                    s3={"addressing_style": style},
                )
                session = boto3.session.Session()
                self._client = session.client(
                    "s3",
                    endpoint_url=self.endpoint_url,
                    region_name=self.options.region,
                    config=config,
                )
                use_per_request_retries(self._client, self.options.max_attempts)
            return self._client

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pid != os.getpid():  # pragma: no cover - the fork hook ran first
            self._reset_after_fork()
        with self._init_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.options.max_parallel, thread_name_prefix="yoga-s3"
                )
            return self._pool

    def _full(self, key: str) -> str:
        return self.prefix + key

    def _translate(self, err: Exception, action: str, key: str | None) -> Exception:
        """Return the yogastore error for a boto3 error (the caller raises it ``from err``)."""
        where = Where(action, key, self.where, self.bucket, self.prefix, self.options.max_attempts)
        return translate(err, where)

    def _call(self, action: str, key: str | None, method: str, **kwargs: Any) -> Any:
        try:
            return getattr(self.client, method)(Bucket=self.bucket, **kwargs)
        except (bce.BotoCoreError, bce.ClientError) as err:
            raise self._translate(err, action, key) from err

    def _fetch(self, key: str, byte_range: str | None) -> tuple[bytes, dict[str, Any]]:
        """GET an object (or a range of it), retrying bodies that break off.

        botocore retries a request until its headers arrive; a body cut short
        after that is retried here.
        """
        extra = {"Range": byte_range} if byte_range else {}
        attempts = self.options.max_attempts
        for attempt in range(1, attempts + 1):
            resp: dict[str, Any] = self._call(
                "reading", key, "get_object", Key=self._full(key), **extra
            )
            try:
                data: bytes = resp["Body"].read()
            except (bce.BotoCoreError, OSError) as err:
                if attempt == attempts and isinstance(err, bce.FlexibleChecksumError):
                    raise CorruptCacheError(
                        f"reading {key!r} in {self.where}: the response failed the checksum "
                        f"the server sent {attempts} times; the stored object or the network "
                        f"path corrupts data: {err}"
                    ) from err
                if attempt == attempts:
                    raise StorageError(
                        errno.EIO,
                        f"reading {key!r} in {self.where} broke off {attempts} times: {err}",
                    ) from err
                logger.debug("retrying broken read of %s: %s", key, err)
                time.sleep(backoff(attempt, 2.0))
                continue
            finally:
                resp["Body"].close()
            length = resp.get("ContentLength")
            if not isinstance(length, int) or length == len(data):
                return data, resp
            logger.debug("retrying short read of %s: %d of %d bytes", key, len(data), length)
            if attempt < attempts:
                time.sleep(backoff(attempt, 2.0))
        raise StorageError(
            errno.EIO,
            f"reading {key!r} in {self.where} came back shorter than announced "
            f"{attempts} times; check the endpoint and the network",
        )

    # Primitives --------------------------------------------------------------

    def _get(self, key: str) -> Buffer:
        return self._fetch(key, None)[0]

    def _get_range(self, key: str, start: int, length: int) -> Buffer:
        try:
            data, resp = self._fetch(key, f"bytes={start}-{start + length - 1}")
        except InvalidArgumentError as err:
            # S3 rejects a range starting at or past the end (InvalidRange).
            raise InvalidArgumentError(
                f"byte range [{start}, {start + length}) is past the end of {key!r} in {self.where}"
            ) from err
        status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status == 206 and "ContentRange" in resp:
            match = _CONTENT_RANGE.match(str(resp["ContentRange"]))
            if match is None or int(match.group(1)) != start:
                raise StorageError(
                    errno.EIO,
                    f"reading bytes [{start}, {start + length}) of {key!r} in {self.where}: "
                    f"the server answered with range {resp['ContentRange']!r}",
                )
        else:
            data = data[start : start + length]  # the server ignored Range: whole object
        if len(data) != length:
            # S3 truncates a range that runs past the end of the object.
            raise InvalidArgumentError(
                f"byte range [{start}, {start + length}) is past the end of {key!r} in "
                f"{self.where} (got {len(data)} bytes)"
            )
        return data

    def _get_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[Buffer]:
        if len(ranges) <= 1:
            return [self.get_range(key, s, n) for s, n in ranges]
        pool = self._executor()
        futures = [pool.submit(self.get_range, key, s, n) for s, n in ranges]
        return [f.result() for f in futures]

    def _holders(self, key: str) -> list[S3Lock]:
        """Return the locks held by this process that cover ``key`` (or prefix)."""
        return [held for name, held in list(self._held.items()) if key.startswith(name + "/")]

    def _check_fence(self, key: str) -> None:
        """Refuse a write under a lock whose lease this process no longer trusts."""
        for held in self._holders(key):
            if not held.valid():
                raise held.refusal(key)

    def _put_object(self, key: str, data: bytes | memoryview, **extra: Any) -> str:
        """Upload one object (multipart when large) and return its ETag."""
        self._check_fence(key)
        if len(data) >= self.options.multipart_threshold:
            return self._put_multipart(key, data, **extra)
        resp = self._call(
            "writing", key, "put_object", Key=self._full(key), Body=bytes(data), **extra
        )
        return str(resp.get("ETag", ""))

    def _put_multipart(self, key: str, data: bytes | memoryview, **extra: Any) -> str:
        metadata = extra.pop("Metadata", None)
        created = self._call(
            "starting upload of",
            key,
            "create_multipart_upload",
            Key=self._full(key),
            **({"Metadata": metadata} if metadata else {}),
        )
        upload_id = created["UploadId"]
        view = memoryview(data).cast("B")
        size = self.options.multipart_part_bytes
        offsets = list(range(0, len(view), size))
        # A last part under 5 MiB is allowed; fold a tiny tail into its predecessor anyway.
        if len(offsets) > 1 and len(view) - offsets[-1] < MIN_PART:
            offsets.pop()
        bounds = list(zip(offsets, [*offsets[1:], len(view)], strict=True))

        def upload(number: int, lo: int, hi: int) -> dict[str, Any]:
            resp = self._call(
                "uploading part of",
                key,
                "upload_part",
                Key=self._full(key),
                UploadId=upload_id,
                PartNumber=number,
                Body=bytes(view[lo:hi]),
            )
            return {"PartNumber": number, "ETag": resp["ETag"]}

        try:
            pool = self._executor()
            futures = [pool.submit(upload, i + 1, lo, hi) for i, (lo, hi) in enumerate(bounds)]
            parts = [f.result() for f in futures]
            resp = self._call(
                "completing upload of",
                key,
                "complete_multipart_upload",
                Key=self._full(key),
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                **extra,
            )
        except BaseException:
            with contextlib.suppress(Exception):
                self.client.abort_multipart_upload(
                    Bucket=self.bucket, Key=self._full(key), UploadId=upload_id
                )
            raise
        return str(resp.get("ETag", ""))

    def _put(self, key: str, data: bytes | memoryview) -> None:
        self._put_object(key, data)

    def _put_exclusive(self, key: str, data: bytes | memoryview) -> None:
        # An exclusive write under a held lock is a commit: make sure, with a
        # request rather than the clock, that the lock is still ours.
        for held in self._holders(key):
            held.renew(key)
        for attempt in range(self.options.max_attempts):
            try:
                self._put_object(key, data, IfNoneMatch="*")
                return
            except KeyExistsError as err:
                if retried(err) and self._same_content(key, data):
                    return
                raise KeyExistsError(
                    errno.EEXIST, f"key {key!r} already exists in {self.where}"
                ) from err
            except ConflictError:
                time.sleep(backoff(attempt, 1.0))
        raise KeyExistsError(
            errno.EEXIST, f"key {key!r} in {self.where} kept conflicting with other writers"
        )

    def _same_content(self, key: str, data: bytes | memoryview) -> bool:
        try:
            return bytes(self._get(key)) == bytes(data)
        except KeyNotFoundError:
            return False

    # Conditional writes (``ConditionalStore``: the lock and the probe) -------

    def warm_up(self) -> None:
        """Create the client now (the lock times its requests)."""
        self.client  # noqa: B018 - made on first use

    def create_if_absent(
        self, key: str, data: bytes, metadata: Mapping[str, str] | None = None
    ) -> str:
        """Write ``key`` only if absent (``If-None-Match: *``); return its ETag."""
        extra: dict[str, Any] = {"Metadata": dict(metadata)} if metadata else {}
        return self._put_object(key, data, IfNoneMatch="*", **extra)

    def replace_if_match(
        self, key: str, data: bytes, etag: str, metadata: Mapping[str, str] | None = None
    ) -> str:
        """Replace ``key`` only if its ETag is ``etag`` (``If-Match``); return the new ETag."""
        extra: dict[str, Any] = {"Metadata": dict(metadata)} if metadata else {}
        return self._put_object(key, data, IfMatch=etag, **extra)

    def read_tagged(self, key: str) -> tuple[bytes, str]:
        """Return the value of ``key`` and its ETag."""
        data, resp = self._fetch(key, None)
        return data, str(resp.get("ETag", ""))

    def head(self, key: str) -> ObjectHead | None:
        """Return ETag, metadata and server-side age of ``key``, or ``None`` if absent."""
        resp = self._head(key)
        if resp is None:
            return None
        metadata = resp.get("Metadata") or {}
        return ObjectHead(str(resp.get("ETag", "")), dict(metadata), _server_age(resp))

    def delete_if_match(self, key: str, etag: str | None) -> None:
        """Delete ``key`` if its ETag is ``etag`` (``None``: unconditionally)."""
        extra = {"IfMatch": etag} if etag is not None else {}
        self._call("deleting", key, "delete_object", Key=self._full(key), **extra)

    def _head(self, key: str) -> dict[str, Any] | None:
        try:
            resp: dict[str, Any] = self._call("inspecting", key, "head_object", Key=self._full(key))
        except KeyNotFoundError:
            return None
        return resp

    def _exists(self, key: str) -> bool:
        return self._head(key) is not None

    def _size(self, key: str) -> int:
        head = self._head(key)
        if head is None:
            raise KeyNotFoundError(errno.ENOENT, f"no key {key!r} in {self.where}")
        return int(head["ContentLength"])

    def _list(self, prefix: str) -> Iterator[str]:
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._full(prefix)):
                for item in page.get("Contents", []):
                    yield str(item["Key"])[len(self.prefix) :]
        except (bce.BotoCoreError, bce.ClientError) as err:
            raise self._translate(err, "listing", prefix or "/") from err

    def _delete(self, key: str) -> None:
        self._check_fence(key)
        self._call("deleting", key, "delete_object", Key=self._full(key))

    def _delete_prefix(self, prefix: str) -> None:
        self._check_fence(prefix)
        keys = list(self._list(prefix))
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self._full(k)} for k in keys[i : i + 1000]]
            try:
                resp = self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                )
            except bce.ClientError as err:
                code = str(err.response.get("Error", {}).get("Code", ""))
                status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if code != "NotImplemented" and status != 501:
                    raise self._translate(err, "deleting under", prefix) from err
                # Some S3-compatible stores lack the batch call: one DELETE per key.
                logger.info("%s has no DeleteObjects; deleting one key at a time", self.where)
                for k in keys[i:]:
                    self._call("deleting", k, "delete_object", Key=self._full(k))
                return
            except bce.BotoCoreError as err:
                raise self._translate(err, "deleting under", prefix) from err
            errors = resp.get("Errors") or []
            if errors:
                raise StorageError(
                    errno.EIO,
                    f"deleting under {prefix!r} in {self.where} failed for {len(errors)} keys, "
                    f"first: {errors[0]}",
                )

    def exclusive_puts_problem(self) -> str | None:
        """Probe (once per endpoint and bucket) whether the store enforces ``If-None-Match``."""
        verdict = conditional_writes_verdict(self)
        return None if verdict is None else f"{self.endpoint_url or 'AWS S3'}: {verdict}"

    def _lock_held(self, name: str) -> bool:
        # One look at the lock object: nothing written, so no probe is needed.
        return lock_held(self, name)

    def _lock(self, name: str, timeout: float | None) -> contextlib.AbstractContextManager[None]:
        # Locks guard builds (and copies, deletes): first make sure the store
        # enforces the conditional writes they rest on. Reads never get here.
        if self.options.coordination is Coordination.PROBE:
            check_conditional_writes(self)
        return S3Lock(
            self,
            name,
            timeout,
            lease=self.options.lock_lease,
            poll=self.options.lock_poll,
            settle=self.options.lock_settle,
            holders=self._held,
        )

    def close(self) -> None:
        """Shut down the worker threads; the client is dropped."""
        with self._init_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._pool = None
            self._client = None
