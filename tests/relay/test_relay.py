"""The regional relay (``bucketrl relay``, a real subprocess) between real clients and a real proxy over a real
Redis: adapters fetched upstream once per version and verified, control calls and long-polls forwarded, and a
client with the home proxy as its fallback URL riding out the relay's death."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from bucketrl import client as client_module
from bucketrl import errors
from bucketrl.client import ProxyClient
from bucketrl.relay.cache import AdapterCache
from tests.proxy.harness import TOKENS, ProxyHarness, adapter_tar, make_spec, running
from tests.support.services import RedisServer, free_port, wait_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RelayProc:
    upstream: str
    cache_dir: Path
    port: int
    proc: subprocess.Popen | None = None
    args: tuple[str, ...] = ()  # more flags (TLS, the cache's cap...)
    env: dict[str, str] = field(default_factory=dict)
    verify: ssl.SSLContext | bool = True  # how this test reaches /relay/stats

    @property
    def url(self) -> str:
        return f"{'https' if '--tls-cert-file' in self.args else 'http'}://127.0.0.1:{self.port}"

    def start(self) -> RelayProc:
        cmd = [sys.executable, "-m", "bucketrl.cli", "relay", "--upstream", self.upstream]
        cmd += ["--cache-dir", str(self.cache_dir), "--port", str(self.port), *self.args]
        env = {**os.environ, "PYTHONPATH": str(ROOT), **self.env}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_port(self.port, 30.0, self.proc)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # by the pid this test started
            self.proc.wait(10)

    def stats(self) -> dict[str, int]:
        return httpx.get(f"{self.url}/relay/stats", timeout=10, verify=self.verify).json()


@pytest.fixture()
def proxy_file(redis_server: RedisServer, tmp_path: Path) -> Iterator[ProxyHarness]:
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as h:
        yield h


@pytest.fixture()
def relay(proxy_file: ProxyHarness, tmp_path: Path) -> Iterator[RelayProc]:
    r = RelayProc(proxy_file.url, tmp_path / "relay-cache", free_port()).start()
    try:
        yield r
    finally:
        r.kill()


def _published(p: ProxyHarness, versions: int = 1, size: int = 1 << 20) -> tuple[ProxyClient, list[bytes]]:
    t = p.client("r1", "trainer")
    t.put_run(make_spec(max_staleness=64))
    t.register_trainer("t0")
    tars = [adapter_tar(v, size) for v in range(1, versions + 1)]
    for v, tar in enumerate(tars, 1):
        t.publish_adapter(v, tar)
    return t, tars


def test_concurrent_downloads_cross_once_and_a_corrupt_cache_file_is_fetched_again(
    proxy_file: ProxyHarness, relay: RelayProc
) -> None:
    _, (tar,) = _published(proxy_file)
    want = hashlib.sha256(tar).hexdigest()
    got: list[bytes] = []
    barrier = threading.Barrier(4)

    def download() -> None:
        with ProxyClient(relay.url, "r1", TOKENS["generator"], retries=0) as g:
            barrier.wait()
            got.append(g.download_adapter(1))

    threads = [threading.Thread(target=download) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert got == [tar] * 4
    assert relay.stats()["upstream_fetches"] == 1
    (cached,) = relay.cache_dir.glob("r1/v1.*.tar")
    assert cached.name == f"v1.{want}.tar"

    assert relay.stats()["verified"] == 0  # hashed as it was written, trusted on the hits since

    cached.write_bytes(tar[:-1] + bytes([tar[-1] ^ 1]))  # one flipped bit on disk: the file's stamp changed
    with ProxyClient(relay.url, "r1", TOKENS["generator"], retries=0) as g:
        assert g.download_adapter(1) == tar  # the client checks the sha header against the bytes too
    stats = relay.stats()
    assert (stats["corrupt"], stats["upstream_fetches"], stats["verified"]) == (1, 2, 1)
    assert cached.read_bytes() == tar

    # A bit rotting in place (stamp kept) gets past the stat; the client's own hash catches it, and its
    # no-cache retry makes the relay hash its copy and fetch it again.
    st = cached.stat()
    with cached.open("r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    os.utime(cached, ns=(st.st_atime_ns, st.st_mtime_ns))
    with ProxyClient(relay.url, "r1", TOKENS["generator"], retries=0) as g:
        with pytest.raises(errors.Invalid, match="sha256"):
            g.download_adapter(1)
        buf = io.BytesIO()
        assert g.download_adapter_to(1, buf, fresh=True) == want and buf.getvalue() == tar
    stats = relay.stats()
    assert (stats["corrupt"], stats["upstream_fetches"], stats["verified"]) == (2, 3, 2)

    # Cached or not, every caller is authorized by the home proxy: no token, a viewer's, a collected version.
    with httpx.Client(base_url=relay.url, timeout=10) as h:
        assert h.get("/v1/runs/r1/adapters/1").status_code == 401
        viewer = {"Authorization": f"Bearer {TOKENS['viewer']}"}
        assert h.get("/v1/runs/r1/adapters/1", headers=viewer).status_code == 403
        gen = {"Authorization": f"Bearer {TOKENS['generator']}"}
        assert h.get("/v1/runs/r1/adapters/9", headers=gen).status_code == 404
    assert relay.stats()["upstream_fetches"] == 3


def test_single_flight_one_fetch_for_concurrent_misses(tmp_path: Path) -> None:
    data = os.urandom(1 << 16)
    sha = hashlib.sha256(data).hexdigest()
    calls = 0

    async def fetch() -> AsyncIterator[bytes]:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.2)  # slower than the other callers' arrival
        yield data

    cache = AdapterCache(tmp_path)

    async def main() -> list[Path]:
        return [e.path for e in await asyncio.gather(*(cache.acquire("r1", 3, sha, fetch) for _ in range(4)))]

    paths = asyncio.run(main())
    assert calls == 1 and len(set(paths)) == 1 and paths[0].read_bytes() == data
    assert (cache.stats.upstream_fetches, cache.stats.shared, cache.stats.hits) == (1, 3, 0)


def test_control_calls_and_long_polls_pass_through(proxy_file: ProxyHarness, relay: RelayProc) -> None:
    t, _ = _published(proxy_file)
    with ProxyClient(relay.url, "r1", TOKENS["generator"], retries=0, timeout_s=30) as g:
        lease = g.lease_prompts("g0", 2, version=1)  # a POST with a JSON body, answered through the relay
        assert len(lease.prompts) == 2
        woken: list[int] = []

        def wait() -> None:
            info = g.wait_for_version(1, wait_s=20.0)
            woken.append(info.version if info else 0)

        th = threading.Thread(target=wait)
        th.start()
        time.sleep(0.5)
        assert woken == [] and th.is_alive()  # held open by the home proxy, through the relay
        started = time.monotonic()
        t.publish_adapter(2, adapter_tar(2, 4096))
        th.join(20)
        assert woken == [2] and time.monotonic() - started < 15  # woken by the publish, not by wait_s
        with pytest.raises(errors.NotFound):  # an error answer keeps its status and body
            ProxyClient(relay.url, "nope", TOKENS["generator"], retries=0).get_run()
    _prompt_lease_long_poll_is_woken(proxy_file, relay)


def _prompt_lease_long_poll_is_woken(home: ProxyHarness, relay: RelayProc) -> None:
    """A full pipeline answers 429 with its Retry-After through the relay; a lease long-poll held open through
    the relay is woken by a release at the home proxy."""
    home.client("r2", "trainer").put_run(make_spec(dataset={"uri": "toy:digits", "size": 20}, groups_per_step=2))
    full = home.client("r2", "generator").lease_prompts("gen-a", 4, ttl_s=60)  # the admission limit (2 x 2)
    with httpx.Client(base_url=relay.url, headers={"Authorization": f"Bearer {TOKENS['generator']}"}) as h:
        r = h.post("/v1/runs/r2/prompts/lease", json={"worker_id": "gen-b", "n": 1, "wait_s": 0.2})
        assert r.status_code == 429 and r.headers["Retry-After"] == "0", r.text
    got: list[int] = []
    with ProxyClient(relay.url, "r2", TOKENS["generator"], retries=0, timeout_s=30) as g:
        waiter = threading.Thread(target=lambda: got.append(len(g.lease_prompts("gen-b", 3, wait_s=20).prompts)))
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive()  # held open by the home proxy, through the relay
        started = time.monotonic()
        home.client("r2", "generator").release_prompts("gen-a", [p.prompt_id for p in full.prompts[:2]])
        waiter.join(20)
    assert got == [2] and time.monotonic() - started < 15


def test_a_client_falls_back_to_the_home_proxy_and_returns_to_its_relay(
    proxy_file: ProxyHarness, relay: RelayProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, (tar,) = _published(proxy_file, size=4096)
    with ProxyClient(f"{relay.url},{proxy_file.url}", "r1", TOKENS["generator"], retries=3, backoff_s=0.01) as g:
        assert g.download_adapter(1) == tar
        assert relay.stats()["upstream_fetches"] == 1
        relay.kill()
        assert g.download_adapter(1) == tar  # connection refused: on to the home proxy
        assert g.get_run().run == "r1"
        monkeypatch.setattr(client_module, "PRIMARY_RETRY_S", 0.0)
        relay.start()  # a restart loses nothing: the cache on disk is verified and served again
        assert g.download_adapter(1) == tar
        assert g.download_adapter(1) == tar  # hashed once after the restart, not on every hit
    stats = relay.stats()
    assert (stats["hits"], stats["upstream_fetches"], stats["verified"]) == (2, 0, 1)


def test_relay_command_without_an_upstream_says_what_is_missing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUCKETRL_RELAY_")}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "bucketrl.cli", "relay", "--cache-dir", str(tmp_path / "c")]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--upstream or BUCKETRL_RELAY_UPSTREAM_URL" in out.stderr
    out = subprocess.run([*cmd, "--upstream", "proxy:8000"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 2 and "must start with http:// or https://" in out.stderr
    assert not (tmp_path / "c").exists()


class HalfwayUpstream:
    """A home proxy that sends an adapter's tar in two halves, the second only once ``go`` is set, or that drops
    the connection there instead (``drop``): the middle of a slow link, which a real proxy on loopback cannot
    be held at. It answers the relay's conditional probe (304 + sha256) like the real one."""

    def __init__(self, tar: bytes) -> None:
        self.tar, self.sha = tar, hashlib.sha256(tar).hexdigest()
        self.go, self.drop, self.sent_rest = threading.Event(), False, False
        self.server = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.getsockname()[1]}"

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.server.accept()
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            data = b""
            while True:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, data = data.split(b"\r\n\r\n", 1)
                sha = f"X-Content-SHA256: {self.sha}\r\n".encode()
                if b"if-none-match" in head.lower():
                    conn.sendall(b"HTTP/1.1 304 Not Modified\r\n" + sha + b"\r\n")
                    continue
                half = len(self.tar) // 2
                conn.sendall(b"HTTP/1.1 200 OK\r\n" + sha + f"Content-Length: {len(self.tar)}\r\n\r\n".encode())
                conn.sendall(self.tar[:half])
                self.go.wait(30)
                if self.drop:
                    return
                conn.sendall(self.tar[half:])
                self.sent_rest = True

    def close(self) -> None:
        self.go.set()
        self.server.close()


