"""open_store: the one factory; a bad BUCKETRL_BUCKET_URL is a clear Invalid that names the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from bucketrl import errors
from bucketrl.storage import open_store
from bucketrl.storage.file import FileStore
from bucketrl.storage.s3 import S3Store
from tests.support.services import MotoServer


@pytest.mark.parametrize(
    ("url", "hint"),
    [
        ("", "empty"),
        ("file://relative/dir", "three slashes"),
        ("file:relative/dir", "absolute"),
        ("file:///", "absolute"),
        ("file:///tmp/../etc", ".."),
        ("file:///tmp/x?mode=rw", "query"),
        ("/var/lib/bucket", "did you mean file:///var/lib/bucket"),
        ("gs://bucket/x", "unsupported scheme"),
        ("s3://Not_A_Bucket/x", "bucket name"),
        ("s3://key:secret@bucket/x", "AWS_ACCESS_KEY_ID"),
        ("s3://bucket/../x", "invalid prefix"),
        ("s3://bucket//x", "invalid prefix"),
    ],
)
def test_bad_urls_are_invalid_and_name_the_setting(url: str, hint: str) -> None:
    with pytest.raises(errors.Invalid) as info:
        open_store(url)
    assert "BUCKETRL_BUCKET_URL" in info.value.message
    assert hint in info.value.message


def test_file_urls(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/bucket/")
    assert isinstance(store, FileStore)
    assert store.url == f"file://{tmp_path}/bucket"
    assert isinstance(open_store(f"file://localhost{tmp_path}"), FileStore)
    spaced = open_store(f"file://{tmp_path}/with%20space")
    spaced.put_bytes("k", b"v")
    assert (tmp_path / "with space" / "k").read_bytes() == b"v"


def test_file_store_on_an_unusable_path_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_bytes(b"")
    store = open_store(f"file://{tmp_path}/a-file/bucket")
    with pytest.raises(errors.Unavailable) as info:
        store.check()
    assert "BUCKETRL_BUCKET_URL" in info.value.message
    with pytest.raises(errors.Unavailable):
        store.put_bytes("k", b"v")


def test_s3_urls_and_endpoint_precedence(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store("s3://my-bucket/some/prefix/")
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix, store.url) == ("my-bucket", "some/prefix/", "s3://my-bucket/some/prefix")
    assert store.endpoint_url == moto_server.endpoint  # from BUCKETRL_S3_ENDPOINT_URL
    assert open_store("s3://my-bucket").url == "s3://my-bucket"
    explicit = open_store("s3://my-bucket", s3_endpoint_url="http://127.0.0.1:1")
    assert explicit.endpoint_url == "http://127.0.0.1:1"  # the explicit argument wins over the env var
