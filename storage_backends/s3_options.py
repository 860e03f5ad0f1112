"""Options of the S3 backend, validated on construction."""

from __future__ import annotations

import dataclasses
import enum

from storage_backends.errors import InvalidArgumentError

__all__ = ["MIN_PART", "Coordination", "S3Options"]

_MIB = 1 << 20
#: S3's smallest multipart part (except the last).
MIN_PART = 5 * _MIB


class Coordination(enum.Enum):
    """How builders on one object store are kept apart.

    ``PROBE``: before the first build, check once per endpoint and bucket that
    the store enforces ``If-None-Match: *`` and ``If-Match`` on PUT, and refuse
    to build where it does not. ``SINGLE_WRITER``: skip the check, for a store
    that ignores them; unsafe with concurrent builders (each may build, and one
    may commit a manifest naming another's deleted chunks), so leftovers of
    other builds are never swept automatically.
    """

    PROBE = "probe"
    SINGLE_WRITER = "single-writer"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class S3Options:
    """Options of ``S3Backend`` (pass them to ``yogastore.Store`` as keywords).

    Args:
        endpoint_url: S3 API endpoint; ``None`` uses ``$YOGASTORE_S3_ENDPOINT_URL``
            or AWS.
        region: region name; ``None`` uses the boto3 default chain.
        max_parallel: requests in flight from this backend's own pool (parts,
            ``get_ranges``); also ``Backend.max_parallel``, the ranged reads a
            reader keeps in flight unless ``yogastore.ReadOptions`` says.
        upload_workers: chunk uploads in flight while building.
        max_attempts: attempts per request, including the first (botocore
            standard retry mode: throttling, 5xx and connection errors are
            retried with backoff), whatever other requests do.
        connect_timeout: seconds to wait for a connection.
        read_timeout: seconds to wait for data on a connection.
        multipart_threshold: objects at least this large are uploaded in parts.
        multipart_part_bytes: part size of multipart uploads (>= 5 MiB).
        addressing_style: ``"path"``, ``"virtual"`` or ``None`` (path style
            when an endpoint is given, as MinIO and moto need).
        lock_lease: seconds a build lock stays valid without renewal; the
            holder renews it every quarter of that, and stops writing under
            the lock two thirds of a lease after its last renewal was sent.
        lock_poll: longest pause between two looks at a held lock.
        lock_settle: seconds to wait before reading back a lock just written,
            which also guards against stores whose conditional writes race.
        coordination: ``Coordination`` (or its value): probe the store's
            conditional writes before building (default), or trust a single
            writer.
    """

    endpoint_url: str | None = None
    region: str | None = None
    max_parallel: int = 16
    upload_workers: int = 8
    max_attempts: int = 8
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    multipart_threshold: int = 64 * _MIB
    multipart_part_bytes: int = 16 * _MIB
    addressing_style: str | None = None
    lock_lease: float = 30.0
    lock_poll: float = 1.0
    lock_settle: float = 0.1
    coordination: Coordination | str = Coordination.PROBE

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "coordination", Coordination(self.coordination))
        except ValueError as err:
            choices = ", ".join(repr(c.value) for c in Coordination)
            raise InvalidArgumentError(
                f"S3 option coordination must be one of {choices}, got {self.coordination!r}"
            ) from err
        for name in ("max_parallel", "upload_workers", "max_attempts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(
                    f"S3 option {name} must be an integer >= 1, got {value!r}"
                )
        for name in ("connect_timeout", "read_timeout", "lock_lease", "lock_poll"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise InvalidArgumentError(f"S3 option {name} must be a number > 0, got {value!r}")
        if (
            isinstance(self.lock_settle, bool)
            or not isinstance(self.lock_settle, int | float)
            or self.lock_settle < 0
        ):
            raise InvalidArgumentError(
                f"S3 option lock_settle must be >= 0, got {self.lock_settle!r}"
            )
        if not isinstance(self.multipart_part_bytes, int) or self.multipart_part_bytes < MIN_PART:
            raise InvalidArgumentError(
                f"S3 option multipart_part_bytes must be an integer >= {MIN_PART}, "
                f"got {self.multipart_part_bytes!r}"
            )
        if not isinstance(self.multipart_threshold, int) or self.multipart_threshold < MIN_PART:
            raise InvalidArgumentError(
                f"S3 option multipart_threshold must be an integer >= {MIN_PART}, "
                f"got {self.multipart_threshold!r}"
            )
        if self.addressing_style not in (None, "path", "virtual", "auto"):
            raise InvalidArgumentError(
                f"S3 option addressing_style must be 'path', 'virtual' or 'auto', "
                f"got {self.addressing_style!r}"
            )
