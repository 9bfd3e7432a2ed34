"""Versioned directories (adapters, checkpoints) on both backends: manifest last, nothing partial ever visible."""

from __future__ import annotations

import asyncio
import gzip
import io
import tarfile
from pathlib import Path

import pytest
from pydantic import BaseModel

from bucketrl import errors
from bucketrl.storage import BucketStore
from bucketrl.storage.dirs import (
    Manifest,
    Spooled,
    commit_tar,
    delete_dir,
    get_json,
    iter_bundle,
    list_dirs,
    put_json,
    read_manifest,
    spool_body,
)
from bucketrl.tarball import pack_dir
from tests.storage.helpers import FailingStore, chunked, make_tar, make_tar_with, sha256

PREFIX = "runs/demo/adapters/v1"
MEMBERS = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": bytes(range(256)) * 400}


def spool(data: bytes, max_bytes: int = 10_000_000, **kw) -> Spooled:
    return asyncio.run(spool_body(chunked(data), max_bytes, **kw))


# -- spool_body ---------------------------------------------------------------------------------------
def test_spool_hashes_and_sizes_the_body(tmp_path: Path) -> None:
    data = b"z" * 300_000
    with spool(data, memory_bytes=1024, spool_dir=str(tmp_path)) as spooled:
        assert (spooled.size, spooled.sha256) == (len(data), sha256(data))
        assert spooled.file.read() == data
        assert len(list(tmp_path.iterdir())) == 0  # anonymous temp file: unlinked, in spool_dir, never named
    assert spooled.file.closed


def test_spool_refuses_an_oversized_body_as_soon_as_it_passes_the_limit() -> None:
    pulled = 0
    finished = False

    async def endless():
        nonlocal pulled, finished
        try:
            while True:
                pulled += 1
                yield b"x" * 1000
        finally:
            finished = True

    with pytest.raises(errors.PayloadTooLarge) as info:
        asyncio.run(spool_body(endless(), max_bytes=10_500))
    assert pulled == 11  # stopped at the first chunk over the limit, never read further
    assert finished  # and the producer was closed
    assert "10500" in info.value.message
    exact = spool(b"y" * 10_500, max_bytes=10_500)  # exactly the limit is fine
    assert exact.size == 10_500
    exact.close()


# -- commit_tar round trip ----------------------------------------------------------------------------
def test_commit_round_trip(store: BucketStore) -> None:
    body = make_tar(MEMBERS)
    with spool(body) as spooled:
        manifest = commit_tar(store, PREFIX, spooled, sha256(body), {"version": 1, "run": "demo"})
    assert manifest.bundle.sha256 == sha256(body) and manifest.bundle.size == len(body)
    assert manifest.meta == {"version": 1, "run": "demo"}
    assert {n: (e.size, e.sha256) for n, e in manifest.files.items()} == {
        n: (len(d), sha256(d)) for n, d in MEMBERS.items()
    }
    assert read_manifest(store, PREFIX) == manifest
    for name, data in MEMBERS.items():
        assert store.get_bytes(f"{PREFIX}/files/{name}") == data
    assert b"".join(iter_bundle(store, PREFIX, 1000)) == body  # the exact bytes: same sha256 on GET
    assert store.list_keys(PREFIX)[-1] == f"{PREFIX}/manifest.json"
    assert list_dirs(store, "runs/demo/adapters") == ["v1"]


def test_commit_accepts_real_directory_tars(store: BucketStore, tmp_path: Path) -> None:
    src = tmp_path / "adapter"
    (src / "sub").mkdir(parents=True)
    (src / "a.json").write_bytes(b"{}")
    (src / "sub" / "b.bin").write_bytes(b"\x00" * 5000)
    for i, body in enumerate([pack_dir(src), _tar_cli_style(src)]):  # ours, and `tar -C dir -cf - .` (./ names)
        with spool(body) as spooled:
            manifest = commit_tar(store, f"runs/demo/checkpoints/step-{i}", spooled, sha256(body), {})
        assert sorted(manifest.files) == ["a.json", "sub/b.bin"]
        assert store.get_bytes(f"runs/demo/checkpoints/step-{i}/files/sub/b.bin") == b"\x00" * 5000


