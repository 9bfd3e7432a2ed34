"""Fixtures of the proxy tests: a real proxy (uvicorn in a thread) over a real Redis and bucket.

- ``proxy``: on both bucket backends (``bucket_url`` is parametrized file/s3) — for storage-touching tests.
- ``proxy_file``: file:// only — for tests whose subject is Redis state, to keep the suite fast.
See ``tests/proxy/harness.py`` for the harness API (``client``, ``http``, ``call``, ``restart``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.proxy.harness import ProxyHarness, running
from tests.support.services import RedisServer


@pytest.fixture()
def proxy(redis_server: RedisServer, bucket_url: str) -> Iterator[ProxyHarness]:
    with running(redis_server.url, bucket_url) as h:
        yield h


@pytest.fixture()
def proxy_file(redis_server: RedisServer, tmp_path: Path) -> Iterator[ProxyHarness]:
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as h:
        yield h
