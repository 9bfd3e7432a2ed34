"""Adapters straight from the bucket: the home proxy (over a real moto S3) answers a download that asks for it
with a 307 to a presigned URL; a generator's client that asks (``BUCKETRL_PRESIGNED_ADAPTERS``) and a relay started
with ``--presigned`` read the tar from that URL, carrying no bucket credentials and none of the proxy's bandwidth;
the bytes are still checked against the sha256."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bucketrl.client import Outage, ProxyClient
from bucketrl.settings import WorkerSettings
from tests.proxy.harness import TOKENS, ProxyHarness, adapter_tar, make_spec, running
from tests.relay.test_relay import RelayProc
from tests.support.services import MotoServer, RedisServer, free_port

GEN = {"Authorization": f"Bearer {TOKENS['generator']}"}


@pytest.fixture()
def s3_home(redis_server: RedisServer, moto_server: MotoServer) -> Iterator[ProxyHarness]:
    name = f"b-{uuid.uuid4().hex[:12]}"
    moto_server.create_bucket(name)
    with running(redis_server.url, f"s3://{name}/prefix", presign_adapters_s=300) as h:
        yield h


def test_a_presigned_download_reads_the_bucket_without_credentials(s3_home: ProxyHarness, tmp_path: Path) -> None:
    tar = adapter_tar(1, 1 << 20)
    with ProxyClient(s3_home.url, "r1", TOKENS["trainer"], retries=0) as t:
        t.put_run(make_spec(max_staleness=64))
        t.register_trainer("t0")
        t.publish_adapter(1, tar)
    sha = hashlib.sha256(tar).hexdigest()
    with httpx.Client(base_url=s3_home.url, timeout=30) as h:
        r = h.get("/v1/runs/r1/adapters/1", headers={**GEN, "X-Bucketrl-Presign": "1"})
        assert r.status_code == 307 and r.headers["X-Content-SHA256"] == sha
        assert "Signature" in r.headers["Location"] or "X-Amz-Signature" in r.headers["Location"]
        assert httpx.get(r.headers["Location"], timeout=30).content == tar  # no token, no bucket keys
        # Without the header (every worker today) the proxy serves the bytes itself; the token is checked first.
        assert h.get("/v1/runs/r1/adapters/1", headers=GEN).content == tar
        assert h.get("/v1/runs/r1/adapters/1", headers={"X-Bucketrl-Presign": "1"}).status_code == 401

    # A generator that asks (BUCKETRL_PRESIGNED_ADAPTERS=1): the bytes from the bucket, checked like the proxy's.
    seen: list[tuple[str, bool]] = []
    with ProxyClient(s3_home.url, "r1", TOKENS["generator"], retries=0) as g:
        g._http.event_hooks["response"] = [
            lambda r: seen.append((str(r.status_code), "authorization" in r.request.headers))
        ]
        g.presigned = True
        assert g.download_adapter(1) == tar
    assert seen == [("307", True)]  # the proxy's answer; the bucket read is another client, with no token
    with WorkerSettings(proxy_url=s3_home.url, run="r1", presigned_adapters=True).proxy_client(Outage(5.0)) as w:
        assert w.presigned

    relay = RelayProc(s3_home.url, tmp_path / "cache", free_port(), args=("--presigned",)).start()
    try:
        with ProxyClient(relay.url, "r1", TOKENS["generator"], retries=0) as g:
            assert g.download_adapter(1) == tar
            assert g.download_adapter(1) == tar
        stats = relay.stats()
        assert (stats["upstream_fetches"], stats["bucket_fetches"], stats["hits"]) == (1, 1, 1), stats
    finally:
        relay.kill()