def _tar_cli_style(src: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        tar.add(src, arcname=".")
    return buf.getvalue()


def test_recommitting_the_same_bytes_is_a_no_op_and_different_bytes_conflict(store: BucketStore) -> None:
    body = make_tar(MEMBERS)
    with spool(body) as spooled:
        first = commit_tar(store, PREFIX, spooled, sha256(body), {"try": 1})
    with spool(body) as spooled:
        assert commit_tar(store, PREFIX, spooled, sha256(body), {"try": 2}) == first
    other = make_tar({"x": b"different"})
    with spool(other) as spooled, pytest.raises(errors.Conflict):
        commit_tar(store, PREFIX, spooled, sha256(other), {})
    assert read_manifest(store, PREFIX) == first
    assert b"".join(iter_bundle(store, PREFIX)) == body


# -- bad input: refused, nothing written ----------------------------------------------------------------
def test_sha_mismatch_is_refused_and_writes_nothing(store: BucketStore) -> None:
    body = make_tar(MEMBERS)
    with spool(body) as spooled, pytest.raises(errors.Invalid) as info:
        commit_tar(store, PREFIX, spooled, sha256(body + b"!"), {})
    assert info.value.code == "sha256_mismatch" and info.value.status == 422
    with spool(body) as spooled, pytest.raises(errors.Invalid):
        commit_tar(store, PREFIX, spooled, "not-a-sha", {})
    assert store.list_keys("") == []


def _info(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info


HOSTILE = {
    "parent escape": make_tar({"../evil": b"x"}),
    "nested escape": make_tar({"ok/../../evil": b"x"}),
    "absolute": make_tar({"/etc/evil": b"x"}),
    "backslash": make_tar({"a\\b": b"x"}),
    "empty segment": make_tar({"a//b": b"x"}),
    "reserved temp name": make_tar({".bucketrl-tmp-x": b"x"}),
    "symlink": make_tar_with([(_info("link", tarfile.SYMTYPE, "/etc/passwd"), None)]),
    "hardlink": make_tar_with([(_info("a"), b"x"), (_info("b", tarfile.LNKTYPE, "a"), None)]),
    "device": make_tar_with([(_info("dev", tarfile.CHRTYPE), None)]),
    "fifo": make_tar_with([(_info("fifo", tarfile.FIFOTYPE), None)]),
    "duplicate": make_tar_with([(_info("a"), b"1"), (_info("a"), b"2")]),
    "file and dir": make_tar({"a": b"1", "a/b": b"2"}),
    "gzip compressed": gzip.compress(make_tar(MEMBERS)),
    "not a tar": b"hello, this is not a tar archive" * 40,
    "empty body": b"",
    "no files": make_tar({}),
    "truncated": make_tar({"big": b"q" * 50_000})[:20_000],
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_unsafe_or_malformed_tars_are_refused_and_write_nothing(store: BucketStore, case: str) -> None:
    body = HOSTILE[case]
    with spool(body) as spooled, pytest.raises(errors.Invalid) as info:
        commit_tar(store, PREFIX, spooled, sha256(body), {})
    assert info.value.status == 422
    assert store.list_keys("") == []
    assert read_manifest(store, PREFIX) is None


@pytest.mark.parametrize("prefix", ["", "/", "../runs", "runs/../../x", "/abs/v1"])
def test_a_prefix_cannot_escape_or_be_the_root(store: BucketStore, prefix: str) -> None:
    body = make_tar(MEMBERS)
    with spool(body) as spooled, pytest.raises(errors.Invalid):
        commit_tar(store, prefix, spooled, sha256(body), {})
    assert store.list_keys("") == []


def test_meta_that_is_not_json_is_refused_before_writing(store: BucketStore) -> None:
    body = make_tar(MEMBERS)
    with spool(body) as spooled, pytest.raises(errors.Invalid):
        commit_tar(store, PREFIX, spooled, sha256(body), {"bad": object()})
    assert store.list_keys("") == []


# -- crashes ------------------------------------------------------------------------------------------------
def test_a_commit_that_dies_before_the_manifest_stays_invisible_and_a_retry_cleans_up(store: BucketStore) -> None:
    first = make_tar({**MEMBERS, "stale-extra.bin": b"from the crashed attempt"})
    dying = FailingStore(store, fail_on=lambda key: key.endswith("adapter_model.safetensors"))
    with spool(first) as spooled, pytest.raises(errors.Unavailable):
        commit_tar(dying, PREFIX, spooled, sha256(first), {})
    assert store.list_keys(PREFIX)  # debris was written...
    assert read_manifest(store, PREFIX) is None  # ...but the directory does not exist for readers
    assert list_dirs(store, "runs/demo/adapters") == []
    with pytest.raises(errors.NotFound):
        iter_bundle(store, PREFIX)

    dying_at_manifest = FailingStore(store, fail_on=lambda key: key.endswith("manifest.json"))
    with spool(first) as spooled, pytest.raises(errors.Unavailable):
        commit_tar(dying_at_manifest, PREFIX, spooled, sha256(first), {})
    assert read_manifest(store, PREFIX) is None  # every file present, still invisible without the manifest

    retry = make_tar(MEMBERS)
    with spool(retry) as spooled:
        manifest = commit_tar(store, PREFIX, spooled, sha256(retry), {})
    files = [k.removeprefix(f"{PREFIX}/files/") for k in store.list_keys(f"{PREFIX}/files")]
    assert files == sorted(MEMBERS) == sorted(manifest.files)  # the crashed attempt's extra file is gone


# -- reading, listing, deleting ------------------------------------------------------------------------------
def commit(store: BucketStore, prefix: str, members: dict[str, bytes] = MEMBERS) -> Manifest:
    body = make_tar(members)
    with spool(body) as spooled:
        return commit_tar(store, prefix, spooled, sha256(body), {})


def test_list_dirs_shows_committed_children_only_in_natural_order(store: BucketStore) -> None:
    for v in (10, 2, 1):
        commit(store, f"runs/demo/adapters/v{v}", {"f": b"x"})
    store.put_bytes("runs/demo/adapters/v3/files/f", b"uncommitted")  # no manifest: invisible
    commit(store, "runs/demo/adapters-old/v7", {"f": b"x"})  # a sibling prefix, not a child
    commit(store, "runs/demo/adapters/v2/nested", {"f": b"x"})  # a grandchild, not a child
    assert list_dirs(store, "runs/demo/adapters") == ["v1", "v2", "v10"]
    assert list_dirs(store, "runs/demo/nothing-here") == []


def test_delete_dir_removes_the_manifest_first(store: BucketStore) -> None:
    commit(store, PREFIX)
    commit(store, "runs/demo/adapters/v2")
    stuck = FailingStore(store, fail_on=lambda prefix: True, method="delete_prefix")
    with pytest.raises(errors.Unavailable):
        delete_dir(stuck, PREFIX)  # dies after the manifest went, before the files
    assert read_manifest(store, PREFIX) is None and list_dirs(store, "runs/demo/adapters") == ["v2"]
    assert delete_dir(store, PREFIX) == len(MEMBERS) + 1  # files + bundle
    assert store.list_keys(PREFIX) == []
    assert read_manifest(store, "runs/demo/adapters/v2") is not None


def test_a_corrupt_manifest_reads_as_uncommitted(store: BucketStore) -> None:
    commit(store, PREFIX)
    store.put_bytes(f"{PREFIX}/manifest.json", b"{not json")
    assert read_manifest(store, PREFIX) is None


class Spec(BaseModel):
    name: str
    size: int


def test_json_helpers(store: BucketStore) -> None:
    put_json(store, "runs/demo/run.json", Spec(name="demo", size=3))
    assert get_json(store, "runs/demo/run.json") == {"name": "demo", "size": 3}
    assert get_json(store, "runs/demo/run.json", Spec) == Spec(name="demo", size=3)
    put_json(store, "runs/demo/prompts.json", {"b": [1, 2], "a": None})
    assert get_json(store, "runs/demo/prompts.json") == {"a": None, "b": [1, 2]}
    store.put_bytes("runs/demo/garbage.json", b"\xff{")
    with pytest.raises(errors.Invalid):
        get_json(store, "runs/demo/garbage.json")
    with pytest.raises(errors.Invalid):
        get_json(store, "runs/demo/prompts.json", Spec)
    with pytest.raises(errors.NotFound):
        get_json(store, "runs/demo/absent.json")
    with pytest.raises(errors.Invalid):
        put_json(store, "../escape.json", {})


# -- large bodies: the bundle and the members are written at the same time (issue 32) -----------------------
def test_a_large_body_writes_bundle_and_members_at_once_byte_for_byte(store: BucketStore) -> None:
    import os

    from bucketrl.storage import dirs

    members = {"adapter_config.json": b'{"peft_type": "LORA"}', "adapter_model.safetensors": os.urandom(6 << 20)}
    body = make_tar(members)
    assert len(body) >= dirs.PARALLEL_WRITE_BYTES
    with spool(body) as spooled:
        manifest = commit_tar(store, PREFIX, spooled, sha256(body), {})
    assert b"".join(iter_bundle(store, PREFIX)) == body
    for name, data in members.items():
        assert store.get_bytes(f"{PREFIX}/files/{name}") == data
        assert manifest.files[name].sha256 == sha256(data)


def test_a_large_body_whose_bundle_write_fails_is_never_committed(store: BucketStore) -> None:
    import os

    body = make_tar({"adapter_config.json": b"{}", "adapter_model.safetensors": os.urandom(6 << 20)})
    dying = FailingStore(store, fail_on=lambda key: key.endswith("bundle.tar"))
    with spool(body) as spooled, pytest.raises(errors.Unavailable):
        commit_tar(dying, PREFIX, spooled, sha256(body), {})
    assert read_manifest(store, PREFIX) is None
