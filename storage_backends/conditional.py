"""The conditional writes a lease lock and a store probe are built on.

``ConditionalStore`` is all ``storage_backends.s3_lock`` and
``storage_backends.s3_probe`` use of a store: create an object only if it is
absent, replace it only if its ETag still matches, read it with its ETag, look
at its head, delete it (only if it still matches). The S3 backend provides
it; the lock and the probe never reach into the backend, and the backend
imports neither at module level.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

__all__ = ["ConditionalStore", "ObjectHead"]


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectHead:
    """What a HEAD request tells about an object.

    Attributes:
        etag: the object's current ETag.
        metadata: the user metadata written with it.
        age: seconds since it was last written, by the server's own clock
            (``None`` when the answer does not say).
    """

    etag: str
    metadata: Mapping[str, str]
    age: float | None


class ConditionalStore(Protocol):
    """Conditional writes on single objects; keys are the backend's keys.

    Rules:

    * ``create_if_absent`` raises ``KeyExistsError`` if the key exists.
    * ``replace_if_match`` raises ``KeyExistsError`` if the object's ETag is
      not ``etag`` and ``KeyNotFoundError`` if there is no object.
    * Both may raise ``storage_backends.s3_errors.ConflictError`` when another
      conditional write raced them (try again) and return the new ETag.
    * A refusal that came after the client's own retries may have met an
      earlier try of the same request (``s3_errors.retried`` says so).
    """

    @property
    def where(self) -> str:
        """Text naming the store, for messages."""
        ...

    def warm_up(self) -> None:
        """Make the connection ready, so a timed request does not pay for it."""
        ...

    def create_if_absent(
        self, key: str, data: bytes, metadata: Mapping[str, str] | None = None
    ) -> str:
        """Write ``key`` only if absent; return the new ETag."""
        ...

    def replace_if_match(
        self, key: str, data: bytes, etag: str, metadata: Mapping[str, str] | None = None
    ) -> str:
        """Replace ``key`` only if its ETag is ``etag``; return the new ETag."""
        ...

    def read_tagged(self, key: str) -> tuple[bytes, str]:
        """Return the value of ``key`` and its ETag (``KeyNotFoundError`` if absent)."""
        ...

    def head(self, key: str) -> ObjectHead | None:
        """Return the head of ``key``, or ``None`` if absent."""
        ...

    def delete_if_match(self, key: str, etag: str | None) -> None:
        """Delete ``key`` if its ETag is ``etag`` (``None``: unconditionally).

        Raises:
            KeyExistsError: the ETag no longer matches.
            KeyNotFoundError: there is no object (conditional delete only).
        """
        ...
