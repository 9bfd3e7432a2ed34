"""S3-only behaviour, against real moto S3 HTTP servers: multipart, prefixes, batching, outages."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator

import boto3
import pytest

from bucketrl import errors
from bucketrl.storage.s3 import S3Store
from tests.support.services import MotoServer

MiB = 1024 * 1024


def raw_client(endpoint: str):
    return boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="t", aws_secret_access_key="t"
    )


class _Source(io.RawIOBase):
    """A non-seekable stream; runs ``on_read`` once after the first part went out, may fail at ``fail_at``."""

    def __init__(self, data: bytes, on_read=None, fail_at: int | None = None) -> None:
        self._buf = io.BytesIO(data)
        self._on_read = on_read
        self._fail_at = fail_at
        self.served = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        if self._fail_at is not None and self.served >= self._fail_at:
            raise RuntimeError("source died mid-upload")
        if self._on_read is not None and self.served >= 5 * MiB:
            self._on_read()
            self._on_read = None
        chunk = self._buf.read(len(b))
        b[: len(chunk)] = chunk
        self.served += len(chunk)
        return len(chunk)


def test_large_objects_go_up_as_multipart_and_stay_invisible_until_completed(
    moto_server: MotoServer, bucket: str
) -> None:
    store = S3Store(bucket, "pfx", multipart_threshold=1 * MiB, multipart_chunksize=5 * MiB)
    data = (b"0123456789abcdef" * (MiB // 16)) * 6 + b"tail"  # 6 MiB + 4 bytes -> parts of 5 MiB and 1 MiB
    client = raw_client(moto_server.endpoint)
    during: list[tuple[bool, int]] = []

    def look() -> None:
        # The transfer manager opens the multipart upload on a worker thread, possibly after the first part was
        # read: wait for it to appear (the key must stay invisible all the while).
        deadline = time.monotonic() + 10
        uploads = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        while not uploads and time.monotonic() < deadline:
            time.sleep(0.05)
            uploads = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        during.append((store.exists("ckpt/big.bin"), len(uploads)))

    store.put_file("ckpt/big.bin", _Source(data, on_read=look), None)
    assert during == [(False, 1)]  # a multipart upload was open and the key was not visible yet
    assert store.get_bytes("ckpt/big.bin") == data
    etag = client.head_object(Bucket=bucket, Key="pfx/ckpt/big.bin")["ETag"]
    assert etag.strip('"').endswith("-2")  # S3 marks multipart objects' ETags with their part count

    store.put_file("ckpt/sized.bin", io.BytesIO(data), len(data))  # known size over the threshold
    assert client.head_object(Bucket=bucket, Key="pfx/ckpt/sized.bin")["ETag"].strip('"').endswith("-2")
    assert b"".join(store.iter_chunks("ckpt/sized.bin", 1 * MiB)) == data

    store.put_file("ckpt/small.bin", io.BytesIO(b"s" * 1000), 1000)  # below the threshold: one PUT
    assert "-" not in client.head_object(Bucket=bucket, Key="pfx/ckpt/small.bin")["ETag"]


def test_a_failed_multipart_upload_is_aborted_and_leaves_the_old_object(moto_server: MotoServer, bucket: str) -> None:
    store = S3Store(bucket, "", multipart_threshold=1 * MiB, multipart_chunksize=5 * MiB)
    store.put_bytes("obj", b"old")
    with pytest.raises((RuntimeError, errors.Unavailable)):
        store.put_file("obj", _Source(b"x" * (12 * MiB), fail_at=6 * MiB), None)
    assert store.get_bytes("obj") == b"old"
    assert raw_client(moto_server.endpoint).list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_prefixes_isolate_stores_in_one_bucket(moto_server: MotoServer, bucket: str) -> None:
    one, two = S3Store(bucket, "one"), S3Store(bucket, "two/nested")
    one.put_bytes("runs/x", b"1")
    two.put_bytes("runs/x", b"2")
    assert one.list_keys("") == ["runs/x"] and one.get_bytes("runs/x") == b"1"
    assert two.delete_prefix("") == 1
    assert one.get_bytes("runs/x") == b"1"
    listed = raw_client(moto_server.endpoint).list_objects_v2(Bucket=bucket)["Contents"]
    assert [o["Key"] for o in listed] == ["one/runs/x"]


def test_delete_goes_in_batches(bucket: str) -> None:
    store = S3Store(bucket, "p")
    calls: list[int] = []

    def count(params: dict, **_: object) -> None:
        calls.append(len(params["Delete"]["Objects"]))

    store._client.meta.events.register("provide-client-params.s3.DeleteObjects", count)
    store.delete_batch = 2
    keys = [f"k/{i}" for i in range(5)]
    for key in keys:
        store.put_bytes(key, b"x")
    store.delete([*keys, "k/absent"])
    assert calls == [2, 2, 2]
    assert store.list_keys("") == []


def test_list_keys_paginates(bucket: str) -> None:
    store = S3Store(bucket, "p")
    store.list_page_size = 3
    pages: list[int] = []
    store._client.meta.events.register("after-call.s3.ListObjectsV2", lambda **kw: pages.append(1))
    keys = [f"k/{i:02d}" for i in range(8)]
    for key in keys:
        store.put_bytes(key, b"x")
    assert store.list_keys("k") == keys
    assert len(pages) == 3


@pytest.fixture()
def own_moto() -> Iterator[MotoServer]:
    """A moto server this test may stop (the session one is shared)."""
    server = MotoServer().start()
    yield server
    server.stop()


def test_an_unreachable_endpoint_is_unavailable_never_a_botocore_error(own_moto: MotoServer) -> None:
    own_moto.create_bucket("outage")
    store = S3Store("outage", "p", endpoint_url=own_moto.endpoint)
    store.check()
    store.put_bytes("k", b"v")
    own_moto.stop()

    started = time.monotonic()
    with pytest.raises(errors.Unavailable) as info:
        store.check()
    assert time.monotonic() - started < 5  # a readiness probe answers quickly
    assert info.value.retryable and "BUCKETRL_S3_ENDPOINT_URL" in info.value.message
    for call in (
        lambda: store.get_bytes("k"),
        lambda: store.iter_chunks("k"),
        lambda: store.exists("k"),
        lambda: store.list_keys(""),
        lambda: store.put_bytes("k", b"v"),
        lambda: store.delete(["k"]),
    ):
        with pytest.raises(errors.Unavailable):
            call()


def test_a_missing_bucket_is_unavailable_and_names_the_setting(moto_server: MotoServer) -> None:
    store = S3Store("no-such-bucket-here", "p")
    with pytest.raises(errors.Unavailable) as info:
        store.check()
    assert "BUCKETRL_BUCKET_URL" in info.value.message
    with pytest.raises(errors.Unavailable):
        store.get_bytes("k")  # not NotFound: the key is not the problem, the bucket is
