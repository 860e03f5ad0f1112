"""botocore's standard retries, per request: without the client's shared retry quota.

botocore's standard retry mode gives each client one retry quota (500 units; a
retry after a connection error or timeout costs 14, after throttling 5, and only
a success gives any back). The S3 backend keeps many requests in flight on one
client, so an endpoint away for a few seconds (a restart) spends the quota in
about 35 retries, and from then on every request of that client fails at its
first attempt, although ``max_attempts`` promises each request its own tries.

``use_per_request_retries`` replaces the client's retry handler with botocore's
own standard one (same retry conditions, same backoff, same ``max_attempts``)
built with a quota that never runs out. botocore has no setting for this, so it
builds the handler from the classes of ``botocore.retries.standard``; where they
are not what it expects, the client keeps botocore's default and a debug line
says so, once per process. ``tests/test_s3_retries.py`` checks that the
installed botocore gets per-request retries, so an upgrade that changes these
classes fails there.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

__all__ = ["use_per_request_retries"]

logger = logging.getLogger(__name__)

_fallback_logged = False


class _NoQuota:
    """A retry quota that never runs out (what ``botocore.retries.quota.RetryQuota`` offers)."""

    def acquire(self, capacity_amount: int) -> bool:
        return True

    def release(self, capacity_amount: int) -> None:
        pass


def _make(cls: Any, required: dict[str, Any], optional: dict[str, Any]) -> Any:
    """``cls(**required, **optional)``, leaving out the optional arguments it does not take.

    botocore added the optional ones (service name, throttling detector) after 1.34;
    its own handler gets them exactly when its classes take them.
    """
    taken = inspect.signature(cls).parameters
    return cls(**required, **{k: v for k, v in optional.items() if k in taken})


def use_per_request_retries(client: Any, max_attempts: int) -> bool:
    """Give each request of ``client`` ``max_attempts`` attempts, whatever other requests do.

    Args:
        client: a boto3 client created with ``retries={"mode": "standard", ...}``.
        max_attempts: attempts per request, the first included.

    Returns:
        Whether the handler was replaced (``False``: botocore's default is kept).
    """
    global _fallback_logged
    try:
        from botocore.retries import standard

        if client.meta.config.retries.get("mode") != "standard":
            raise ValueError(f"retry mode {client.meta.config.retries.get('mode')!r}")
        service = client.meta.service_model.service_id.hyphenize()
        adapter = standard.RetryEventAdapter()
        throttling = standard.ThrottlingErrorDetector(adapter)
        policy = standard.RetryPolicy(
            retry_checker=standard.StandardRetryConditions(max_attempts=max_attempts),
            retry_backoff=_make(
                standard.ExponentialBackoff,
                {},
                {"service_name": service, "throttling_detector": throttling},
            ),
        )
        quota = _make(
            standard.RetryQuotaChecker, {"quota": _NoQuota()}, {"throttling_detector": throttling}
        )
        handler = _make(
            standard.RetryHandler,
            {"retry_policy": policy, "retry_event_adapter": adapter, "retry_quota": quota},
            {"service_name": service},
        )
        # Where botocore registers its own (standard.register_retry_handler).
        event, unique_id = f"needs-retry.{service}", f"retry-config-{service}"
        client.meta.events.unregister(event, unique_id=unique_id)
        client.meta.events.register(event, handler.needs_retry, unique_id=unique_id)
    except (ImportError, AttributeError, TypeError, ValueError, KeyError) as err:
        if not _fallback_logged:
            _fallback_logged = True
            logger.debug(
                "S3 clients keep botocore's shared retry quota (requests may get fewer "
                "than max_attempts attempts when many fail): this botocore's retry "
                "classes are not as expected: %r",
                err,
            )
        return False
    return True
