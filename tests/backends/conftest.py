"""Fixtures of the backend tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.backends.s3_support import create_bucket, fake_credentials


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake credentials, no real AWS configuration."""
    fake_credentials(monkeypatch)


@pytest.fixture
def mock_bucket(aws: None) -> Iterator[str]:
    """An empty bucket in moto's in-process mock."""
    from moto import mock_aws

    with mock_aws():
        create_bucket(None, "contract-bucket")
        yield "contract-bucket"
