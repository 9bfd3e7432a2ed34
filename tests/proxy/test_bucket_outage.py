"""A bucket outage seen through the proxy's routes (issue 10, items 3 and 4).

During an outage of either backend (file: the root directory renamed away; S3: the endpoint refusing
connections or answering 5xx, through a :class:`TcpGate` in front of moto) every route that needs the bucket
answers 503 with Retry-After, nothing is counted lost, a committed version is never reported missing, and the
maintenance pass fails cleanly (Unavailable) instead of with a traceback; afterwards everything that was
accepted is delivered. A proxy (re)started over a bucket that is not its deployment's refuses to serve.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bucketrl import errors
from bucketrl.proxy import gc, identity, keys
from bucketrl.proxy.state import accounting
from tests.proxy.harness import ProxyHarness, adapter_tar, checkpoint_tar, running
from tests.proxy.test_rollouts_routes import Setup
from tests.support.faults import TcpGate
from tests.support.services import MotoServer, RedisServer


@dataclass
class Bucket:
    url: str
    settings: dict[str, str]
    down: Callable[[], None]
    up: Callable[[], None]


# S3 answering 5xx is covered at the store level (tests/storage/test_outage.py: the same Unavailable as a refused
# connection, which is all the routes see); here it would cost ~20 s of botocore's retry backoff per test.
@pytest.fixture(params=["file", "s3-refused"])
def bucket(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Bucket]:
    if request.param == "file":
        root, away = tmp_path / "bucket", tmp_path / "bucket.away"
        yield Bucket(f"file://{root}", {}, lambda: root.rename(away), lambda: away.rename(root))
        return
    moto: MotoServer = request.getfixturevalue("moto_server")
    name = f"o-{uuid.uuid4().hex[:12]}"
    moto.create_bucket(name)
    gate = TcpGate(moto.port).start()
    try:
        yield Bucket(
            f"s3://{name}/p",
            {"s3_endpoint_url": gate.endpoint},
            lambda: gate.set_mode("refuse"),
            lambda: gate.set_mode("open"),
        )
    finally:
        gate.stop()


def _counters(p: ProxyHarness, run: str) -> dict[str, int]:
    return p.call(lambda ctx: accounting.counters(ctx.redis, run))


def test_outage_is_503_with_retry_after_and_loses_nothing(redis_server: RedisServer, bucket: Bucket) -> None:
    with running(redis_server.url, bucket.url, **bucket.settings) as p:
        s = Setup(p, queue_capacity_groups=32, groups_per_step=2, max_staleness=8)
        s.g.submit_rollouts(s.batch(2), "k1")
        first = s.t.claim("trainer-0", max_groups=1).deliveries  # one pending, one queued
        assert len(first) == 1
        tar2 = adapter_tar(2)
        ckpt1, ckpt2 = checkpoint_tar(b"step-1"), checkpoint_tar(b"step-2")
        s.t.put_checkpoint(1, ckpt1)

        bucket.down()
        with p.http("admin") as h:
            fence = {"X-Trainer-Epoch": str(s.t.epoch)}
            answers = {
                "GET adapter v1 (committed)": h.get(s.path("/adapters/1")),
                "PUT adapter v2": h.put(
                    s.path("/adapters/2"),
                    content=tar2,
                    headers={**fence, "X-Content-SHA256": hashlib.sha256(tar2).hexdigest()},
                ),
                "claim": h.post(
                    s.path("/rollouts/claim"), json={"consumer": "trainer-0", "max_groups": 4}, headers=fence
                ),
                "GET checkpoint 1 (committed)": h.get(s.path("/checkpoints/1")),
                "PUT checkpoint 2": h.put(
                    s.path("/checkpoints/2"),
                    content=ckpt2,
                    headers={**fence, "X-Content-SHA256": hashlib.sha256(ckpt2).hexdigest()},
                ),
            }
        for what, r in answers.items():
            # Before the fix (file): GET v1 answered 404 not_found retryable false, the claim counted lost groups.
            assert r.status_code == 503, (what, r.status_code, r.text)
            assert r.json()["error"]["retryable"] is True, (what, r.text)
            assert int(r.headers["Retry-After"]) >= 1, (what, r.headers)
        with pytest.raises(errors.Unavailable) as caught:
            s.g.submit_rollouts(s.batch(1), "k2")
        assert caught.value.retry_after is not None and caught.value.retry_after >= 1
        with p.http(None) as anon:
            ready = anon.get("/readyz")
            assert ready.status_code == 503 and ready.json()["bucket"].startswith("unavailable"), ready.text
        # The maintenance pass fails cleanly (the loop logs and retries) instead of with NotADirectoryError out
        # of delete_prefix: give it a version to delete (as a pass that marked it and died would leave).
        p.call(lambda ctx: ctx.redis.sadd(keys.run_key(s.run, keys.GC_DELETING), 99))
        with pytest.raises(errors.Unavailable):
            p.call(gc.collect_all)
        assert _counters(p, s.run).get("lost_total", 0) == 0
        st = p.client(s.run, "viewer").status()  # Redis-only routes keep working through a bucket outage
        assert st.latest_version == 1 and st.queue.groups + st.queue.pending == 2

        bucket.up()
        rest = s.t.claim("trainer-0", max_groups=4).deliveries
        assert len(rest) == 1
        s.g.submit_rollouts(s.batch(1), "k2")  # the refused submit, retried with its key
        rest += s.t.claim("trainer-0", max_groups=4).deliveries
        ids = [d.delivery_id for d in first + rest]
        assert s.t.ack(ids) == 3
        c = _counters(p, s.run)
        assert (c["accepted_total"], c["acked_total"], c.get("lost_total", 0)) == (3, 3, 0), c
        assert s.g.download_adapter(1)
        assert s.t.publish_adapter(2, tar2).version == 2
        assert s.t.download_checkpoint(1) == ckpt1 and s.t.put_checkpoint(2, ckpt2).step == 2
        p.call(gc.collect_all)


def test_a_proxy_started_over_a_replaced_bucket_refuses_to_serve(redis_server: RedisServer, tmp_path: Path) -> None:
    root = tmp_path / "bucket"
    url = f"file://{root}"
    with running(redis_server.url, url, gc_interval_s=0.2) as p:
        s = Setup(p)
        s.g.submit_rollouts(s.batch(1), "k1")
        marker = p.ctx.store.get_bytes(identity.MARKER_KEY)
    root.rename(tmp_path / "bucket.away")  # the volume did not mount: an empty directory in its place

    with running(redis_server.url, url, gc_interval_s=0.2) as p:
        with p.http("admin") as h:
            r = h.get(s.path("/status"))
            # Before the fix: 200, and the run went on into the new, empty bucket.
            assert r.status_code == 503 and r.json()["error"]["code"] == "bucket_identity", r.text
            assert "no identity marker" in r.json()["error"]["message"] and r.headers["Retry-After"]
            r = h.post(
                s.path("/rollouts/claim"), json={"consumer": "t", "max_groups": 1}, headers={"X-Trainer-Epoch": "1"}
            )
            assert r.status_code == 503 and r.json()["error"]["code"] == "bucket_identity"
        with p.http(None) as anon:
            ready = anon.get("/readyz")
            assert ready.status_code == 503 and ready.json()["bucket"].startswith("refused"), ready.text
        assert p.ctx.store.list_keys("") == []  # nothing written into the stand-in bucket

        # Putting the right bucket back is all it takes: the next maintenance pass verifies it again.
        shutil.rmtree(root)
        (tmp_path / "bucket.away").rename(root)
        deadline = time.monotonic() + 30
        while not p.ctx.identity.ok and time.monotonic() < deadline:
            time.sleep(0.1)
        st = p.client(s.run, "viewer").status()
        assert st.latest_version == 1 and st.queue.groups == 1
        assert p.ctx.store.get_bytes(identity.MARKER_KEY) == marker


def test_another_deployments_bucket_is_refused_and_a_wiped_redis_adopts_its_bucket(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    a, b = f"file://{tmp_path / 'a'}", f"file://{tmp_path / 'b'}"
    with running(redis_server.url, b) as p:
        Setup(p, run="other")
    redis_server.wipe()
    redis_server.start()
    with running(redis_server.url, a) as p:
        Setup(p)
        mine = json.loads(p.call(lambda ctx: ctx.redis.get(keys.BUCKET_IDENTITY)))["bucket_id"]
    with running(redis_server.url, b) as p, p.http(None) as anon:
        ready = anon.get("/readyz").json()
        assert ready["bucket"].startswith("refused") and "another deployment" in ready["bucket"], ready

    # A wiped Redis takes the bucket's identity from its marker and is rebuilt from it.
    redis_server.wipe()
    redis_server.start()
    with running(redis_server.url, a) as p:
        assert json.loads(p.call(lambda ctx: ctx.redis.get(keys.BUCKET_IDENTITY)))["bucket_id"] == mine
        assert p.client("r1", "viewer").status().latest_version == 1
