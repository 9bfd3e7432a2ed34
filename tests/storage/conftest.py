"""Storage test fixtures: ``store`` is the real backend behind ``bucket_url`` (file:// and s3:// on moto)."""

from __future__ import annotations

import pytest

from bucketrl.storage import BucketStore, open_store


@pytest.fixture()
def store(bucket_url: str) -> BucketStore:
    return open_store(bucket_url)
