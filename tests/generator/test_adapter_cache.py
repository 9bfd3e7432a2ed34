"""Issue 10 item 11 on the real generator worker (transformers engine, real proxy and bucket): with
``BUCKETRL_ADAPTER_CACHE_DIR`` set (as ``bucketrl up`` and the Helm chart do), a crashed fetch's unpack
directory is removed at start and the versions the worker no longer uses leave the disk as new ones come."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from bucketrl.tarball import pack_dir
from tests.generator.helpers import make_adapter
from tests.generator.worker_support import Consumer, create_run, running_worker, wait_until, worker_settings
from tests.proxy.harness import ProxyHarness, running
from tests.support.services import RedisServer


@pytest.fixture()
def proxy(redis_server: RedisServer, tmp_path: Path) -> Iterator[ProxyHarness]:
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as h:
        yield h


def test_the_adapter_cache_stays_bounded_over_many_versions(
    proxy: ProxyHarness, tiny_model_dir: Path, tmp_path: Path
) -> None:
    adapters = [make_adapter(tiny_model_dir, tmp_path / f"a{i}", seed=20 + i) for i in range(2)]
    trainer, _ = create_run(proxy, "c1", tiny_model_dir, adapters[0])
    cache = tmp_path / "cache"
    (cache / "c1" / ".tmp-v7-crashed").mkdir(parents=True)  # left by a fetch that died mid-unpack
    viewer = proxy.client("c1", "viewer")
    settings = worker_settings(proxy, "c1", "gen-c", adapter_cache_dir=str(cache))

    def on_disk() -> list[int]:
        return sorted(int(m[1]) for p in (cache / "c1").iterdir() if (m := re.fullmatch(r"v(\d+)", p.name)))

    with running_worker(settings) as worker, Consumer(trainer):
        wait_until(lambda: worker.book.loaded_versions(), 120, "v1 loaded")
        assert not (cache / "c1" / ".tmp-v7-crashed").exists()
        for v in range(2, 5):
            trainer.publish_adapter(v, pack_dir(adapters[v % 2]))
            wait_until(
                lambda v=v: any(v in w.loaded_versions for w in viewer.status().workers if w.worker_id == "gen-c"),
                60,
                f"v{v} loaded",
            )
        # max_staleness 1: v3 and v4 may stay resident; everything older left the engine and the disk.
        wait_until(lambda: on_disk() and min(on_disk()) >= 3, 30, f"old versions deleted (on disk: {on_disk()})")
        assert set(on_disk()) <= {3, 4} | worker.book.versions()
