"""The one table that turns exceptions into HTTP answers.

Every error answer is ``{"error": {"code", "message", "retryable"}}`` (:class:`bucketrl.wire.ErrorBody`):

=============================================  ======  =======================  =========
exception                                      status  code                     retryable
=============================================  ======  =======================  =========
``bucketrl.errors.BucketRLError`` subclasses   its     its ``code``             its flag
``Backpressure``                               429     backpressure (+ Retry-After header)
``Unavailable`` (bucket outage, ...)           503     unavailable (+ Retry-After header)
``redis`` ConnectionError / TimeoutError       503     redis_unavailable (+ Retry-After)  yes
``RequestValidationError`` (query/path/body)   422     invalid (names the field)
``starlette`` HTTPException (404 route, 405)   its     not_found / http_<n>
``ClientDisconnect`` (hung up mid-body)        400     client_disconnected      yes
anything else                                  500     internal (logged; no internals leak)
=============================================  ======  =======================  =========

Domain code raises :mod:`bucketrl.errors`; it never builds responses or raises ``HTTPException``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis import exceptions as redis_exc
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from bucketrl import errors
from bucketrl.wire import ErrorBody

log = logging.getLogger("bucketrl.proxy")

# Retry-After of a 503 (an outage of Redis or the bucket): soon enough to notice the recovery quickly, far
# enough apart that a fleet of workers does not hammer a proxy that cannot serve them.
OUTAGE_RETRY_AFTER_S = 1


def error_response(
    status: int, code: str, message: str, retryable: bool, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = {"error": {"code": code, "message": message, "retryable": retryable}}
    return JSONResponse(body, status_code=status, headers=headers)


def _route_of(request: Request) -> str:
    route = request.scope.get("route")
    return getattr(route, "path_format", None) or getattr(route, "path", None) or "unmatched"


def describe_validation(errs: Sequence[Any], total: int | None = None) -> str:
    """``body.groups.0.completions.1.logprobs: logprobs[3] = 0.5 is not a finite value <= 0; ...``

    The first five of ``errs``; ``total`` (default ``len(errs)``) counts them all for "and N more"."""
    parts = []
    for e in list(errs)[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "__root__") or "body"
        msg = str(e.get("msg", "invalid"))
        parts.append(f"{loc}: {msg}")
    more = (len(errs) if total is None else total) - 5
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


async def _bucketrl_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, errors.BucketRLError)
    headers: dict[str, str] = {}
    if isinstance(exc, errors.Backpressure):
        retry_after = exc.retry_after if exc.retry_after is not None else 1.0
        # Retry-After must be an integer number of seconds (RFC 9110): round up, at least 1, except an explicit 0
        # (a long-poll that already waited: retry at once).
        headers["Retry-After"] = "0" if retry_after == 0 else str(max(1, math.ceil(retry_after)))
        ctx = getattr(request.app.state, "ctx", None)
        if ctx is not None:
            ctx.telemetry.backpressure_rejections.labels(route=_route_of(request)).inc()
    if isinstance(exc, errors.Unavailable):
        seconds = exc.retry_after if exc.retry_after is not None else OUTAGE_RETRY_AFTER_S
        headers["Retry-After"] = str(max(1, math.ceil(seconds)))
    if exc.status >= 500:
        log.warning("%s %s -> %s %s: %s", request.method, request.url.path, exc.status, exc.code, exc.message)
    return error_response(exc.status, exc.code, exc.message, exc.retryable, headers or None)


async def _redis_down(request: Request, exc: Exception) -> JSONResponse:
    log.warning("%s %s -> 503: redis unreachable: %r", request.method, request.url.path, exc)
    return error_response(
        503,
        "redis_unavailable",
        "coordination store (Redis) unreachable; retry",
        True,
        {"Retry-After": str(OUTAGE_RETRY_AFTER_S)},
    )


async def _validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(422, "invalid", describe_validation(exc.errors()), False)


async def _http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, f"http_{exc.status_code}")
    return error_response(exc.status_code, code, str(exc.detail), False, dict(exc.headers or {}) or None)


async def _disconnected(request: Request, exc: Exception) -> JSONResponse:
    # The client hung up mid-body (nothing was committed: bodies are spooled before any write). Nobody
    # reads this answer; it only keeps the log free of a misleading 500 traceback.
    log.info("%s %s: client disconnected before sending its whole body", request.method, request.url.path)
    return error_response(400, "client_disconnected", "client disconnected mid-request", True)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("%s %s -> 500", request.method, request.url.path)
    return error_response(500, "internal", "internal error (logged by the proxy)", True)


def install(app: FastAPI) -> None:
    """Register the whole table on ``app``."""
    app.add_exception_handler(errors.BucketRLError, _bucketrl_error)
    app.add_exception_handler(redis_exc.ConnectionError, _redis_down)
    app.add_exception_handler(redis_exc.TimeoutError, _redis_down)
    app.add_exception_handler(redis_exc.BusyLoadingError, _redis_down)
    app.add_exception_handler(redis_exc.ReadOnlyError, _redis_down)  # a replica during failover
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(ClientDisconnect, _disconnected)
    app.add_exception_handler(Exception, _unexpected)


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` for a route: each listed error status documented with :class:`ErrorBody`."""
    text = {
        401: "Missing or unknown bearer token.",
        403: "The token's role may not call this route.",
        404: "Unknown run (or the named object does not exist).",
        409: "Conflict (see the error code: conflict, fenced, stale, repeated).",
        410: "Gone: garbage-collected version or expired lease.",
        413: "Body larger than the route's limit (refused before it was read whole).",
        415: "A Content-Type the route does not read.",
        422: "Schema or semantic validation failed; the message names the field.",
        429: "Backpressure: retry after the Retry-After header's seconds.",
        503: "Redis or the bucket is unreachable; retryable.",
    }
    out: dict[int | str, dict[str, Any]] = {}
    for s in statuses:
        entry: dict[str, Any] = {"model": ErrorBody, "description": text.get(s, "Error.")}
        if s in (429, 503):
            entry["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds to wait."}}
        out[s] = entry
    return out
