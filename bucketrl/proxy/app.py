"""The proxy app: ``create_app(settings)`` builds a FastAPI app whose lifespan owns every resource.

Run it with ``bucketrl proxy --host 0.0.0.0 --port 8000`` (see ``cli.py``) or, for a test, mount it on
httpx's ``ASGITransport`` inside ``LifespanManager``-style startup (``tests/proxy/conftest.py``).

Lifespan, in order:
1. Redis client (``redis.asyncio``, bytes responses) and the bucket store (``open_store``).
2. The notifier: one pub/sub connection fanning version and pipeline announcements out to long-polls.
3. Bucket identity (``identity.py``): serve only the bucket this deployment has been using; until it is
   verified every ``/v1`` route answers 503 ``bucket_identity`` (:class:`IdentityGate`).
   Rebuild from the bucket when Redis lost its runs (``rebuild_on_start``; see ``rebuild.py``). If Redis
   is down at start the proxy still starts (``/readyz`` says 503) and the maintenance loop retries.
4. The maintenance loop (``gc.py``): every ``gc_interval_s`` expire leases, collect old versions, sweep
   settled rollout objects a cleaner left, and rebuild again if Redis was wiped while the proxy ran.
5. The batch cleaner (``state/cleanup.py``): settles rollout objects after acks and claims, off the
   request path; drained at shutdown.

Nothing is created at import time, so several apps can live in one process (tests do that).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema
from starlette.responses import Response

from bucketrl.proxy import body, bucket_meter, decode_pool, durability, errors, gc, identity, rebuild
from bucketrl.proxy.adapter_cache import AdapterCache
from bucketrl.proxy.auth import TokenAuth
from bucketrl.proxy.bucket_meter import BucketMeter, MeteredStore
from bucketrl.proxy.context import ProxyContext
from bucketrl.proxy.deps import run_scope
from bucketrl.proxy.notify import Notifier
from bucketrl.proxy.redis_mux import RedisMux
from bucketrl.proxy.redis_pack import fast_packing
from bucketrl.proxy.routes import all_routers
from bucketrl.proxy.runtime import tune_gc
from bucketrl.proxy.settings import ProxySettings
from bucketrl.proxy.staging import Staging
from bucketrl.proxy.state.cleanup import BatchCleaner
from bucketrl.proxy.telemetry import Telemetry
from bucketrl.storage import open_store

log = logging.getLogger("bucketrl.proxy")

API_DESCRIPTION = (
    "Control plane of bucketrl: run specs, trainer fencing, adapter versions and leases, prompt leases, "
    'the rollout queue, checkpoints and metrics. Errors are `{"error": {code, message, retryable}}`.'
)


class LatencyMiddleware:
    """Pure-ASGI request timer: one histogram observation per request, labelled by route TEMPLATE."""

    def __init__(self, app: Any, telemetry: Telemetry) -> None:
        self.app = app
        self.telemetry = telemetry
        # (method, route, status) -> histogram child: ``labels()`` takes a lock and builds keys on every call.
        self._children: dict[tuple[str, str, int], Any] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def send_wrapper(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            found = scope.get("route")  # path_format: the template without convertors ({version}, not {version:int})
            route = getattr(found, "path_format", None) or getattr(found, "path", None) or "unmatched"
            key = (scope["method"], route, status[0])
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = self.telemetry.request_latency.labels(key[0], route, str(key[2]))
            child.observe(time.perf_counter() - start)


async def identity_refusal(ctx: ProxyContext) -> Response | None:
    """The 503 ``bucket_identity`` answer while the bucket is not verified as this deployment's
    (``identity.py``), else None. Once verified, one attribute read."""
    if ctx.identity.ok:
        return None
    state = await identity.check(ctx)
    if state.ok:
        return None
    return errors.error_response(
        503, "bucket_identity", str(state.problem), True, {"Retry-After": str(errors.OUTAGE_RETRY_AFTER_S)}
    )


class IdentityGate:
    """Pure-ASGI gate: ``/v1`` routes answer 503 ``bucket_identity`` until the bucket is verified as this
    deployment's (:func:`identity_refusal`)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            refused = await identity_refusal(scope["app"].state.ctx)
            if refused is not None:
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _build_context(settings: ProxySettings, auth: TokenAuth, telemetry: Telemetry) -> ProxyContext:
    import redis.asyncio as aioredis
    from redis.asyncio.connection import Connection, parse_url
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff

    meter = BucketMeter()
    s3 = {"s3_addressing_style": settings.s3_addressing_style, "s3_region": settings.s3_region or None}
    store = MeteredStore(open_store(settings.bucket_url, s3_endpoint_url=settings.s3_endpoint_url, **s3), meter)
    # A blocking pool: past max_connections a request waits (up to redis_timeout_s) for a connection instead of
    # failing at once. redis-py's default pool refuses more than 100 connections per process, which answered
    # 503 on every route at 128+ simulated generators (bench/scale_sim.py).
    options = parse_url(settings.redis_url)
    # hiredis packs each command (redis_pack.py): a Lua call with 30 arguments cost ~70 us in redis-py's packer.
    # mypy checks a class against Hashable through its unbound __hash__ (a mypy gap): a class is always hashable.
    options["connection_class"] = fast_packing(options.get("connection_class", Connection))  # type: ignore[arg-type]
    pool = aioredis.BlockingConnectionPool(
        **options,
        max_connections=settings.redis_max_connections,
        timeout=settings.redis_timeout_s,
        decode_responses=False,
        socket_connect_timeout=settings.redis_timeout_s,
        socket_timeout=settings.redis_timeout_s,
        # A restarted Redis leaves dead pooled connections: PING one idle for over a second and retry a
        # command that hit a dead connection twice (fast backoff). Every proxy write tolerates a repeat:
        # commits re-check their lock (a repeated one answers 409 and the client's retry is idempotent).
        health_check_interval=1,
        retry=Retry(ExponentialBackoff(cap=0.25, base=0.02), 2),
    )
    redis = aioredis.Redis.from_pool(pool)
    # The Lua calls of concurrent requests share one pipelined connection (redis_mux.py; state/lua.py uses it).
    # An attribute of our own on redis-py's client (state/lua.py looks it up with getattr), unknown to its types.
    redis.bucketrl_mux = RedisMux(pool)  # type: ignore[attr-defined]
    return ProxyContext(settings=settings, redis=redis, store=store, telemetry=telemetry, auth=auth, meter=meter)


