"""The drain watcher (bucketrl/drain_watch.py) against proxies that cannot answer its long-poll: an older proxy
(the route unknown: 405, since the path has a POST) makes it give up quietly, leaving the heartbeat to carry drains
and the worker running; an outage is retried. Real HTTP servers on loopback stand in for those proxies."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from bucketrl.client import ProxyClient
from bucketrl.drain_watch import DrainWatch


@contextmanager
def answering(status: int) -> Iterator[tuple[str, list[str]]]:
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.path)
            body = b'{"detail": "Method Not Allowed"}'
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def watch(url: str, stop: threading.Event, drains: list[float]) -> DrainWatch:
    client = ProxyClient(url, "r1", "tok", retries=0)
    return DrainWatch(client, "gen-1", drains.append, stop, wait_s=0.1)


def test_an_older_proxy_ends_the_watch_not_the_worker() -> None:
    stop, drains = threading.Event(), []
    with answering(405) as (url, seen):
        w = watch(url, stop, drains)
        t0 = time.monotonic()
        w.run()
    assert w.unsupported and not stop.is_set() and not drains and time.monotonic() - t0 < 2
    assert seen == ["/v1/runs/r1/workers/gen-1/drain?wait_s=0.1"]


def test_an_outage_is_retried_until_the_worker_stops() -> None:
    stop, drains = threading.Event(), []
    with answering(503) as (url, seen):
        thread = watch(url, stop, drains).start()
        time.sleep(2.5)  # one retry after RETRY_S
        stop.set()
        thread.join(5)
    assert not thread.is_alive() and not drains and len(seen) >= 2
