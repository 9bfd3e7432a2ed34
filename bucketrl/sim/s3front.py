"""A slow, counting front for an S3 endpoint: every request waits ``--latency-ms`` (plus exponential jitter of
mean ``--jitter-ms``) before it is forwarded, and is counted by S3's billing classes.

Benchmarks put it between the proxy and a moto server, so the proxy sees a real S3 HTTP endpoint with
the per-request latency of a cloud bucket (moto on loopback answers in about a millisecond; S3 takes tens),
and the run's bucket traffic can be priced. It is a test fixture for the edge that is unavailable here
(a cloud bucket), not part of the system.

    python -m bucketrl.sim.s3front --upstream http://127.0.0.1:5000 --port 5001 --latency-ms 20

``GET /_front/stats`` (not delayed, not counted) answers ``{"PUT": n, "GET": n, "LIST": n, "DELETE": n,
"OTHER": n}``. Classes: PUT is a PUT or a multipart POST (S3 bills PUT, COPY, POST and LIST at one rate);
LIST is a GET on the bucket (ListObjects); DELETE is a DELETE or a multi-object delete (``POST ?delete``),
which S3 does not bill; GET is every other read (GET, HEAD).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections import Counter
from typing import Any
from urllib.parse import parse_qs

import httpx

CLASSES = ("PUT", "GET", "LIST", "DELETE", "OTHER")
# Published S3 Standard request prices (us-east-1, USD per 1,000 requests); DELETE is free.
PRICE_PER_1000 = {"PUT": 0.005, "LIST": 0.005, "GET": 0.0004, "DELETE": 0.0, "OTHER": 0.0004}
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "te", "upgrade", "proxy-connection"}


def classify(method: str, path: str, query: str) -> str:
    """S3's billing class of a path-style request (``/bucket`` or ``/bucket/key``)."""
    has_key = "/" in path.strip("/")
    params = parse_qs(query, keep_blank_values=True)
    if method == "DELETE" or (method == "POST" and "delete" in params):
        return "DELETE"
    if method in ("PUT", "POST"):
        return "PUT"
    if method in ("GET", "HEAD"):
        return "GET" if has_key else "LIST"
    return "OTHER"


def cost_usd(counts: dict[str, float]) -> float:
    return sum(PRICE_PER_1000.get(k, 0.0) * v / 1000.0 for k, v in counts.items())


class SlowS3Front:
    """An ASGI app: delay, count, forward."""

    def __init__(self, upstream: str, latency_ms: float, jitter_ms: float = 0.0, seed: int = 0) -> None:
        self.upstream = upstream.rstrip("/")
        self.latency_s = latency_ms / 1000.0
        self.jitter_s = jitter_ms / 1000.0
        self.counts: Counter[str] = Counter({c: 0 for c in CLASSES})
        self._rng = random.Random(seed)
        self._http: httpx.AsyncClient | None = None

    def delay(self) -> float:
        return self.latency_s + (self._rng.expovariate(1.0 / self.jitter_s) if self.jitter_s > 0 else 0.0)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
                    self._http = httpx.AsyncClient(timeout=120.0, limits=limits)
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    if self._http is not None:
                        await self._http.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        method, path = scope["method"], scope["path"]
        query = scope.get("query_string", b"").decode()
        if path == "/_front/stats":
            await _answer(send, 200, [(b"content-type", b"application/json")], json.dumps(self.counts).encode())
            return
        chunks = []
        while True:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        self.counts[classify(method, path, query)] += 1
        await asyncio.sleep(self.delay())
        assert self._http is not None
        headers = [(k, v) for k, v in scope["headers"] if k.decode().lower() not in _HOP]
        url = self.upstream + path + (f"?{query}" if query else "")
        resp = await self._http.request(method, url, headers=headers, content=b"".join(chunks))
        out = [(k.encode(), v.encode()) for k, v in resp.headers.items() if k.lower() not in _HOP]
        await _answer(send, resp.status_code, out, resp.content)


async def _answer(send: Any, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    app = SlowS3Front(args.upstream, args.latency_ms, args.jitter_ms)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