def create_app(settings: ProxySettings | None = None, *, serving: bool = False) -> FastAPI:
    """A new proxy app. Raises ValueError for a configuration it refuses (tokens, anonymous off-loopback).

    ``serving``: this process exists to serve the app (``bucketrl proxy``): tune the process for it once the
    app has started (``runtime.py``). Tests leave it off."""
    settings = settings or ProxySettings()
    if serving:
        # httptools is optional (``cli._http_protocol``): imported only by a process that serves
        from bucketrl.proxy import http_protocol

        http_protocol.HEADER_TIMEOUT_S = settings.header_timeout_s
    auth = TokenAuth.from_settings(
        settings.tokens, settings.tokens_file, settings.allow_anonymous, settings.host, settings.insecure_dev_tokens
    )
    telemetry = Telemetry()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx = await _build_context(settings, auth, telemetry)
        ctx.cleaner = BatchCleaner(ctx.redis, ctx.store)
        if settings.adapter_cache_mb > 0:
            ctx.adapter_cache = AdapterCache(settings.adapter_cache_mb * 1024 * 1024)
        # Staged only where someone may read it: a relay's token, or generators fetching from this proxy.
        if settings.staging_mb > 0 and (auth.anonymous or auth.has_role("relay") or auth.has_role("generator")):
            ctx.staging = Staging(settings.staging_mb * 1024 * 1024)
        app.state.ctx = ctx
        ctx.notifier = Notifier.from_url(settings.redis_url, settings.redis_timeout_s)
        ctx.notifier.start()
        await durability.warn_if_rollback_possible(ctx.redis)
        if not (await identity.check(ctx, force=True)).ok:
            log.warning("not serving yet: %s (rechecked on requests and by the maintenance loop)", ctx.identity.problem)
        elif settings.rebuild_forced:
            restored = await rebuild.rebuild_all(ctx)
            log.warning("--rebuild: restored %d run(s) from the bucket: %s", len(restored), ", ".join(restored))
        elif settings.rebuild_on_start:
            await rebuild.rebuild_if_wiped(ctx)
        if serving:
            tune_gc()
            decode_pool.warm()  # the first large body should not wait for the decoder process to start
        stop = asyncio.Event()
        maintenance = asyncio.create_task(gc.maintenance_loop(ctx, stop), name="bucketrl-maintenance")
        try:
            yield
        finally:
            stop.set()
            try:
                await asyncio.wait_for(maintenance, 10.0)  # let a pass in progress finish its deletions
            except (asyncio.CancelledError, Exception):
                maintenance.cancel()
            # What the cleaner has not finished stays in queue:doomed for the next sweep (any replica).
            await ctx.cleaner.drain(10.0)
            with contextlib.suppress(Exception):  # the last counts; a Redis already gone loses them
                await bucket_meter.flush(ctx.redis, ctx.meter)
            await ctx.notifier.stop()
            await ctx.redis.bucketrl_mux.aclose()  # type: ignore[attr-defined]  # set by _build_context() above
            await ctx.redis.aclose()

    # run_scope on the app, not on each route: every route, including one added later, checks a token's run
    # scope before its own dependencies run.
    app = FastAPI(
        title="bucketrl proxy",
        version="1",
        description=API_DESCRIPTION,
        lifespan=lifespan,
        dependencies=[Depends(run_scope)],
    )
    errors.install(app)
    for router in all_routers():
        app.include_router(router)
    app.add_middleware(IdentityGate)
    app.add_middleware(LatencyMiddleware, telemetry=telemetry)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def serving_app() -> FastAPI:
    """The app of a serving process: the factory ``bucketrl proxy --workers N`` gives each uvicorn worker."""
    return create_app(serving=True)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the models of bodies read through ``body.decoded`` (JSON or msgpack)."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    _document_415(schema)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    if body.DOCUMENTED_BODIES:
        _, defs = models_json_schema(
            [(m, "validation") for m in body.DOCUMENTED_BODIES.values()], ref_template="#/components/schemas/{model}"
        )
        for name, definition in defs.get("$defs", {}).items():
            components.setdefault(name, definition)
    app.openapi_schema = schema
    return schema


def _document_415(schema: dict[str, Any]) -> None:
    """Every operation reading a structured body answers 415 for another Content-Type (``body.decoded``)."""
    ref = {"$ref": "#/components/schemas/ErrorBody"}
    for ops in schema.get("paths", {}).values():
        for op in ops.values():
            content = op.get("requestBody", {}).get("content", {})
            if "application/json" in content:
                op.setdefault("responses", {}).setdefault(
                    "415",
                    {
                        "description": "A Content-Type the route does not read.",
                        "content": {"application/json": {"schema": ref}},
                    },
                )
