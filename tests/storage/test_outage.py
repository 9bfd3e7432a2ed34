"""A bucket outage is Unavailable, never NotFound: every backend, every method, and nothing recreates the bucket.

The file backend's outage is its root directory gone (renamed away: an unmounted volume looks the same); the
S3 backend's is the endpoint refusing connections or answering 5xx (a :class:`TcpGate` in front of moto, so
the objects survive the outage as they would on a real store).
"""

from __future__ import annotations

import io
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bucketrl import errors
from bucketrl.storage import BucketStore
from bucketrl.storage.file import FileStore
from bucketrl.storage.s3 import S3Store
from tests.support.faults import TcpGate
from tests.support.services import MotoServer

Outage = tuple[BucketStore, Callable[[], None], Callable[[], None]]


@pytest.fixture(params=["file", "s3-refused", "s3-5xx"])
def outage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Outage]:
    """(store, down, up) for each kind of outage."""
    if request.param == "file":
        root = tmp_path / "bucket"
        store = FileStore(root)
        away = tmp_path / "bucket.away"
        yield store, lambda: root.rename(away), lambda: away.rename(root)
        return
    moto: MotoServer = request.getfixturevalue("moto_server")
    name = f"o-{uuid.uuid4().hex[:12]}"
    moto.create_bucket(name)
    gate = TcpGate(moto.port).start()
    mode = "refuse" if request.param == "s3-refused" else "error"
    store = S3Store(name, "p", endpoint_url=gate.endpoint, connect_timeout_s=2.0, read_timeout_s=5.0, max_attempts=1)
    try:
        yield store, lambda: gate.set_mode(mode), lambda: gate.set_mode("open")  # type: ignore[arg-type]
    finally:
        gate.stop()


def test_every_method_is_unavailable_during_an_outage_and_works_after(outage: Outage) -> None:
    store, down, up = outage
    store.put_bytes("runs/r/a/obj", b"committed")
    store.put_bytes("runs/r/b/obj", b"doomed")
    down()
    calls: dict[str, Callable[[], object]] = {
        "get_bytes": lambda: store.get_bytes("runs/r/a/obj"),
        "get_bytes of an absent key": lambda: store.get_bytes("runs/r/nope"),
        "iter_chunks": lambda: store.iter_chunks("runs/r/a/obj"),
        "exists": lambda: store.exists("runs/r/a/obj"),
        "exists of an absent key": lambda: store.exists("runs/r/nope"),
        "list_keys": lambda: store.list_keys("runs/r"),
        "list_keys of the whole store": lambda: store.list_keys(""),
        "put_bytes": lambda: store.put_bytes("runs/r/c/obj", b"new"),
        "put_file": lambda: store.put_file("runs/r/c/obj", io.BytesIO(b"new"), 3),
        "delete": lambda: store.delete(["runs/r/b/obj"]),
        "delete_prefix": lambda: store.delete_prefix("runs/r/b"),
        "check": store.check,
    }
    for what, call in calls.items():
        # Before the fix: NotFound, False, [], a recreated empty root, NotADirectoryError out of delete_prefix.
        with pytest.raises(errors.Unavailable):
            call()
            pytest.fail(f"{what} did not raise during the outage")
    if isinstance(store, FileStore):
        assert not store.root.exists(), "an operation during the outage created an empty bucket in its place"
    up()
    assert store.get_bytes("runs/r/a/obj") == b"committed"
    assert store.list_keys("runs/r") == ["runs/r/a/obj", "runs/r/b/obj"]  # the deletes did not happen
    assert not store.exists("runs/r/c/obj")
    assert store.delete_prefix("runs/r/b") == 1 and store.list_keys("runs/r") == ["runs/r/a/obj"]
    with pytest.raises(errors.NotFound):
        store.get_bytes("runs/r/nope")
    store.check()


def test_file_root_replaced_by_a_file_is_unavailable(tmp_path: Path) -> None:
    root = tmp_path / "bucket"
    store = FileStore(root)
    store.put_bytes("runs/r/x", b"1")
    root.rename(tmp_path / "away")
    root.write_bytes(b"not a directory")
    for call in (lambda: store.get_bytes("runs/r/x"), lambda: store.delete_prefix("runs/r"), store.check):
        with pytest.raises(errors.Unavailable):
            call()


def test_a_missing_prefix_under_a_present_root_is_just_empty(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "bucket")
    assert store.list_keys("runs/none") == [] and not store.exists("runs/none/x")
    assert store.delete_prefix("runs/none") == 0
    with pytest.raises(errors.NotFound):
        store.get_bytes("runs/none/x")


@pytest.mark.slow  # real processes for seconds: make test, not make test-fast
def test_an_s3_endpoint_that_stopped_answering_times_out_as_unavailable(moto_server: MotoServer) -> None:
    name = f"t-{uuid.uuid4().hex[:12]}"
    moto_server.create_bucket(name)
    gate = TcpGate(moto_server.port).start()
    store = S3Store(name, "p", endpoint_url=gate.endpoint, connect_timeout_s=1.0, read_timeout_s=1.0, max_attempts=1)
    try:
        store.put_bytes("k", b"v")
        gate.set_mode("hang")
        for call in (lambda: store.get_bytes("k"), lambda: store.exists("nope"), lambda: store.put_bytes("j", b"w")):
            with pytest.raises(errors.Unavailable):
                call()
        gate.set_mode("open")
        assert store.get_bytes("k") == b"v" and not store.exists("j")
    finally:
        gate.stop()
