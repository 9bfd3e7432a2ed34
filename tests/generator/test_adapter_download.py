"""The generator's adapter download (issue 12): streamed to disk and checked and unpacked from there, so a large
adapter costs the generator a chunk of memory, not its size; a download that is not what was published is a
bad version (or, cut short, a retried transfer), never a crash or a half-written cache."""

from __future__ import annotations

import hashlib
import tracemalloc
from pathlib import Path

import pytest

from bucketrl import errors
from bucketrl.generator.adapters import fetch_adapter
from tests.proxy.harness import ProxyHarness, adapter_tar, make_spec, running
from tests.support.services import RedisServer


def _publish(p: ProxyHarness, *tars: bytes) -> None:
    t = p.client("r1", "trainer")
    t.put_run(make_spec())
    t.register_trainer("t0")
    for version, tar in enumerate(tars, start=1):
        t.publish_adapter(version, tar)


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.name.startswith(".tmp"))


def test_a_large_adapter_streams_to_disk_not_into_memory(redis_server: RedisServer, tmp_path: Path) -> None:
    """The tar was downloaded whole into memory (then checked from memory): a 512 MiB adapter cost the
    generator 512 MiB. Now the peak of Python allocations during the fetch is a small fraction of the tar."""
    tar = adapter_tar(1, size=48 * 1024 * 1024)
    cache = tmp_path / "cache"
    cache.mkdir()
    # No proxy-side cache: it would hold the tar in this (shared) process and blur the figure.
    with running(redis_server.url, f"file://{tmp_path / 'b'}", adapter_cache_mb=0) as p:
        _publish(p, tar)
        g = p.client("r1", "generator")
        tracemalloc.start()
        try:
            path = fetch_adapter(g, 1, cache, hashlib.sha256(tar).hexdigest())
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < len(tar) / 8, f"peak {peak / 1e6:.1f} MB for a {len(tar) / 1e6:.1f} MB tar"
    assert (path / "adapter_model.safetensors").stat().st_size > 48 * 1024 * 1024
    assert (path / ".sha256").read_text() == hashlib.sha256(tar).hexdigest()
    assert _leftovers(cache) == []  # the downloaded tar is gone once unpacked


def test_a_corrupt_or_truncated_download_is_a_bad_version_not_a_crash(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """A stored tar whose bytes are not the published ones (same length, flipped bytes): downloaded again once
    (a transfer may have been corrupted), then a bad version (Invalid, not retryable: the worker logs it,
    counts sync/adapter_failures_total and keeps its version). One cut short (the proxy's Content-Length
    promises more): a failed transfer, retryable, with nothing left in the cache; other versions still fetch."""
    good, bad, short = adapter_tar(1, size=4096), adapter_tar(2, size=4096), adapter_tar(3, size=4096)
    cache = tmp_path / "cache"
    cache.mkdir()
    with running(redis_server.url, f"file://{tmp_path / 'b'}", adapter_cache_mb=0) as p:
        _publish(p, good, bad, short)
        stored = {int(b.parent.name[1:]): b for b in (tmp_path / "b").rglob("adapters/v*/bundle.tar")}
        corrupt = bytearray(stored[2].read_bytes())
        corrupt[-2000:-1000] = b"\xff" * 1000
        stored[2].write_bytes(bytes(corrupt))
        stored[3].write_bytes(stored[3].read_bytes()[:3000])
        g = p.client("r1", "generator")

        with pytest.raises(errors.Invalid, match="downloaded twice") as info:
            fetch_adapter(g, 2, cache, hashlib.sha256(bad).hexdigest())
        assert not info.value.retryable
        with pytest.raises(errors.Unavailable) as cut:
            fetch_adapter(g, 3, cache, hashlib.sha256(short).hexdigest())
        assert cut.value.retryable
        assert _leftovers(cache) == [] and not (cache / "v2").exists() and not (cache / "v3").exists()
        assert (fetch_adapter(g, 1, cache, hashlib.sha256(good).hexdigest()) / "adapter_config.json").is_file()
