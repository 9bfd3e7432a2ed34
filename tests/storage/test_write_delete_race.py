"""Writes and deletes racing in one prefix never fail (the proxy does exactly that: submits write rollout
batches while acks delete settled ones, and the file backend prunes a directory as it empties)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from bucketrl import errors
from bucketrl.storage import BucketStore
from bucketrl.storage.file import FileStore


def test_concurrent_writes_and_deletes_in_one_prefix(store: BucketStore) -> None:
    failures: list[str] = []
    written = [0]
    deadline = time.monotonic() + 1.5

    def worker(i: int) -> None:
        n = 0
        while time.monotonic() < deadline:
            key = f"runs/r/rollouts/w{i}-{n}"
            try:
                store.put_bytes(key, b"x")
                assert store.get_bytes(key) == b"x"
                store.delete([key])
            except errors.BucketRLError as exc:
                failures.append(f"{key}: {exc}")
            n += 1
        written[0] += n

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert written[0] > 0 and failures == []
    assert store.list_keys("runs/") == []


def test_directory_pruned_inside_mkdir_is_created_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The narrow window of the race above, made certain: ``Path.mkdir(exist_ok=True)`` raises FileExistsError
    when the directory exists at its ``mkdir`` but a concurrent prune removed it before its ``is_dir`` check.
    (Python's own behaviour, injected once here because the real window is microseconds wide.)"""
    store = FileStore(tmp_path / "bucket")
    real_mkdir = Path.mkdir
    raised = []

    def mkdir_losing_the_race(self: Path, *args: object, **kwargs: object) -> None:
        if not raised and self.name == "rollouts":
            raised.append(self)
            raise FileExistsError(17, "File exists", str(self))
        real_mkdir(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "mkdir", mkdir_losing_the_race)
    store.put_bytes("runs/r/rollouts/b1", b"batch")
    assert raised and store.get_bytes("runs/r/rollouts/b1") == b"batch"
    # A file squatting on the directory's path is still a clear error, after the retries.
    monkeypatch.setattr(Path, "mkdir", real_mkdir)
    (tmp_path / "bucket/runs/blocked").write_bytes(b"not a directory")
    with pytest.raises(errors.Unavailable, match="cannot create"):
        store.put_bytes("runs/blocked/obj", b"x")
