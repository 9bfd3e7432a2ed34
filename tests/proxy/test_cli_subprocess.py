"""``bucketrl proxy`` as a real uvicorn subprocess: serves, ``--rebuild`` restores a wiped Redis from the
bucket, SIGTERM exits cleanly, and a refused configuration exits 2 with a message naming the setting."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from bucketrl.client import ProxyClient
from tests.proxy.harness import TOKENS, TOKENS_ENV, adapter_tar, checkpoint_tar, make_spec
from tests.support.services import RedisServer, free_port, wait_port


def _start(redis_url: str, bucket_url: str, port: int, *extra: str, **env: str) -> subprocess.Popen:
    full_env = {
        **os.environ,
        "BUCKETRL_REDIS_URL": redis_url,
        "BUCKETRL_BUCKET_URL": bucket_url,
        "BUCKETRL_TOKENS": TOKENS_ENV,
        **env,
    }
    cmd = [sys.executable, "-m", "bucketrl.cli", "proxy", "--host", "127.0.0.1", "--port", str(port), *extra]
    return subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    return out


@pytest.mark.slow  # real processes for seconds: make test, not make test-fast
def test_proxy_subprocess_serves_and_rebuild_flag_restores(redis_server: RedisServer, bucket_url: str) -> None:
    port = free_port()
    proc = _start(redis_server.url, bucket_url, port)
    try:
        wait_port(port, timeout_s=60, proc=proc)
        t = ProxyClient(f"http://127.0.0.1:{port}", "r1", TOKENS["trainer"], retries=0)
        t.put_run(make_spec())
        t.register_trainer("t0")
        t.publish_adapter(1, adapter_tar(1))
        t.publish_adapter(2, adapter_tar(2))
        t.put_checkpoint(4, checkpoint_tar(b"4"))
        # A serving proxy starts its body decoder with it (the first large body does not wait for its imports).
        decoders = [c for c in psutil.Process(proc.pid).children() if "child_main" in " ".join(c.cmdline())]
        assert len(decoders) == 1, [c.cmdline() for c in psutil.Process(proc.pid).children()]
    finally:
        _stop(proc)
    decoders[0].wait(10)  # ... and it ends with the proxy (stdin closed), leaving no process behind

    redis_server.wipe()
    redis_server.start()
    # Automatic rebuild off: only the flag may restore. Two worker processes: two stateless replicas.
    proc = _start(redis_server.url, bucket_url, port, "--rebuild", "--workers", "2", BUCKETRL_REBUILD_ON_START="false")
    try:
        wait_port(port, timeout_s=60, proc=proc)
        g = ProxyClient(f"http://127.0.0.1:{port}", "r1", TOKENS["generator"], retries=0)
        assert g.get_run().state.latest_version == 2
        assert g.download_adapter(2) == adapter_tar(2)
        t = ProxyClient(f"http://127.0.0.1:{port}", "r1", TOKENS["trainer"], retries=0)
        assert t.latest_checkpoint().step == 4
        assert t.register_trainer("t1").epoch == 2  # larger than any epoch recorded in the bucket
        assert t.publish_adapter(3, adapter_tar(3)).version == 3
    finally:
        out = _stop(proc)
    assert "--rebuild: restored 1 run(s)" in out


@pytest.mark.slow  # real processes for seconds: make test, not make test-fast
def test_sigterm_does_not_wait_out_a_long_poll(redis_server: RedisServer, tmp_path: Path) -> None:
    """A generator's adapter long-poll in flight (here 120 s) does not hold the exit: after
    BUCKETRL_SHUTDOWN_GRACE_S the request is cancelled and the proxy exits 0. It used to wait the poll out, so
    `bucketrl up` and compose SIGKILLed it at their stop timeouts (15 s and 10 s), every run."""
    port = free_port()
    proc = _start(redis_server.url, f"file://{tmp_path / 'bucket'}", port, BUCKETRL_SHUTDOWN_GRACE_S="1")
    try:
        wait_port(port, timeout_s=60, proc=proc)
        ProxyClient(f"http://127.0.0.1:{port}", "r1", TOKENS["trainer"], retries=0).put_run(make_spec())
        gen = ProxyClient(f"http://127.0.0.1:{port}", "r1", TOKENS["generator"], retries=0)
        ended = threading.Event()

        def poll() -> None:
            with contextlib.suppress(Exception):  # the connection goes with the proxy
                gen.wait_for_version(5, wait_s=120)
            ended.set()

        threading.Thread(target=poll, daemon=True).start()
        assert not ended.wait(1.5), "the long-poll answered before any version existed"
        proc.send_signal(signal.SIGTERM)
        # Generous against a slow machine, far under the poll's 120 s: what it waited before.
        out, _ = proc.communicate(timeout=45)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    assert ended.wait(10), "the long-poll outlived the proxy"


def test_refused_configuration_exits_2_naming_the_setting(redis_server: RedisServer, tmp_path: Path) -> None:
    port = free_port()
    proc = _start(redis_server.url, f"file://{tmp_path}", port, BUCKETRL_TOKENS="")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "BUCKETRL_TOKENS" in out
    proc = subprocess.Popen(
        [sys.executable, "-m", "bucketrl.cli", "proxy", "--host", "0.0.0.0", "--port", str(port)],
        env={**os.environ, "BUCKETRL_TOKENS": "", "BUCKETRL_ALLOW_ANONYMOUS": "true"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "loopback" in out


def test_slow_headers_are_cut_off_and_connections_are_bounded(redis_server: RedisServer, tmp_path: Path) -> None:
    """1,000 connections trickling header bytes stayed open for 20 s (issue 12). Now a connection whose headers
    are not complete within BUCKETRL_HEADER_TIMEOUT_S is closed, and past BUCKETRL_MAX_CONNECTIONS a request
    is answered 503 at once."""
    import socket
    import time

    port = free_port()
    proc = _start(
        redis_server.url,
        f"file://{tmp_path / 'b'}",
        port,
        BUCKETRL_HEADER_TIMEOUT_S="1",
        BUCKETRL_MAX_CONNECTIONS="8",
    )
    try:
        wait_port(port, timeout_s=60, proc=proc)
        slow = socket.create_connection(("127.0.0.1", port), timeout=30)
        slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # ... and the rest never comes
        t0 = time.monotonic()
        assert slow.recv(1024) == b""  # closed by the proxy, without an answer
        assert time.monotonic() - t0 < 20  # generous on a loaded machine; the setting is 1 s
        # Idle connections count against the bound; a request beyond it is refused at once (503).
        idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(8)]
        extra = socket.create_connection(("127.0.0.1", port), timeout=30)
        extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert extra.recv(1024).split()[1] == b"503"
        for s in [*idle, extra, slow]:
            s.close()
        # Once they are gone (or cut off), the proxy serves again.
        deadline = time.monotonic() + 30
        while True:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as ok:
                ok.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                if ok.recv(1024).split()[1] == b"200":
                    break
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        _stop(proc)
