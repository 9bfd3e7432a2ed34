"""Workers ride out proxy outages (issue 10, item 5): the client retries connection errors and any 5xx with
backoff that honours Retry-After, for the worker's outage budget, logging once per outage and once at recovery.

The first test runs against the real proxy (uvicorn + redis-server): the proxy stopped (connection refused)
and Redis killed (503), each for longer than the old fixed retry count lasted. The others use a
scripted HTTP server standing in for what sits in front of a proxy (a load balancer answering 500/502, a proxy
asking for a Retry-After), the only way to get exact answer sequences over real HTTP.
"""

from __future__ import annotations

import http.server
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bucketrl import errors
from bucketrl.client import Outage, ProxyClient
from tests.proxy.harness import TOKENS, adapter_tar, make_spec, running
from tests.support.services import RedisServer, free_port

OUTAGE_S = 4.0  # longer than the old client's 5 retries lasted (0.05 s doubling: at most 2.3 s); far under the budget


def _outage_lines(caplog: pytest.LogCaptureFixture) -> tuple[list[str], list[str]]:
    msgs = [r.getMessage() for r in caplog.records if r.name == "bucketrl.client"]
    return [m for m in msgs if "proxy unavailable" in m], [m for m in msgs if "available again" in m]


@pytest.mark.slow  # real processes for seconds: make test, not make test-fast
def test_a_worker_client_rides_out_a_proxy_restart_and_a_redis_outage(
    redis_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="bucketrl.client")
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as p:
        outage = Outage(budget_s=120.0, who="trainer-0")
        t = ProxyClient(p.url, "r1", TOKENS["trainer"], outage=outage, backoff_s=0.05)
        t.put_run(make_spec(max_staleness=8))
        t.register_trainer("trainer-0")
        t.publish_adapter(1, adapter_tar(1))

        # 1. The proxy is down (connection refused) for OUTAGE_S, then comes back on the same port.
        p.stop()
        threading.Timer(OUTAGE_S, p.start).start()
        t0 = time.monotonic()
        assert t.publish_adapter(2, adapter_tar(2)).version == 2  # before the fix: Unavailable after ~6 s
        assert time.monotonic() - t0 >= OUTAGE_S - 0.5

        # 2. Redis is down: the proxy answers 503 redis_unavailable with Retry-After.
        redis_server.kill()
        threading.Timer(OUTAGE_S, redis_server.start).start()
        assert t.publish_adapter(3, adapter_tar(3)).version == 3
    down, back = _outage_lines(caplog)
    assert len(down) == 2 and len(back) == 2, (down, back)  # once per outage, however many attempts
    assert outage.outages == 2 and outage.since is None


class Scripted:
    """A real HTTP server answering each request with the next (status, headers, body) of ``script`` (the last
    one repeats); it counts requests."""

    def __init__(self, script: list[tuple[int, dict[str, str], bytes]]) -> None:
        self.script = list(script)
        self.requests = 0
        self.port = free_port()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.requests += 1
                status, headers, body = outer.script.pop(0) if len(outer.script) > 1 else outer.script[0]
                self.send_response(status)
                for k, v in {"Content-Length": str(len(body)), **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture()
def scripted() -> Iterator[list[Scripted]]:
    made: list[Scripted] = []
    yield made
    for s in made:
        s.server.shutdown()
        s.server.server_close()


OK = (200, {"Content-Type": "application/x-tar"}, b"adapter bytes")
UNAVAILABLE = b'{"error":{"code":"unavailable","message":"bucket down","retryable":true}}'


def test_5xx_of_any_kind_is_retried_and_retry_after_is_honoured(scripted: list[Scripted]) -> None:
    server = Scripted(
        [
            (
                500,
                {"Content-Type": "application/json"},
                b'{"error":{"code":"internal","message":"x","retryable":true}}',
            ),
            (502, {"Content-Type": "text/html"}, b"<html>bad gateway</html>"),
            (503, {"Content-Type": "application/json", "Retry-After": "2"}, UNAVAILABLE),
            OK,
        ]
    )
    scripted.append(server)
    c = ProxyClient(server.url, "r1", outage=Outage(60.0), backoff_s=0.01)
    t0 = time.monotonic()
    assert c.download_adapter(1) == b"adapter bytes"
    assert server.requests == 4  # before the fix: the 500 was raised at once
    assert time.monotonic() - t0 >= 2.0  # the Retry-After, although the backoff was 10 ms


def test_the_budget_ends_the_retries_and_a_stop_cuts_it_short(scripted: list[Scripted]) -> None:
    server = Scripted([(503, {"Content-Type": "application/json", "Retry-After": "1"}, UNAVAILABLE)])
    scripted.append(server)
    c = ProxyClient(server.url, "r1", outage=Outage(3.0), backoff_s=0.05)
    t0 = time.monotonic()
    with pytest.raises(errors.Unavailable):
        c.download_adapter(1)
    assert time.monotonic() - t0 >= 3.0 and server.requests >= 3
    assert c.outage is not None and c.outage.spent()  # the trainer's own retry loop stops on this too

    # A worker told to stop during an outage gives up within the stop grace, not after the whole budget.
    outage = Outage(600.0)
    outage.STOP_GRACE_S = 1.0  # type: ignore[misc]
    c = ProxyClient(server.url, "r1", outage=outage, backoff_s=0.05)
    threading.Timer(1.0, outage.stopping).start()
    t0 = time.monotonic()
    with pytest.raises(errors.Unavailable):
        c.download_adapter(1)
    assert time.monotonic() - t0 < 60


def test_a_preemption_notice_ends_the_retries_with_the_notice(scripted: list[Scripted]) -> None:
    """Under a notice the machine is gone at its end: a retry outliving it only delays the exit (the stop grace
    of 30 s counts from the outage's start, so a generator noticed 7 s in used to keep retrying for 23 s)."""
    server = Scripted([(503, {"Content-Type": "application/json", "Retry-After": "1"}, UNAVAILABLE)])
    scripted.append(server)
    outage = Outage(600.0)
    c = ProxyClient(server.url, "r1", outage=outage, backoff_s=0.05)
    threading.Timer(0.5, outage.stopping, kwargs={"notice_s": 1.0}).start()
    t0 = time.monotonic()
    with pytest.raises(errors.Unavailable):
        c.download_adapter(1)
    assert time.monotonic() - t0 < 3.0  # STOP_GRACE_S alone: 30 s
    assert outage.spent()


def test_a_client_without_an_outage_keeps_its_retry_count(scripted: list[Scripted]) -> None:
    server = Scripted([(503, {"Content-Type": "application/json", "Retry-After": "1"}, UNAVAILABLE)])
    scripted.append(server)
    c = ProxyClient(server.url, "r1", retries=2, backoff_s=0.01)
    with pytest.raises(errors.Unavailable):
        c.download_adapter(1)
    assert server.requests == 3


def test_waits_after_a_stop_still_wait() -> None:
    """A stop wakes the retry waits in progress, and later waits still wait: a stopped worker's retries used to
    spin with no pause until their attempt counter overflowed the backoff (OverflowError after ~1,000 tries)."""
    import time as _time

    from bucketrl.client import Outage

    outage = Outage(600.0, "test")
    outage.stopping()
    t0 = _time.monotonic()
    outage.wait(0.3)
    assert _time.monotonic() - t0 >= 0.25
