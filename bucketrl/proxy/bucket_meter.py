"""What a run costs in the bucket and on the wire (issue 25; docs/cost.md), per run and per link.

- bucket requests by price class: ``writes`` (PUT, LIST: S3's dearer class) and ``reads`` (GET, HEAD; a
  presigned URL handed to a worker counts as the GET it will make). DELETEs are free on S3 and not counted;
- the bucket -> proxy link: bytes read out of the bucket (``bucket|egress_bytes``);
- the proxy -> workers link: bytes of adapters, checkpoints and datasets the proxy serves (``proxy|egress_bytes``).

Counted in this process as the calls happen (a lock and an add, no I/O on the request path) and added to the run's
cost usage in Redis by :func:`flush` (the maintenance loop, every status read, the shutdown) with HINCRBYFLOAT, so
every proxy replica adds its own share. A call is the run's when its key is under ``runs/{run}/``; the
deployment's own keys (the bucket's identity, the readiness probe) belong to no run and are not priced.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import IO, Any

from redis import exceptions as redis_exc

from bucketrl.proxy import keys
from bucketrl.storage.base import BucketStore

log = logging.getLogger("bucketrl.proxy")

WRITES, READS = "bucket|writes", "bucket|reads"
BUCKET_EGRESS, PROXY_EGRESS = "bucket|egress_bytes", "proxy|egress_bytes"
FIELDS = (WRITES, READS, BUCKET_EGRESS, PROXY_EGRESS)


def run_of(key: str) -> str | None:
    parts = key.split("/", 2)
    return parts[1] if len(parts) >= 2 and parts[0] == "runs" and parts[1] else None


class BucketMeter:
    """Per-run counts not yet added to Redis (thread-safe: the store is called from worker threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def add(self, run: str | None, field: str, n: float = 1.0) -> None:
        if run is None or n <= 0:
            return
        with self._lock:
            self._pending[run][field] += n

    def served(self, run: str, nbytes: int) -> None:
        """The proxy answered a worker with ``nbytes`` of a run's objects (the proxy -> workers link)."""
        self.add(run, PROXY_EGRESS, float(nbytes))

    def take(self) -> dict[str, dict[str, float]]:
        with self._lock:
            out = {run: dict(fields) for run, fields in self._pending.items()}
            self._pending.clear()
        return out

    def give_back(self, counts: dict[str, dict[str, float]]) -> None:
        for run, fields in counts.items():
            for field, n in fields.items():
                self.add(run, field, n)


class MeteredStore:
    """A :class:`BucketStore` that counts each call's requests and bytes for :class:`BucketMeter`."""

    def __init__(self, inner: BucketStore, meter: BucketMeter) -> None:
        self.inner = inner
        self.meter = meter
        self.url = inner.url

    def put_bytes(self, key: str, data: bytes) -> None:
        self.inner.put_bytes(key, data)
        self.meter.add(run_of(key), WRITES)

    def put_file(self, key: str, fileobj: IO[bytes], size: int | None = None) -> None:
        self.inner.put_file(key, fileobj, size)
        self.meter.add(run_of(key), WRITES)

    def get_bytes(self, key: str) -> bytes:
        self.meter.add(run_of(key), READS)
        data = self.inner.get_bytes(key)
        self.meter.add(run_of(key), BUCKET_EGRESS, len(data))
        return data

    def iter_chunks(self, key: str, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        # The inner call first, outside the generator: a NotFound it raises up front stays raised up front.
        chunks = self.inner.iter_chunks(key, chunk_size)
        self.meter.add(run_of(key), READS)
        return self._counted(run_of(key), chunks)

    def _counted(self, run: str | None, chunks: Iterator[bytes]) -> Iterator[bytes]:
        for chunk in chunks:
            self.meter.add(run, BUCKET_EGRESS, len(chunk))
            yield chunk

    def exists(self, key: str) -> bool:
        self.meter.add(run_of(key), READS)
        return self.inner.exists(key)

    def list_keys(self, prefix: str) -> list[str]:
        self.meter.add(run_of(prefix), WRITES)
        return self.inner.list_keys(prefix)

    def delete(self, keys: Iterable[str]) -> None:
        self.inner.delete(keys)

    def delete_prefix(self, prefix: str) -> int:
        self.meter.add(run_of(prefix), WRITES)  # the listing; the deletes are free
        return self.inner.delete_prefix(prefix)

    def check(self) -> None:
        self.inner.check()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)  # AttributeError for what the inner store lacks (presign_get on file://)
        if name != "presign_get":
            return attr

        def presign_get(key: str, expires_s: int) -> str:
            self.meter.add(run_of(key), READS)  # the GET the worker makes with it
            return str(attr(key, expires_s))

        return presign_get


async def flush(r: Any, meter: BucketMeter | None) -> None:
    """Add what was counted since the last flush to each (still existing) run's cost usage."""
    if meter is None:
        return
    counts = meter.take()
    if not counts:
        return
    runs = list(counts)
    try:
        known = await r.smismember(keys.RUNS_SET, runs)
        pipe = r.pipeline(transaction=False)
        for run, is_known in zip(runs, known, strict=True):
            if is_known:  # a deleted run's counts are dropped, not written back as a stray key
                for field, n in counts[run].items():
                    pipe.hincrbyfloat(keys.run_key(run, keys.COST_USAGE), field, n)
        await pipe.execute()
    except redis_exc.RedisError as exc:
        meter.give_back(counts)  # counted again at the next flush
        log.warning("bucket meter: counts kept for the next flush (%r)", exc)
