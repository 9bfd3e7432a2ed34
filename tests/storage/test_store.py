"""The BucketStore contract, on both backends (file:// and a real S3 HTTP endpoint)."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import pytest

from bucketrl import errors
from bucketrl.storage import BucketStore


def test_round_trip_bytes_and_chunks(store: BucketStore) -> None:
    data = bytes(range(256)) * 1000
    store.put_bytes("runs/demo/blob.bin", data)
    assert store.exists("runs/demo/blob.bin")
    assert store.get_bytes("runs/demo/blob.bin") == data
    chunks = list(store.iter_chunks("runs/demo/blob.bin", chunk_size=10_000))
    assert b"".join(chunks) == data
    assert max(len(c) for c in chunks) <= 10_000 and len(chunks) >= 26

    store.put_file("runs/demo/file.bin", io.BytesIO(data), len(data))
    assert store.get_bytes("runs/demo/file.bin") == data
    store.put_file("runs/demo/nosize.bin", io.BytesIO(b"abc"))
    assert store.get_bytes("runs/demo/nosize.bin") == b"abc"

    store.put_bytes("runs/demo/blob.bin", b"short")  # an overwrite replaces the whole object
    assert store.get_bytes("runs/demo/blob.bin") == b"short"
    store.put_bytes("runs/demo/empty", b"")
    assert store.get_bytes("runs/demo/empty") == b""


def test_missing_key_is_not_found_before_streaming(store: BucketStore) -> None:
    assert not store.exists("runs/nope")
    with pytest.raises(errors.NotFound):
        store.get_bytes("runs/nope")
    with pytest.raises(errors.NotFound):
        store.iter_chunks("runs/nope")  # raised by the call itself, before a response starts streaming
    store.put_bytes("runs/dir/child", b"x")
    assert not store.exists("runs/dir")  # a "directory" is not an object
    with pytest.raises(errors.NotFound):
        store.get_bytes("runs/dir")


def test_list_keys_is_recursive_sorted_and_prefix_is_a_directory(store: BucketStore) -> None:
    for key in ("runs/a/2", "runs/a/1", "runs/a/sub/3", "runs/ab/4", "other/5"):
        store.put_bytes(key, b"x")
    assert store.list_keys("runs/a") == ["runs/a/1", "runs/a/2", "runs/a/sub/3"]
    assert store.list_keys("runs/a/") == ["runs/a/1", "runs/a/2", "runs/a/sub/3"]
    assert store.list_keys("") == ["other/5", "runs/a/1", "runs/a/2", "runs/a/sub/3", "runs/ab/4"]
    assert store.list_keys("runs/zzz") == []


def test_delete_and_delete_prefix(store: BucketStore) -> None:
    for key in ("runs/a/1", "runs/a/sub/2", "runs/ab/3", "runs/b/4"):
        store.put_bytes(key, b"x")
    store.delete(["runs/b/4", "runs/b/absent"])  # absent keys are ignored
    assert not store.exists("runs/b/4")
    assert store.delete_prefix("runs/a") == 2
    assert store.list_keys("") == ["runs/ab/3"]  # the sibling with a longer name survives
    assert store.delete_prefix("runs/a") == 0


@pytest.mark.parametrize("key", ["../escape", "/abs", "runs/../../escape", "runs//x", "runs\\x"])
def test_bad_keys_are_refused_by_every_method_and_write_nothing(
    store: BucketStore, bucket_url: str, tmp_path: Path, key: str
) -> None:
    calls = [
        lambda: store.put_bytes(key, b"x"),
        lambda: store.put_file(key, io.BytesIO(b"x"), 1),
        lambda: store.get_bytes(key),
        lambda: store.iter_chunks(key),
        lambda: store.exists(key),
        lambda: store.delete([key]),
        lambda: store.list_keys(key),
        lambda: store.delete_prefix(key),
    ]
    for call in calls:
        with pytest.raises(errors.Invalid):
            call()
    assert store.list_keys("") == []
    if bucket_url.startswith("file://"):
        assert not (tmp_path / "escape").exists() and not Path("/abs").exists()


class _Watcher(io.RawIOBase):
    """A source stream that, while the store is consuming it, checks what a concurrent reader sees."""

    def __init__(self, data: bytes, on_read) -> None:
        self._buf = io.BytesIO(data)
        self._on_read = on_read
        self.reads = 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if self.reads == 1:  # after the first chunk went out, the write is in progress
            self._on_read()
        self.reads += 1
        return self._buf.read(n)

    def readinto(self, b) -> int:  # type: ignore[override]
        chunk = self.read(len(b))
        b[: len(chunk)] = chunk
        return len(chunk)


def test_an_object_in_flight_is_invisible_until_complete(store: BucketStore) -> None:
    key = "runs/demo/big.bin"
    old, new = b"o" * 300_000, b"n" * 3_000_000
    store.put_bytes(key, old)
    seen: list[bytes] = []
    listed: list[list[str]] = []

    def look() -> None:
        seen.append(store.get_bytes(key))
        listed.append(store.list_keys("runs/demo"))

    src = _Watcher(new, look)
    store.put_file(key, src, None)  # size unknown: the streaming path on both backends
    assert src.reads >= 2  # the check ran mid-write (S3 reads a below-threshold stream in one go)
    assert seen == [old]  # mid-write, readers get the previous object, whole
    assert listed == [[key]]  # and no temp file or partial object is listed
    assert store.get_bytes(key) == new


def test_a_failed_write_leaves_the_previous_object_and_no_debris(store: BucketStore, bucket_url: str) -> None:
    key = "runs/demo/obj"
    store.put_bytes(key, b"old")

    class Boom(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def readinto(self, b) -> int:  # type: ignore[override]
            raise RuntimeError("source died mid-stream")

    with pytest.raises((RuntimeError, errors.Unavailable)):
        store.put_file(key, Boom(), None)
    assert store.get_bytes(key) == b"old"
    assert store.list_keys("") == [key]
    if bucket_url.startswith("file://"):
        root = Path(bucket_url.removeprefix("file://"))
        assert sorted(p.name for p in (root / "runs/demo").iterdir()) == ["obj"]  # temp file removed


def test_concurrent_readers_only_ever_see_whole_objects(store: BucketStore) -> None:
    key = "runs/demo/flip"
    versions = [bytes([65 + i]) * (200_000 + 50_000 * i) for i in range(3)]
    store.put_bytes(key, versions[0])
    stop = threading.Event()
    torn: list[int] = []
    reads = 0

    def reader() -> None:
        nonlocal reads
        while not stop.is_set():
            data = store.get_bytes(key)
            reads += 1
            if data not in versions:
                torn.append(len(data))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(30):
            store.put_bytes(key, versions[i % 3])
    finally:
        stop.set()
        thread.join()
    assert reads > 0 and torn == []


def test_check_passes_on_a_reachable_store(store: BucketStore) -> None:
    store.check()
    assert store.list_keys("") == []  # the probe object is cleaned up
