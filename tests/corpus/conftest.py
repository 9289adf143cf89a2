"""Fixtures the corpus tests share."""

from __future__ import annotations

import pytest


@pytest.fixture
def s3_storage(s3, monkeypatch):
    """The stack's S3 (SeaweedFS) as the storage module's endpoint, for one test."""
    from crucible.trainer import storage

    for name, value in (("AWS_ENDPOINT_URL", s3.endpoint), ("AWS_ACCESS_KEY_ID", s3.access_key),
                        ("AWS_SECRET_ACCESS_KEY", s3.secret_key),
                        ("AWS_DEFAULT_REGION", s3.region)):
        monkeypatch.setenv(name, value)
    storage.s3_client.cache_clear()      # a client made earlier holds another endpoint
    yield s3
    storage.s3_client.cache_clear()
