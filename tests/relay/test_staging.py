"""Staged publish between a real proxy (with a relay token) and a real relay subprocess: an upload's bytes reach the
relay while the trainer is still sending them, and only a committed version's are ever served.

A trainer's upload is held half sent (its body's second half waits for ``go``), so "the relay has bytes before
the commit" is shown by cause, not by timing: the commit cannot have happened while the body is incomplete."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bucketrl import errors
from bucketrl.client import ProxyClient
from tests.proxy.harness import TOKENS, TOKENS_ENV, ProxyHarness, adapter_tar, make_spec, running
from tests.relay.test_relay import RelayProc
from tests.support.services import RedisServer, free_port

RELAY_TOKEN = "tok-relay-0123456789"


@pytest.fixture()
def home(redis_server: RedisServer, tmp_path: Path) -> Iterator[ProxyHarness]:
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}", tokens=f"{TOKENS_ENV},relay:{RELAY_TOKEN}") as h:
        yield h


@pytest.fixture()
def relay(home: ProxyHarness, tmp_path: Path) -> Iterator[RelayProc]:
    r = RelayProc(home.url, tmp_path / "relay-cache", free_port(), env={"BUCKETRL_RELAY_STAGING_TOKEN": RELAY_TOKEN})
    try:
        yield r.start()
    finally:
        r.kill()


class HeldUpload:
    """A trainer's PUT of ``tar`` as version ``version``, its second half sent only once ``go`` is set."""

    def __init__(self, home: ProxyHarness, trainer: ProxyClient, version: int, tar: bytes) -> None:
        self.tar, self.go, self.status = tar, threading.Event(), 0
        self.sha = hashlib.sha256(tar).hexdigest()
        headers = trainer._fence({"Content-Type": "application/x-tar", "X-Content-SHA256": self.sha})
        headers |= {"Authorization": f"Bearer {TOKENS['trainer']}", "Content-Length": str(len(tar))}
        url = f"{home.url}/v1/runs/{trainer.run}/adapters/{version}"
        self.thread = threading.Thread(target=self._put, args=(url, headers), daemon=True)
        self.thread.start()

    def _body(self) -> Iterator[bytes]:
        yield self.tar[: len(self.tar) // 2]
        self.go.wait(60)
        yield self.tar[len(self.tar) // 2 :]

    def _put(self, url: str, headers: dict[str, str]) -> None:
        self.status = httpx.put(url, content=self._body(), headers=headers, timeout=60).status_code

    def finish(self) -> int:
        self.go.set()
        self.thread.join(60)
        return self.status


def _trainer(home: ProxyHarness) -> ProxyClient:
    t = home.client("r1", "trainer")
    t.put_run(make_spec(max_staleness=64))
    t.register_trainer("t0")
    return t


def _staged_half(relay: RelayProc, up: HeldUpload) -> None:
    """Wait until the relay has at least half the held upload on disk, pulled while the body is still incomplete."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = [n for name, n in relay.stats()["in_flight"].items() if up.sha in name]  # type: ignore[union-attr]
        if got and got[0] >= len(up.tar) // 2 - 1:
            assert up.thread.is_alive() and up.status == 0  # the trainer is still uploading: nothing committed
            return
        time.sleep(0.05)
    raise AssertionError(f"the relay never had half the staged upload: {relay.stats()}")


def _cached(relay: RelayProc, sha: str) -> list[Path]:
    return [p for p in relay.cache_dir.rglob("*") if sha in p.name]


def _settled(relay: RelayProc) -> dict[str, object]:
    deadline = time.monotonic() + 30
    while (stats := relay.stats())["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return stats  # type: ignore[return-value]


def test_a_version_s_bytes_reach_the_relay_before_its_commit_and_are_served_once_committed(
    home: ProxyHarness, relay: RelayProc
) -> None:
    t = _trainer(home)
    up = HeldUpload(home, t, 1, adapter_tar(1, 4 << 20))
    _staged_half(relay, up)
    assert t.wait_for_version(0, wait_s=0) is None  # not announced
    assert up.finish() == 200
    with ProxyClient(relay.url, "r1", TOKENS["generator"], retries=0) as g:
        assert g.download_adapter(1) == up.tar
    stats = relay.stats()
    assert (stats["staged_fetches"], stats["upstream_fetches"], stats["staged_dropped"]) == (1, 0, 0)
    (fetch,) = stats["recent_fetches"]  # type: ignore[misc]
    assert fetch["staged"] and fetch["sha256"] == up.sha
    with httpx.Client(base_url=home.url, headers={"Authorization": f"Bearer {RELAY_TOKEN}"}) as h:
        assert h.get("/v1/runs/r1").status_code == 403  # the relay's own token reads staged bytes only
        assert h.get("/v1/runs/r1/adapters/1").status_code == 403


def test_a_staged_version_whose_commit_fails_is_never_served_and_is_dropped(
    home: ProxyHarness, relay: RelayProc
) -> None:
    """Two uploads of v1: the held one loses the commit to the other (409 version_conflict) after the relay had
    half of it; the relay serves the committed bytes and keeps nothing of the loser."""
    t = _trainer(home)
    loser = HeldUpload(home, t, 1, adapter_tar(1, 2 << 20))
    _staged_half(relay, loser)
    winner = adapter_tar(101, 2 << 20)
    t.publish_adapter(1, winner)
    assert loser.finish() == 409
    stats = _settled(relay)
    with ProxyClient(relay.url, "r1", TOKENS["generator"], retries=0) as g:
        assert g.download_adapter(1) == winner
    assert stats["staged_dropped"] == 1 and not _cached(relay, loser.sha)


def test_a_staged_version_of_a_trainer_fenced_mid_upload_is_never_served_and_is_dropped(
    home: ProxyHarness, relay: RelayProc
) -> None:
    t = _trainer(home)
    up = HeldUpload(home, t, 1, adapter_tar(1, 2 << 20))
    _staged_half(relay, up)
    home.client("r1", "trainer").register_trainer("t1")  # a new trainer: the uploading one is fenced
    assert up.finish() == 409
    stats = _settled(relay)
    with ProxyClient(relay.url, "r1", TOKENS["generator"], retries=0) as g, pytest.raises(errors.NotFound):
        g.download_adapter(1)
    assert stats["staged_dropped"] == 1 and not _cached(relay, up.sha)


def test_a_relay_killed_mid_staging_serves_the_committed_bytes_after_its_restart(
    home: ProxyHarness, relay: RelayProc
) -> None:
    t = _trainer(home)
    up = HeldUpload(home, t, 1, adapter_tar(1, 2 << 20))
    _staged_half(relay, up)
    relay.kill()
    assert up.finish() == 200
    relay.start()
    assert not _cached(relay, up.sha)  # the partial file went at start
    with ProxyClient(relay.url, "r1", TOKENS["generator"], retries=0) as g:
        assert g.download_adapter(1) == up.tar
    assert relay.stats()["upstream_fetches"] == 1
