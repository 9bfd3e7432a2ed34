"""The relay over TLS on both sides (a CA made here): it serves HTTPS with its own certificate and verifies the
home proxy against ``BUCKETRL_CA_FILE``; its cache keeps under ``--cache-max-bytes``; and what waits on a home
proxy that does not answer is bounded (``--max-pending``), the rest answered a retryable 503 at once."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
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
from bucketrl.sim.pki import Pki, make_pki
from bucketrl.tls import TransportSecurity
from tests.proxy.harness import TOKENS, ProxyHarness, adapter_tar, make_spec, running
from tests.relay.test_relay import ROOT, RelayProc
from tests.support.services import RedisServer, free_port

MIB = 1 << 20


@pytest.fixture()
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "pki")


@pytest.fixture()
def https_home(redis_server: RedisServer, tmp_path: Path, pki: Pki) -> Iterator[ProxyHarness]:
    bucket = f"file://{tmp_path / 'bucket'}"
    with running(redis_server.url, bucket, tls_cert_file=str(pki.cert), tls_key_file=str(pki.key)) as h:
        yield h


def _relay(home: ProxyHarness, tmp_path: Path, pki: Pki, ca: str, *args: str) -> RelayProc:
    tls = ("--tls-cert-file", str(pki.cert), "--tls-key-file", str(pki.key))
    r = RelayProc(home.url, tmp_path / f"cache-{free_port()}", free_port(), args=(*tls, *args))
    r.env, r.verify = {"BUCKETRL_CA_FILE": ca}, ssl.create_default_context(cafile=str(pki.ca))
    return r.start()


def test_https_both_ways_and_the_cache_keeps_under_its_cap(https_home: ProxyHarness, tmp_path: Path, pki: Pki) -> None:
    security = TransportSecurity(ca_file=str(pki.ca))
    tars = [adapter_tar(v, MIB) for v in (1, 2, 3)]
    with ProxyClient(https_home.url, "r1", TOKENS["trainer"], retries=0, security=security) as t:
        t.put_run(make_spec(max_staleness=64))
        t.register_trainer("t0")
        for v, tar in enumerate(tars, 1):
            t.publish_adapter(v, tar)
    relay = _relay(https_home, tmp_path, pki, str(pki.ca), "--cache-max-bytes", str(int(2.5 * MIB)))
    try:
        assert relay.url.startswith("https://")
        with ProxyClient(relay.url, "r1", TOKENS["generator"], retries=0, security=security) as g:
            assert [g.download_adapter(v) for v in (1, 2, 3)] == tars
            assert g.get_run().run == "r1"  # a control call forwarded over verified TLS
        stats = relay.stats()
        assert (stats["upstream_fetches"], stats["evictions"], stats["files"]) == (3, 1, 2), stats
        assert sorted(p.name.split(".")[0] for p in relay.cache_dir.glob("r1/*.tar")) == ["v2", "v3"]
        # A worker without the CA does not trust the relay: a clear, non-retryable error naming the setting.
        with ProxyClient(relay.url, "r1", TOKENS["generator"], retries=0, security=TransportSecurity()) as bare:
            with pytest.raises(errors.Unavailable, match="BUCKETRL_CA_FILE") as info:
                bare.get_run()
            assert not info.value.retryable
    finally:
        relay.kill()

    # A relay not given the CA does not trust the home proxy: nothing (no token) goes up; a 503 that says why.
    blind = _relay(https_home, tmp_path, pki, "")
    try:
        with httpx.Client(base_url=blind.url, verify=blind.verify, timeout=30) as h:
            r = h.get("/v1/runs/r1", headers={"Authorization": f"Bearer {TOKENS['generator']}"})
        assert r.status_code == 503 and "CERTIFICATE_VERIFY_FAILED" in r.text, r.text
    finally:
        blind.kill()


def _relay_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("BUCKETRL_")}
    cmd = [sys.executable, "-m", "bucketrl.cli", "relay", *args]
    return subprocess.run(cmd, cwd=ROOT, env={**clean, **(env or {}), "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def test_relay_refuses_plain_http_upstream_off_this_host_and_half_a_tls_pair(tmp_path: Path) -> None:
    out = _relay_cli("--upstream", "http://10.1.2.3:8000", "--cache-dir", str(tmp_path / "c"))
    assert out.returncode == 2 and "refusing plain HTTP to http://10.1.2.3:8000" in out.stderr, out.stderr
    assert not (tmp_path / "c").exists()
    out = _relay_cli("--upstream", "https://proxy.example", "--tls-cert-file", str(tmp_path / "cert.pem"))
    assert out.returncode == 2, out.stderr
    assert "BUCKETRL_RELAY_TLS_CERT_FILE and BUCKETRL_RELAY_TLS_KEY_FILE must be set together" in out.stderr
    assert "--upstream or" not in out.stderr  # the upstream was fine


def test_requests_waiting_on_a_silent_home_proxy_are_bounded(tmp_path: Path) -> None:
    """An upstream that accepts and never answers (a link gone quiet under open connections): the relay holds
    ``--max-pending`` requests and answers the next one 503 at once, retryable, saying which setting."""
    silent = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        silent.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(silent.accept()[0])
            except TimeoutError:
                continue

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    upstream = f"http://127.0.0.1:{silent.getsockname()[1]}"
    relay = RelayProc(upstream, tmp_path / "c", free_port(), args=("--max-pending", "2")).start()
    waiting: list[threading.Thread] = []

    def wait_on_it() -> None:
        with contextlib.suppress(httpx.HTTPError):  # cut off when the relay goes at the end
            httpx.get(f"{relay.url}/v1/runs/r1", timeout=5)

    try:
        for _ in range(2):
            w = threading.Thread(target=wait_on_it, daemon=True)
            w.start()
            waiting.append(w)
        deadline = time.monotonic() + 10
        while relay.stats()["pending"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        started = time.monotonic()
        r = httpx.get(f"{relay.url}/v1/runs/r1", timeout=5)
        assert r.status_code == 503 and time.monotonic() - started < 2
        assert r.json()["error"]["retryable"] and "BUCKETRL_RELAY_MAX_PENDING" in r.json()["error"]["message"]
        assert r.headers["Retry-After"] == "1"
        stats = relay.stats()
        assert (stats["pending"], stats["refused"]) == (2, 1)
    finally:
        relay.kill()
        stop.set()
        th.join(5)
        for s in held:
            s.close()
        silent.close()


def test_a_small_body_is_sent_again_when_the_connection_closes_under_it(tmp_path: Path) -> None:
    """An upstream that drops its first connection without answering (an idle keep-alive closed as it is reused
    looks the same to the relay): the relay sends the same small body once more and the caller gets the answer,
    not a 503."""
    server = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []

    def serve() -> None:
        for attempt in range(2):
            conn, _ = server.accept()
            with conn:
                data = b""
                while b"\r\n\r\n" not in data or not data.endswith(b"}"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                seen.append(data.split(b"\r\n\r\n", 1)[1])
                if attempt == 1:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}")

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    relay = RelayProc(f"http://127.0.0.1:{server.getsockname()[1]}", tmp_path / "c", free_port()).start()
    try:
        r = httpx.post(f"{relay.url}/v1/runs/r1/prompts/release", json={"worker_id": "g", "ids": ["p1"]}, timeout=10)
        assert r.status_code == 200, r.text
        assert seen == [b'{"worker_id":"g","ids":["p1"]}'] * 2
    finally:
        relay.kill()
        server.close()
        th.join(5)
