"""The S3 backend's endpoint, addressing style and region settings (issue 33) against the moto S3 test server,
through a loopback front that records what went over the wire (tests/storage/s3_front.py):

- a Hugging Face Storage Bucket's documented settings (endpoint ``https://s3.hf.co/<namespace>``, path style,
  region us-east-1), the namespace carried in the endpoint's path as the gateway expects;
- path and virtual-hosted style side by side: virtual puts the bucket in the host name (``<bucket>.localhost``),
  reached through the front as the client's HTTP proxy, since this machine's resolver has no rule for
  ``*.localhost`` (the front's docstring says why that is the honest way here);
- a mistake in a setting is one clear error naming it, in the library and from ``bucketrl proxy``.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import boto3
import botocore.config
import httpx
import pytest

from bucketrl import errors
from bucketrl.storage import open_store
from bucketrl.storage.s3 import S3Store
from tests.storage.s3_front import S3Front
from tests.support.services import MotoServer, free_port

MiB = 1024 * 1024


@pytest.fixture()
def env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    # The region the environment names is not the one the setting asks for: the setting must win.
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-central-1")
    for name in ("NO_PROXY", "no_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch


def exercise(store: S3Store) -> list[str]:
    """Every kind of call the proxy makes: single and multipart writes, reads, listing, existence, presigned
    reads, deletes. Returns the keys written (as the bucket holds them)."""
    store.put_bytes("runs/r/run.json", b"{}")
    big = os.urandom(6 * MiB)
    store.put_file("runs/r/checkpoints/step-1/state.tar", io.BytesIO(big), len(big))  # 2 parts of 5 + 1 MiB
    assert store.get_bytes("runs/r/run.json") == b"{}"
    assert b"".join(store.iter_chunks("runs/r/checkpoints/step-1/state.tar")) == big
    assert store.list_keys("runs/r/") == ["runs/r/checkpoints/step-1/state.tar", "runs/r/run.json"]
    assert store.exists("runs/r/run.json") and not store.exists("runs/r/nothing")
    with pytest.raises(errors.NotFound):
        store.get_bytes("runs/r/nothing")
    url = store.presign_get("runs/r/run.json", 60)
    store.put_bytes("runs/r/tmp", b"x")
    store.delete(["runs/r/tmp"])
    assert not store.exists("runs/r/tmp")
    store.check()
    return [url]


def raw_keys(moto: MotoServer, bucket: str) -> list[str]:
    s3 = boto3.client(
        "s3", endpoint_url=moto.endpoint, region_name="us-east-1", aws_access_key_id="t", aws_secret_access_key="t",
        config=botocore.config.Config(proxies={}),  # straight to moto, whatever HTTP_PROXY says
    )  # fmt: skip
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", []))


def test_a_hugging_face_bucket_with_its_documented_settings(
    moto_server: MotoServer, bucket: str, env: pytest.MonkeyPatch
) -> None:
    with S3Front(moto_server.port, namespace="my-org") as gateway:
        # As the Hugging Face docs give them (with the gateway's URL on loopback), set the way a deployment does.
        env.setenv("BUCKETRL_S3_ENDPOINT_URL", f"{gateway.url}/my-org")
        env.setenv("BUCKETRL_S3_ADDRESSING_STYLE", "path")
        env.setenv("BUCKETRL_S3_REGION", "us-east-1")
        store = open_store(f"s3://{bucket}/bucketrl")
        assert isinstance(store, S3Store)
        store.multipart_threshold = 1 * MiB
        store.transfer_config.multipart_threshold = 1 * MiB
        store.transfer_config.multipart_chunksize = 5 * MiB
        (url,) = exercise(store)
        assert url.startswith(f"{gateway.url}/my-org/{bucket}/bucketrl/runs/r/run.json?")
        assert httpx.get(url).content == b"{}"  # a presigned read: no credentials, through the same gateway
    seen = gateway.seen
    assert {s.host for s in seen} == {f"127.0.0.1:{gateway.port}"}
    assert all(s.path.startswith(f"/my-org/{bucket}") for s in seen), [s.path for s in seen]
    assert any("uploadId=" in s.path for s in seen), "no multipart upload went through"
    signed = [s.scope for s in seen if s.scope]
    assert signed and all(scope.endswith("/us-east-1/s3/aws4_request") for scope in signed), set(signed)
    assert raw_keys(moto_server, bucket) == ["bucketrl/runs/r/checkpoints/step-1/state.tar", "bucketrl/runs/r/run.json"]


@pytest.mark.parametrize("style", ["path", "virtual"])
def test_path_and_virtual_hosted_style(
    moto_server: MotoServer, bucket: str, env: pytest.MonkeyPatch, style: str
) -> None:
    with S3Front(moto_server.port) as resolver:
        # The client's proxy: it resolves *.localhost to loopback (RFC 6761), which this machine's resolver does not.
        env.setenv("HTTP_PROXY", resolver.url)
        env.setenv("http_proxy", resolver.url)
        endpoint = f"http://localhost:{moto_server.port}"
        store = S3Store(
            bucket, "pfx", endpoint_url=endpoint, addressing_style=style, region="us-east-1",
            multipart_threshold=1 * MiB, multipart_chunksize=5 * MiB,
        )  # fmt: skip
        (url,) = exercise(store)
        assert httpx.get(url, proxy=resolver.url).content == b"{}"
    hosts, paths = {s.host for s in resolver.seen}, [s.path for s in resolver.seen]
    if style == "virtual":
        assert hosts == {f"{bucket}.localhost:{moto_server.port}"}, hosts
        assert not any(p.startswith(f"/{bucket}") for p in paths), paths
        assert url.startswith(f"http://{bucket}.localhost:{moto_server.port}/pfx/runs/r/run.json?")
    else:
        assert hosts == {f"localhost:{moto_server.port}"}, hosts
        assert all(p.startswith(f"/{bucket}") for p in paths), paths
    assert raw_keys(moto_server, bucket) == ["pfx/runs/r/checkpoints/step-1/state.tar", "pfx/runs/r/run.json"]


def test_a_host_outside_localhost_is_never_contacted(moto_server: MotoServer) -> None:
    with S3Front(moto_server.port) as resolver:
        r = httpx.get("http://bucket.s3.amazonaws.com/key", proxy=resolver.url)
    assert r.status_code == 403 and resolver.seen == []


@pytest.mark.parametrize(
    ("name", "value"),
    [("BUCKETRL_S3_ADDRESSING_STYLE", "sideways"), ("BUCKETRL_S3_ENDPOINT_URL", "s3.hf.co/my-org")],
)
def test_a_bad_s3_setting_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(errors.Invalid, match=name):
        open_store("s3://my-bucket/p")
    # As an operator meets it: `bucketrl proxy` refuses to start and says which setting.
    env = {**os.environ, "BUCKETRL_BUCKET_URL": "s3://my-bucket/p", "BUCKETRL_TOKENS": "admin:" + "a" * 24,
           "BUCKETRL_REDIS_URL": "redis://127.0.0.1:1/0", name: value}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "bucketrl.cli", "proxy", "--host", "127.0.0.1", "--port", str(free_port())],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and name in out and "Traceback" not in out, out[-2000:]
