"""TLS end to end: a real ``bucketrl proxy`` subprocess serving HTTPS with a certificate from a CA made here.

Clients given the CA (``BUCKETRL_CA_FILE`` or :class:`TransportSecurity`) reach it; one without the CA fails
verification with a message naming the setting; workers refuse plain HTTP to a non-loopback host at start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bucketrl import errors
from bucketrl.client import ProxyClient
from bucketrl.settings import WorkerSettings
from bucketrl.sim.pki import Pki, make_pki
from bucketrl.tls import TransportSecurity
from tests.proxy.harness import TOKENS, TOKENS_ENV, make_spec
from tests.support.services import RedisServer, free_port, wait_port


@dataclass
class HttpsProxy:
    url: str
    pki: Pki


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("BUCKETRL_")}
    return subprocess.run(
        [sys.executable, "-m", "bucketrl.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **(env or {})},
    )


@pytest.fixture(scope="module")
def https_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpsProxy]:
    where = tmp_path_factory.mktemp("tls")
    pki = make_pki(where)
    redis = RedisServer(where / "redis").start()
    port = free_port()
    env = {
        **os.environ,
        "BUCKETRL_REDIS_URL": redis.url,
        "BUCKETRL_BUCKET_URL": f"file://{where / 'bucket'}",
        "BUCKETRL_TOKENS": TOKENS_ENV,
        "BUCKETRL_TLS_CERT_FILE": str(pki.cert),  # the key comes as a flag: both ways of giving them are read
    }
    cmd = [sys.executable, "-m", "bucketrl.cli", "proxy", "--port", str(port), "--tls-key-file", str(pki.key)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_port(port, timeout_s=60, proc=proc)
        yield HttpsProxy(f"https://127.0.0.1:{port}", pki)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        redis.kill()


def test_client_given_the_ca_works_over_https(https_proxy: HttpsProxy) -> None:
    security = TransportSecurity(ca_file=str(https_proxy.pki.ca))
    with ProxyClient(https_proxy.url, "tls", TOKENS["trainer"], security=security) as client:
        client.put_run(make_spec())
        assert client.status().latest_version == 0
    # The same through the CLI, the CA given the way a worker is given it (BUCKETRL_CA_FILE).
    out = _cli(
        "status", "--proxy", https_proxy.url, "--run", "tls", "--token", TOKENS["viewer"], "--json",
        env={"BUCKETRL_CA_FILE": str(https_proxy.pki.ca)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["latest_version"] == 0


def test_client_without_the_ca_fails_verification_clearly(https_proxy: HttpsProxy) -> None:
    client = ProxyClient(https_proxy.url, "tls", TOKENS["viewer"], security=TransportSecurity())
    with client, pytest.raises(errors.Unavailable) as info:
        client.status()
    assert not info.value.retryable  # no outage to ride out: retrying cannot make the certificate trusted
    assert "failed verification" in info.value.message and "BUCKETRL_CA_FILE" in info.value.message
    assert https_proxy.url in info.value.message


def test_plain_http_is_not_served_by_an_https_proxy(https_proxy: HttpsProxy) -> None:
    plain = https_proxy.url.replace("https://", "http://")
    with ProxyClient(plain, "tls", TOKENS["viewer"], retries=0) as client, pytest.raises(errors.Unavailable):
        client.status()


@pytest.mark.parametrize("command", ["generator", "trainer"])
def test_worker_refuses_plain_http_to_a_remote_host_at_start(command: str) -> None:
    out = _cli(command, env={"BUCKETRL_PROXY_URL": "http://10.1.2.3:8000", "BUCKETRL_TOKEN": "t"})
    assert out.returncode == 2, out.stderr
    assert "refusing plain HTTP to http://10.1.2.3:8000" in out.stderr and "BUCKETRL_INSECURE_HTTP=1" in out.stderr


def test_loopback_http_allowed_and_remote_http_only_on_purpose() -> None:
    strict = TransportSecurity()
    for url in ("http://127.0.0.1:8000", "http://127.3.4.5", "http://localhost:8000", "http://[::1]:8000"):
        strict.check(url)
    for url in ("http://10.1.2.3:8000", "http://proxy:8000", "http://[2001:db8::1]:8000"):
        with pytest.raises(ValueError, match="BUCKETRL_INSECURE_HTTP"):
            strict.check(url)
    strict.check("https://bucketrl.example.org")
    with pytest.raises(ValueError, match="refusing plain HTTP"):
        ProxyClient("http://10.1.2.3:8000", "r", security=strict)
    TransportSecurity(insecure_http=True).check("http://proxy:8000")
    assert WorkerSettings(proxy_url="http://proxy:8000", insecure_http=True).insecure_http


def test_proxy_refuses_half_a_tls_configuration(tmp_path: Path) -> None:
    out = _cli("proxy", "--tls-cert-file", str(tmp_path / "missing.pem"))
    assert out.returncode == 2
    assert "BUCKETRL_TLS_CERT_FILE and BUCKETRL_TLS_KEY_FILE must be set together" in out.stderr
