"""The relay's ASGI app: adapter downloads from the disk cache, everything else forwarded (forward.py)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from bucketrl.relay.cache import CHUNK, AdapterCache, Entry, Follower, Mismatch
from bucketrl.relay.forward import HOP, Gate, Refused, forward, relayed, send, unavailable
from bucketrl.relay.settings import RelaySettings
from bucketrl.relay.staging import StagingFollower
from bucketrl.tls import TransportSecurity
from bucketrl.wire.adapters import StagingList
from bucketrl.wire.common import ID_PATTERN

TAR = "application/x-tar"
_SHA = re.compile(r"^[0-9a-f]{64}$")
_RUN = re.compile(ID_PATTERN)
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


class UpstreamStatus(Exception):
    """The home proxy answered the fetch itself with an error (the version was collected meanwhile...)."""

    def __init__(self, resp: httpx.Response, body: bytes) -> None:
        super().__init__(resp.status_code)
        self.status, self.body = resp.status_code, body
        self.headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP | {"content-length"}}


class HeldFile(FileResponse):
    """A cached file, held against eviction until it has been sent (or the caller went away)."""

    def __init__(self, cache: AdapterCache, held: Entry, headers: dict[str, str]) -> None:
        super().__init__(held.path, media_type=TAR, headers=headers)
        self.cache, self.held = cache, held

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.cache.release(self.held)


class BucketFailed(Exception):
    """A presigned URL that did not answer the tar (expired, refused): the caller asks again."""


class Relay:
    def __init__(self, settings: RelaySettings, security: TransportSecurity | None = None) -> None:
        self.settings = settings
        self.security = security or TransportSecurity.from_env()
        self.cache = AdapterCache(settings.cache_dir, settings.cache_max_bytes)
        self.gate = Gate(settings.max_pending)
        self.http: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        assert self.http is not None, "the relay's lifespan has not started"
        return self.http

    async def adapter(self, request: Request) -> Response:
        """Authorized upstream for every caller (a conditional GET: 304 + sha256, or the error to answer),
        served from the cache, fetched once per version."""
        http, run, version = self.client(), request.path_params["run"], request.path_params["version"]
        try:
            probe = await send(http, request, self.gate, {"If-None-Match": "*"})
        except Refused as exc:
            return unavailable(str(exc))
        except httpx.TransportError as exc:
            return unavailable(f"home proxy unreachable: {exc!r}")
        if probe.status_code != 304:
            return relayed(probe)  # 401, 403, 404, 410... or an older proxy's 200 with the body
        await probe.aclose()
        sha = probe.headers.get("X-Content-SHA256", "").strip().lower()
        if not _SHA.match(sha) or not _RUN.match(run):
            return unavailable(f"home proxy answered no usable sha256 for {run}/v{version}")
        auth = {"Authorization": v} if (v := request.headers.get("authorization")) else {}
        if self.settings.presigned:  # a 307 to the bucket, where the proxy presigns (BUCKETRL_PRESIGN_ADAPTERS_S)
            auth["X-Bucketrl-Presign"] = "1"

        async def fetch() -> AsyncIterator[bytes]:
            async with http.stream("GET", request.url.path, headers=auth) as resp:
                location = resp.headers.get("location") if resp.status_code == 307 else None
                if location is None and resp.status_code != 200:
                    raise UpstreamStatus(resp, await resp.aread())
                if location is None:
                    async for chunk in resp.aiter_bytes(CHUNK):
                        yield chunk
            if location is not None:
                async for chunk in self._from_bucket(location):
                    yield chunk

        # A worker whose download did not hash right asks again with no-cache: the cached file is hashed first.
        fresh = "no-cache" in request.headers.get("cache-control", "").lower()
        try:
            held = await self.cache.open(run, version, sha, fetch, fresh=fresh)
        except UpstreamStatus as exc:
            return Response(exc.body, status_code=exc.status, headers=exc.headers)
        except (httpx.TransportError, Mismatch, BucketFailed) as exc:
            return unavailable(f"fetching {run}/v{version} from the home proxy failed: {exc!r}")
        headers = {"X-Content-SHA256": sha, "ETag": f'"{sha}"'}
        if isinstance(held, Follower):
            # Chunked, no Content-Length: a fetch that fails under it ends the body without its last chunk, which
            # the caller's HTTP library reports as a truncated answer (and the sha256 header catches the rest).
            return StreamingResponse(held.chunks(), media_type=TAR, headers=headers)
        return HeldFile(self.cache, held, headers)

    async def _from_bucket(self, url: str) -> AsyncIterator[bytes]:
        """A presigned URL's bytes: no token goes there (the URL is the credential), and the bucket's certificate
        is a public one (the system store and certifi's roots, not BUCKETRL_CA_FILE's private CA)."""
        self.cache.stats.bucket_fetches += 1
        async with (
            httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=self.settings.connect_timeout_s)) as bucket,
            bucket.stream("GET", url) as resp,
        ):
            if resp.status_code != 200:
                raise BucketFailed(f"the bucket answered {resp.status_code} to the presigned URL")
            async for chunk in resp.aiter_bytes(CHUNK):
                yield chunk

    async def stats(self, _: Request) -> Response:
        gate = {"pending": self.gate.pending, "refused": self.gate.refused, "in_flight": self.cache.in_flight()}
        return JSONResponse({**dataclasses.asdict(self.cache.stats), **gate})

    async def staging_here(self, _: Request) -> Response:
        """A generator behind this relay asking for staged uploads: none here (the relay stages for the whole region
        into its cache). Forwarded, each generator would pull every upload across the slow link itself."""
        return JSONResponse(StagingList(instance="", seq=0).model_dump(mode="json"))

    async def other(self, request: Request) -> Response:
        return await forward(self.client(), request, self.gate)

    @contextlib.asynccontextmanager
    async def lifespan(self, _: Starlette) -> AsyncIterator[None]:
        s = self.settings
        # A pool slot is waited for a while, not for ever: all of them held by requests stuck on a dropped link.
        timeout = httpx.Timeout(connect=s.connect_timeout_s, read=None, write=60.0, pool=30.0)
        # Idle upstream connections are dropped before uvicorn's 5 s keep-alive closes them: reusing one the server is
        # closing at that moment fails the request (RemoteProtocolError), seen in bench/wan.py.
        limits = httpx.Limits(max_connections=s.max_connections, max_keepalive_connections=64, keepalive_expiry=2.0)
        verify = self.security.verify()  # BUCKETRL_CA_FILE or the system store: the callers' tokens go up this link
        async with httpx.AsyncClient(
            base_url=s.upstream_url, timeout=timeout, limits=limits, verify=verify
        ) as self.http:
            if not s.staging_token:
                yield
                return
            follower = StagingFollower(self.http, self.cache, s.staging_token)
            polling = asyncio.create_task(follower.run())
            try:
                yield
            finally:
                polling.cancel()
                with contextlib.suppress(BaseException):
                    await polling
                await follower.close()


def create_app(settings: RelaySettings, security: TransportSecurity | None = None) -> Starlette:
    relay = Relay(settings, security)
    routes = [
        Route("/relay/stats", relay.stats, methods=["GET"]),
        Route("/v1/runs/{run}/adapters/{version:int}", relay.adapter, methods=["GET"]),
        Route("/v1/staging", relay.staging_here, methods=["GET"]),
        Route("/{path:path}", relay.other, methods=METHODS),
    ]
    app = Starlette(routes=routes, lifespan=relay.lifespan)
    app.state.relay = relay
    return app
