"""Session-wide fixtures: real Redis, a real S3 endpoint (moto server), the tiny model."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.proxy.harness import ProxyHarness, running
from tests.support import alone, schedule
from tests.support.services import MotoServer, RedisServer, apply_env

# Per-test times to build/test-times.json; the `alone` marker across xdist workers.
pytest_plugins = ["tests.support.timings", "tests.support.alone"]


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    server = MotoServer().start()
    old = apply_env(server.env())
    yield server
    server.stop()
    import os

    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture()
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server owned by this test (kill/restart/wipe it freely)."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.kill()


@pytest.fixture()
def proxy(redis_server: RedisServer, tmp_path: Path) -> Iterator[ProxyHarness]:
    """The real proxy app (uvicorn on a loopback port) over this test's Redis and a ``file://`` bucket."""
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as h:
        yield h


@pytest.fixture(params=["file", "s3"])
def bucket_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Every storage-touching test runs against both backends."""
    if request.param == "file":
        return f"file://{tmp_path / 'bucket'}"
    moto: MotoServer = request.getfixturevalue("moto_server")
    name = f"b-{uuid.uuid4().hex[:12]}"
    moto.create_bucket(name)
    return f"s3://{name}/prefix"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bucketrl.tasks.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules longest first (tests/support/schedule.py), the ``alone`` tests ahead of them (support/alone.py)."""
    schedule.longest_first(items)
    alone.order(items)
