"""The hot routes, served without FastAPI's per-request dependency solving.

FastAPI solves a route's dependency tree on every request through generic machinery (each parameter of each
dependency looked up, its annotation inspected, errors collected) and validates a returned model once more
against ``response_model`` before serialising it. On the routes a worker calls for every group (version lease
and release, prompt lease, rollout submit, claim, ack) that machinery was the largest single share of the
proxy's CPU per request (py-spy over ``bench/proxy_load.py``).

Each of those routes keeps its FastAPI declaration (the OpenAPI schema, and the slow path below) and
:func:`install` gives it a handler of its own that takes the same steps in the same order with direct calls:
the role check (401/403), the run and other path parameters, the headers, the body decoder, then the route's
endpoint function itself, its answer serialised with the route's ``response_model`` and status code. A request
whose path or headers are not plainly well-formed (a parameter failing its pattern, an epoch header that is not
a decimal integer in range) goes to FastAPI's own handler instead, which answers it exactly as before: only
the well-formed path is duplicated here, and it calls the very same functions.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.routing import APIRoute, request_response
from pydantic import TypeAdapter

from bucketrl.proxy import body, deps, rollout_body
from bucketrl.wire import ClaimRequest, PromptLeaseRequest, VersionLeaseRequest
from bucketrl.wire.common import ID_PATTERN, MAX_WIRE_INT
from bucketrl.wire.rollouts import AckRequest

Handler = Callable[[Request], Awaitable[Response]]
Fast = Callable[[Request, Handler], Awaitable[Any]]


def _full(pattern: str) -> re.Pattern[str]:
    # fullmatch: Python's "$" would also accept a trailing newline, which the route's own pattern refuses.
    return re.compile(pattern.removeprefix("^").removesuffix("$"))


_RUN = _full(ID_PATTERN)
_LEASE = _full(r"^[A-Za-z0-9_-]{1,64}$")  # routes/leases.py LeaseIdPath
_EPOCH = re.compile(r"[1-9][0-9]{0,12}")
_GENERATOR = deps.require("generator")
_TRAINER = deps.require("trainer")
_VERSION_LEASE = body.decoded(VersionLeaseRequest)
_PROMPT_LEASE = body.decoded(PromptLeaseRequest)
_CLAIM = body.decoded(ClaimRequest)
_ACK = body.decoded(AckRequest)


class _Slow(Exception):
    """The request is not plainly well-formed: FastAPI's handler answers it."""


def _run(request: Request) -> str:
    run = request.path_params.get("run", "")
    if not _RUN.fullmatch(run):
        raise _Slow
    return run


def _epoch_header(request: Request) -> int | None:
    raw = request.headers.get("x-trainer-epoch")
    if raw is None:
        return None
    if not _EPOCH.fullmatch(raw) or int(raw) > MAX_WIRE_INT:
        raise _Slow
    return int(raw)


# -- the routes, each in its FastAPI signature's order ----------------------------------------------------


async def _submit(request: Request, endpoint: Callable[..., Any]) -> Any:
    run = _run(request)
    principal = await _GENERATOR(request, None)
    submitted = await rollout_body.decoded(request)
    return await endpoint(request.app.state.ctx, principal, run, submitted, request.headers.get("idempotency-key"))


async def _claim(request: Request, endpoint: Callable[..., Any]) -> Any:
    run, header = _run(request), _epoch_header(request)
    principal = await _TRAINER(request, None)
    ref = await deps.get_run(request, run)
    epoch = await deps.get_epoch(request, header)
    req = await _CLAIM(request)
    return await endpoint(request, request.app.state.ctx, principal, ref, epoch, req)


async def _ack(request: Request, endpoint: Callable[..., Any]) -> Any:
    run, header = _run(request), _epoch_header(request)
    principal = await _TRAINER(request, None)
    epoch = await deps.get_epoch_header(request, header)
    req = await _ACK(request)
    return await endpoint(request.app.state.ctx, principal, run, epoch, req)


async def _create_lease(request: Request, endpoint: Callable[..., Any]) -> Any:
    run = _run(request)
    principal = await _GENERATOR(request, None)
    req = await _VERSION_LEASE(request)
    return await endpoint(request.app.state.ctx, principal, run, req)


async def _release_lease(request: Request, endpoint: Callable[..., Any]) -> Any:
    run, lease_id = _run(request), request.path_params.get("lease_id", "")
    if not _LEASE.fullmatch(lease_id):
        raise _Slow
    principal = await _GENERATOR(request, None)
    return await endpoint(request.app.state.ctx, principal, run, lease_id)


async def _prompt_lease(request: Request, endpoint: Callable[..., Any]) -> Any:
    run = _run(request)
    principal = await _GENERATOR(request, None)
    ref = await deps.get_run(request, run)
    req = await _PROMPT_LEASE(request)
    return await endpoint(request.app.state.ctx, principal, ref, req)


# (method, path) -> (the endpoint's name, its fast handler): the name guards against serving a route whose
# endpoint (and so signature) changed under the same path.
ROUTES: dict[tuple[str, str], tuple[str, Callable[[Request, Callable[..., Any]], Awaitable[Any]]]] = {
    ("POST", "/v1/runs/{run}/rollouts"): ("submit", _submit),
    ("POST", "/v1/runs/{run}/rollouts/claim"): ("claim", _claim),
    ("POST", "/v1/runs/{run}/rollouts/ack"): ("ack", _ack),
    ("POST", "/v1/runs/{run}/leases"): ("create_lease", _create_lease),
    ("DELETE", "/v1/runs/{run}/leases/{lease_id}"): ("release_lease", _release_lease),
    ("POST", "/v1/runs/{run}/prompts/lease"): ("lease", _prompt_lease),
}


def install(app: FastAPI) -> list[str]:
    """Give each hot route of ``app`` its fast handler (FastAPI's stays as the slow path). Returns the routes."""
    done = []
    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        for method in route.methods:
            entry = ROUTES.get((method, route.path))
            if entry is None:
                continue
            name, fast = entry
            if route.endpoint.__name__ != name:
                raise RuntimeError(f"lean route {method} {route.path}: its endpoint is now {route.endpoint.__name__}")
            route.app = request_response(_handler(route, fast))
            done.append(f"{method} {route.path}")
    return done


def _handler(route: APIRoute, fast: Callable[[Request, Callable[..., Any]], Awaitable[Any]]) -> Handler:
    slow = route.get_route_handler()
    endpoint = route.endpoint
    status = route.status_code or 200
    adapter: TypeAdapter[Any] | None = TypeAdapter(route.response_model) if route.response_model else None

    async def handler(request: Request) -> Response:
        try:
            value = await fast(request, endpoint)
        except _Slow:
            return await slow(request)
        if isinstance(value, Response):
            return value
        assert adapter is not None, route.path
        return Response(adapter.dump_json(value, by_alias=True), status_code=status, media_type="application/json")

    return handler
