"""Staged publish between a real proxy (with a relay token) and a real relay subprocess: an upload's bytes reach the
relay while the trainer is still sending them, and only a committed version's are ever served. The same for a real
generator process that fetches from the proxy itself (no relay): it pulls the bytes with its own token before the
commit, loads the committed version without downloading it again, and never loads a failed publish's.

A trainer's upload is held half sent (its body's second half waits for ``go``), so "the relay has bytes before
the commit" is shown by cause, not by timing: the commit cannot have happened while the body is incomplete."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bucketrl import errors
from bucketrl.client import ProxyClient
from tests.generator.helpers import run_spec
from tests.generator.worker_support import generator_env, start_generator
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
    # A generator's own token lists it at the home proxy; behind the relay it is told nothing is staged (the relay
    # pulls for the region: no generator pulls across the link on its own).
    gen = {"Authorization": f"Bearer {TOKENS['generator']}"}
    listed = httpx.get(f"{home.url}/v1/staging", params={"run": "r1"}, headers=gen).json()
    assert [u["sha256"] for u in listed["uploads"]] == [up.sha]
    assert httpx.get(f"{relay.url}/v1/staging", params={"run": "r1"}, headers=gen).json()["instance"] == ""
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


# -- a generator that fetches from the proxy itself ------------------------------------------------------------


class Direct:
    """A real generator process (the simulated engine: no GPU) on run ``d1``, straight on the home proxy."""

    def __init__(self, home: ProxyHarness, model_dir: Path, tmp_path: Path) -> None:
        self.home, self.log = home, tmp_path / "generator.log"
        self.trainer = home.client("d1", "trainer")
        self.trainer.put_run(run_spec(model_dir, max_staleness=64))
        self.trainer.register_trainer("t0")
        self.trainer.publish_adapter(1, adapter_tar(1))
        self.cache = tmp_path / "generator-cache" / "d1"
        self.proc = start_generator(
            home, "d1", self.log, engine="sim", adapter_cache_dir=self.cache.parent, worker_id="direct-0"
        )
        self.loaded(1)

    def loaded(self, version: int, timeout_s: float = 60) -> str:
        """The sha256 of the version the generator loaded (what it unpacked), once it did."""
        deadline = time.monotonic() + timeout_s
        while f"loaded d1-v{version} " not in self.log.read_text():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.05)
        return (self.cache / f"v{version}" / ".sha256").read_text().strip()

    def staged(self, version: int) -> list[Path]:
        return list(self.cache.glob(f".tmp-v{version}-staged-*"))

    def staged_half(self, up: HeldUpload, version: int) -> None:
        """Until the generator has half the held upload in its cache, pulled while the body is still incomplete
        (a buffered file may lag what arrived by a few kB)."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if any(p.stat().st_size >= len(up.tar) // 2 - 65536 for p in self.staged(version)):
                assert up.thread.is_alive() and up.status == 0  # the trainer is still uploading: nothing committed
                return
            time.sleep(0.05)
        up.go.set()  # the proxy cannot stop while an upload is held
        raise AssertionError(f"the generator never had half the staged upload: {self.log.read_text()[-2000:]}")

    def dropped(self, version: int) -> None:
        """Until no staged file of ``version`` is left in the generator's cache."""
        deadline = time.monotonic() + 20
        while self.staged(version):
            assert time.monotonic() < deadline, f"left in the cache: {self.staged(version)}"
            time.sleep(0.05)

    def downloads(self) -> int:
        """Adapter downloads the proxy answered (each one asks its in-memory adapter cache once)."""
        cache = self.home.ctx.adapter_cache
        assert cache is not None
        return cache.hits + cache.misses

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture()
def direct(home: ProxyHarness, tiny_model_dir: Path, tmp_path: Path) -> Iterator[Direct]:
    d = Direct(home, tiny_model_dir, tmp_path)
    try:
        yield d
    finally:
        d.stop()


@pytest.mark.slow  # a real generator process for ~16 s: make test, not make test-fast
def test_a_direct_generator_pulls_a_version_before_its_commit_and_loads_it_without_downloading_it(
    direct: Direct,
) -> None:
    up = HeldUpload(direct.home, direct.trainer, 2, adapter_tar(2, 4 << 20))
    direct.staged_half(up, 2)
    assert "loaded d1-v2" not in direct.log.read_text()
    before = direct.downloads()
    assert up.finish() == 200
    assert direct.loaded(2) == up.sha
    assert direct.downloads() == before  # its bytes came staged: no second download
    assert "staged v2: its" in direct.log.read_text() and not direct.staged(2)


@pytest.mark.slow  # a real generator process for ~16 s: make test, not make test-fast
def test_a_direct_generator_never_loads_a_failed_or_fenced_publish_and_drops_its_bytes(direct: Direct) -> None:
    """v2 held half sent loses its commit to another upload of v2 (409); v3 held half sent is fenced by a new
    trainer (409). The generator loads the committed v2 and the new trainer's v3, and keeps nothing of the two."""
    loser = HeldUpload(direct.home, direct.trainer, 2, adapter_tar(2, 2 << 20))
    direct.staged_half(loser, 2)
    winner = adapter_tar(102, 2 << 20)
    direct.trainer.publish_adapter(2, winner)
    assert loser.finish() == 409
    assert direct.loaded(2) == hashlib.sha256(winner).hexdigest()
    direct.dropped(2)

    fenced = HeldUpload(direct.home, direct.trainer, 3, adapter_tar(3, 2 << 20))
    direct.staged_half(fenced, 3)
    successor = direct.home.client("d1", "trainer")
    successor.register_trainer("t1")  # the uploading trainer is fenced
    assert fenced.finish() == 409
    direct.dropped(3)  # its partial file goes as its stream ends short
    v3 = adapter_tar(103, 2 << 20)
    successor.publish_adapter(3, v3)
    assert direct.loaded(3) == hashlib.sha256(v3).hexdigest()
    log = direct.log.read_text()
    assert "staged v2 not kept" in log and "staged v3 not kept" in log, log[-3000:]


def test_a_relay_token_given_to_a_generator_stops_it_with_one_line_naming_the_mistake(home: ProxyHarness) -> None:
    _trainer(home)
    env = generator_env(home, "r1", token=RELAY_TOKEN, engine="sim")
    proc = subprocess.run(
        [sys.executable, "-m", "bucketrl.cli", "generator"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("generator: forbidden: role 'relay' may not call this route"), proc.stderr[-2000:]
    assert "this is a relay token (BUCKETRL_RELAY_STAGING_TOKEN)" in last
