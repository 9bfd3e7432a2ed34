"""Streaming reverse proxy to the home proxy: method, path, query, headers (the caller's token among them) and
body go up as they are; status, headers (``Retry-After``...) and body come back as they are, chunk by chunk.

No read timeout upstream: long-polls last as long as the caller asked (``wait_s``), and the caller's own client
times out a request that hangs. A home proxy that cannot be reached is a retryable 503 in the proxy's error shape,
so a worker's client rides it out like any outage (with the same idempotency key: nothing is lost or done twice).

What waits here on the home proxy is bounded (:class:`Gate`): at most ``max_pending`` requests at a time, and
while a connect has just failed (the link is down) one request at a time probes it and the others are answered
503 at once, so an outage costs the relay no pile of stuck requests, and the workers back off instead.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

log = logging.getLogger("bucketrl.relay.forward")

# Hop-by-hop headers (RFC 9110 7.6.1) belong to one connection, not to the request; Host names the relay.
HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "transfer-encoding"}
    | {"upgrade", "host"}
)


# After a failed connect, how long the link counts as down (one probe at a time meanwhile).
DOWN_S = 1.0
# Bodies up to this size are read before they are sent, so a send that met a closed connection can be repeated.
REPLAYABLE_BYTES = 1 << 20


class Refused(Exception):
    """The relay does not send this request upstream now (its backlog is full, or the link is down)."""


@dataclass
class Gate:
    max_pending: int
    pending: int = 0  # sent (or being sent) upstream, no answer yet
    refused: int = 0
    down_until: float = 0.0

    def admit(self) -> None:
        if self.pending >= self.max_pending:
            self.refused += 1
            raise Refused(f"{self.pending} requests already wait on the home proxy (BUCKETRL_RELAY_MAX_PENDING)")
        if self.pending and time.monotonic() < self.down_until:
            self.refused += 1
            raise Refused("the home proxy was unreachable a moment ago; one request at a time probes it")


def unavailable(message: str) -> Response:
    body = {"error": {"code": "unavailable", "message": f"relay: {message}"[:500], "retryable": True}}
    return Response(json.dumps(body), status_code=503, media_type="application/json", headers={"Retry-After": "1"})


def upstream_request(
    http: httpx.AsyncClient, request: Request, extra: dict[str, str] | None = None, body: bytes | None = None
) -> httpx.Request:
    """``body``: the request's body read already (it can be sent again); else the body streams through."""
    extra = extra or {}
    replaced = HOP | {k.lower() for k in extra}
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in replaced] + list(extra.items())
    has_body = "content-length" in request.headers or "transfer-encoding" in request.headers
    url = httpx.URL(path=request.url.path, query=request.url.query.encode())
    content = body if body is not None else request.stream() if has_body else None
    return http.build_request(request.method, url, headers=headers, content=content)


def relayed(resp: httpx.Response) -> StreamingResponse:
    """An upstream answer handed back as it comes (raw: a compressed body stays compressed, its length right)."""
    headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP}
    return StreamingResponse(
        resp.aiter_raw(), status_code=resp.status_code, headers=headers, background=BackgroundTask(resp.aclose)
    )


async def send(
    http: httpx.AsyncClient, request: Request, gate: Gate, extra: dict[str, str] | None = None
) -> httpx.Response:
    """Sent upstream, if the gate admits it (:class:`Refused` if not). Sent once more if a pooled connection was
    closed under it (the server closing an idle keep-alive as it is reused, which it never read): a small body is
    read first so it can be; a large one streams through, and the caller's client resends that one. A second send
    of a request the server did process is what the caller's own retry would be: the same idempotency key."""
    size = request.headers.get("content-length", "")
    body = await request.body() if size.isdigit() and int(size) <= REPLAYABLE_BYTES else None
    gate.admit()
    gate.pending += 1
    req = upstream_request(http, request, extra, body)
    try:
        try:
            return await http.send(req, stream=True)
        except httpx.RemoteProtocolError:
            if body is None and (req.headers.get("content-length") or req.headers.get("transfer-encoding")):
                raise
            return await http.send(upstream_request(http, request, extra, body), stream=True)
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout):
        gate.down_until = time.monotonic() + DOWN_S
        raise
    finally:
        gate.pending -= 1


async def forward(http: httpx.AsyncClient, request: Request, gate: Gate) -> Response:
    try:
        resp = await send(http, request, gate)
    except Refused as exc:
        return unavailable(str(exc))
    except httpx.TransportError as exc:
        log.warning("relay: %s %s: home proxy unreachable: %r", request.method, request.url.path, exc)
        return unavailable(f"home proxy unreachable: {exc!r}")
    return relayed(resp)
