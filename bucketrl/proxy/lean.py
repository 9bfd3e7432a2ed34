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
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.routing import APIRoute, request_response
from pydantic import TypeAdapter
from starlette.routing import Match

from bucketrl.proxy import body, deps, rollout_body
from bucketrl.proxy.routes import prompts as prompt_routes
from bucketrl.proxy.state import prompt_lease
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


# The specs of runs this process leased prompts for, with their digests: the next lease of the run takes its
# spec from here, and the lease's own script checks the digest against the stored spec (one Redis round trip
# instead of two). Bounded: only runs that exist get in, and it starts over past _SPECS_MAX of them.
_LEASE_SPECS: dict[str, tuple[deps.RunRef, str]] = {}
_SPECS_MAX = 1024


async def _prompt_lease(request: Request, endpoint: Callable[..., Any]) -> Any:
    run = _run(request)
    await _GENERATOR(request, None)
    ctx = request.app.state.ctx
    known = _LEASE_SPECS.get(run)
    ref, digest = known if known is not None else await _read_spec(request, run)
    req = await _PROMPT_LEASE(request)
    try:
        return await prompt_routes.lease_prompts(ctx, ref, req, digest)
    except prompt_lease.SpecChanged:
        if known is None:  # read in this very request and already another one: leave it unchecked this once
            return await prompt_routes.lease_prompts(ctx, await deps.get_run(request, run), req)
    # Another spec was stored since this process cached it (or the run is gone): read it as the route does.
    ref, digest = await _read_spec(request, run)
    return await prompt_routes.lease_prompts(ctx, ref, req, digest)


async def _read_spec(request: Request, run: str) -> tuple[deps.RunRef, str]:
    _LEASE_SPECS.pop(run, None)
    ref = await deps.get_run(request, run)  # 404 unknown_run, a wiped Redis rebuilt, as the route's RunDep
    if len(_LEASE_SPECS) >= _SPECS_MAX:
        _LEASE_SPECS.clear()
    _LEASE_SPECS[run] = ref, prompt_lease.spec_digest(ref.spec)
    return _LEASE_SPECS[run]


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


@dataclass(frozen=True)
class LeanRoute:
    """One hot route: its FastAPI route (path template, response model, status) and its fast handler."""

    method: str
    route: APIRoute
    fast: Fast
    adapter: TypeAdapter[Any] | None
    status: int

    async def respond(self, request: Request) -> Response:
        """The route's answer through the fast handler; raises :class:`_Slow` for FastAPI's handler to take."""
        value = await self.fast(request, self.route.endpoint)
        if isinstance(value, Response):
            return value
        assert self.adapter is not None, self.route.path
        return Response(self.adapter.dump_json(value, by_alias=True), status_code=self.status, media_type=_JSON)


_JSON = "application/json"


def install(app: FastAPI) -> list[LeanRoute]:
    """Give each hot route of ``app`` its fast handler (FastAPI's stays as the slow path). Returns the routes,
    for :class:`HotPath`."""
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
            _check_first_match(app, route, method)
            adapter = TypeAdapter(route.response_model) if route.response_model else None
            lean = LeanRoute(method, route, fast, adapter, route.status_code or 200)
            route.app = request_response(_handler(route, lean))
            done.append(lean)
    return done


def _check_first_match(app: FastAPI, route: APIRoute, method: str) -> None:
    """HotPath matches its routes directly: no route registered before one of them may take its requests."""
    path = re.sub(r"{[^}]+}", "x", route.path)
    scope = {"type": "http", "path": path, "root_path": "", "method": method}
    for other in app.routes:
        if other is route:
            return
        if other.matches(scope)[0] is Match.FULL:
            raise RuntimeError(f"lean route {method} {route.path}: {path} is taken first by {other!r}")


def _handler(route: APIRoute, lean: LeanRoute) -> Handler:
    # Reached through Starlette's router only when HotPath passed the request on (a path it does not match).
    slow = route.get_route_handler()

    async def handler(request: Request) -> Response:
        try:
            return await lean.respond(request)
        except _Slow:
            return await slow(request)

    return handler


class HotPath:
    """Pure-ASGI layer in front of the bucket-identity gate, the exception middleware and the router: a request
    for a hot route goes straight to its :class:`LeanRoute`.

    Starlette would take every request through its exception middleware, FastAPI's exit-stack middleware, the
    router's walk over all routes and the route's own request/response wrapper, each a coroutine frame and a
    ``send`` wrapper; on the hot routes that chain cost about as much CPU as the handler's own Python. This
    layer takes the same steps for them in one frame: the route matched by Starlette's own ``Route.matches``
    (path template and method), the bucket-identity gate, the handler, and an exception turned into its
    answer by the app's own exception table (what Starlette's ``ExceptionMiddleware`` would do). An exception
    the table sends to the server-error middleware (500) propagates to it, as it would from the router. A
    request that is not plainly well-formed (:class:`_Slow`, raised before its body is read) and every other
    route go down the full stack unchanged.
    """

    def __init__(self, app: Any, routes: list[LeanRoute], identity_gate: Callable[[Any], Awaitable[Any]]) -> None:
        self.app = app
        self.routes = routes
        self.identity_gate = identity_gate

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not scope.get("root_path"):
            for lean in self.routes:
                match, child = lean.route.matches(scope)
                if match is Match.FULL:
                    # In place, as the router does: the latency middleware outside reads the route from it.
                    scope["route"] = lean.route
                    scope.update(child)
                    await self._serve(lean, scope, receive, send)
                    return
        await self.app(scope, receive, send)

    async def _serve(self, lean: LeanRoute, scope: dict[str, Any], receive: Any, send: Any) -> None:
        request = Request(scope, receive, send)
        fastapi_app = scope["app"]
        refused = await self.identity_gate(fastapi_app.state.ctx)
        if refused is not None:
            await refused(scope, receive, send)
            return
        try:
            response = await lean.respond(request)
        except _Slow:
            await self.app(scope, receive, send)
            return
        except Exception as exc:
            handler = _exception_handler(fastapi_app, exc)
            if handler is None:
                raise
            response = await handler(request, exc)
            exc.__traceback__ = None  # as Starlette does: a reused exception instance would pile up tracebacks
        await response(scope, receive, send)


def _exception_handler(app: FastAPI, exc: Exception) -> Callable[..., Awaitable[Response]] | None:
    """The handler Starlette's ``ExceptionMiddleware`` would pick for ``exc`` (most derived class first); None
    for what it leaves to the server-error middleware (the ``Exception`` / 500 handler)."""
    handlers = app.exception_handlers
    for cls in type(exc).__mro__:
        if cls is Exception:
            return None
        handler = handlers.get(cls)
        if handler is not None:
            return handler
    return None
