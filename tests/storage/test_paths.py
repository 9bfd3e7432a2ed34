"""Key rules: no key or prefix a client can send escapes the store's root."""

from __future__ import annotations

import pytest

from bucketrl import errors
from bucketrl.storage.paths import join_key, normalize_prefix, validate_key

BAD_KEYS = [
    "",
    "/etc/passwd",
    "../x",
    "runs/../../x",
    "runs/./x",
    "runs//x",
    "runs/x/",
    "runs\\x",
    "runs/x\x00",
    "runs/\nx",
    "runs/.bucketrl-tmp-x",
    "a" * 1025,
]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_bad_keys_are_invalid(key: str) -> None:
    with pytest.raises(errors.Invalid):
        validate_key(key)


@pytest.mark.parametrize("key", ["runs/demo/run.json", "a", ".hidden/x..y", "runs/d/adapters/v1/files/a b.txt"])
def test_good_keys_pass_unchanged(key: str) -> None:
    assert validate_key(key) == key


def test_prefix_is_a_directory() -> None:
    assert normalize_prefix("") == ""
    assert normalize_prefix("runs/a") == "runs/a/"
    assert normalize_prefix("runs/a/") == "runs/a/"
    for bad in ("../runs", "/runs", "runs//"):
        with pytest.raises(errors.Invalid):
            normalize_prefix(bad)


def test_join_key() -> None:
    assert join_key("runs/demo/", "adapters", "v1/") == "runs/demo/adapters/v1"
    with pytest.raises(errors.Invalid):
        join_key("runs", "../x")