def test_a_caller_gets_the_bytes_while_the_relay_still_fetches_them_and_a_failed_fetch_cuts_it_short(
    tmp_path: Path,
) -> None:
    """Cut-through over real HTTP: the caller has the first half of the tar while the second has not left the
    home proxy, then all of it, matching the sha256 header; a fetch whose link drops mid-body ends the caller's
    answer short (its HTTP library says so), and nothing is cached."""
    tar = os.urandom(4 << 20)
    upstream = HalfwayUpstream(tar)
    relay = RelayProc(upstream.url, tmp_path / "c", free_port()).start()
    gen = {"Authorization": f"Bearer {TOKENS['generator']}"}
    try:
        with httpx.Client(base_url=relay.url, timeout=30, headers=gen) as h:
            with h.stream("GET", "/v1/runs/r1/adapters/1") as r:
                assert r.status_code == 200 and r.headers["X-Content-SHA256"] == upstream.sha
                got = b""
                chunks = r.iter_raw()
                while len(got) < len(tar) // 2:
                    got += next(chunks)
                assert not upstream.sent_rest  # the caller has half the tar, the relay not all of it yet
                upstream.go.set()
                got += b"".join(chunks)
            assert got == tar
            assert relay.stats()["streamed"] == 1
            (cached,) = (tmp_path / "c").glob("r1/v1.*.tar")
            assert cached.read_bytes() == tar

            upstream.go.clear()
            upstream.drop = True
            with pytest.raises(httpx.RemoteProtocolError), h.stream("GET", "/v1/runs/r1/adapters/2") as r:
                assert r.status_code == 200
                chunks, got = r.iter_raw(), b""
                while len(got) < len(tar) // 2:
                    got += next(chunks)
                upstream.go.set()
                for _ in chunks:
                    pass
        assert not list((tmp_path / "c").glob("r1/v2.*"))
        assert relay.stats()["upstream_fetches"] == 2
    finally:
        relay.kill()
        upstream.close()
