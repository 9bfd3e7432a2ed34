"""Storage test fixtures: ``store`` is the real backend behind ``bucket_url`` (file:// and s3:// on moto);
``bucket`` a fresh bucket on the moto server."""

from __future__ import annotations

import uuid

import pytest

from bucketrl.storage import BucketStore, open_store
from tests.support.services import MotoServer


@pytest.fixture()
def store(bucket_url: str) -> BucketStore:
    return open_store(bucket_url)


@pytest.fixture()
def bucket(moto_server: MotoServer) -> str:
    name = f"b-{uuid.uuid4().hex[:12]}"
    moto_server.create_bucket(name)
    return name
