"""The dashboard: a static page at ``/`` and ``/ui`` that charts the metrics workers push.

The page (``bucketrl/proxy/static/``: ``index.html``, ``dashboard.js``, ``dashboard.css``; no CDN, no
build step, charts drawn on plain canvas) polls two viewer routes every two seconds:

- ``GET /v1/runs/{run}/metrics/recent`` (P2): the capped stream of metric pushes, oldest first;
- ``GET /v1/runs/{run}/status``: versions, queue depth, workers and their loaded versions.

and one route of this module, ``GET /ui/api/runs``, to offer the runs Redis knows. The page and its assets
need no token (they hold no data); the data routes need a viewer token, which the page takes from
``#token=...`` in its URL (never sent to the server in the URL, so not in access logs) or its token box,
and keeps in the browser's localStorage. Open it at ``http://<proxy>/ui?run=<run>``.
"""

from __future__ import annotations

from importlib import resources
from typing import Annotated

from fastapi import APIRouter, Path, Response
from fastapi.responses import HTMLResponse, RedirectResponse

from bucketrl import errors
from bucketrl.proxy.deps import CtxDep, ViewerRole
from bucketrl.proxy.errors import responses
from bucketrl.proxy.state import runs
from bucketrl.wire.common import WireModel

router = APIRouter(tags=["dashboard"])

# The only files served, with their media types: a name outside this table is a 404, so no path ever
# reaches the filesystem from the URL.
ASSETS: dict[str, str] = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
# The page changes with the package; a browser must not keep an old one across an upgrade.
NO_CACHE = {"Cache-Control": "no-cache"}


class RunList(WireModel):
    runs: list[str]


def _asset(name: str) -> bytes:
    return resources.files("bucketrl.proxy").joinpath("static", name).read_bytes()


@router.get("/", summary="Redirect to the dashboard.", response_class=RedirectResponse, status_code=307)
async def root() -> RedirectResponse:
    return RedirectResponse("/ui", status_code=307)


@router.get(
    "/ui",
    summary="The dashboard page (live charts of the pushed metrics; `?run=<run>`).",
    response_class=HTMLResponse,
    responses={200: {"content": {"text/html": {}}, "description": "The page."}},
)
async def dashboard() -> HTMLResponse:
    return HTMLResponse(_asset("index.html"), headers=NO_CACHE)


@router.get(
    "/ui/static/{name}",
    summary="A static asset of the dashboard (vendored into the package).",
    response_class=Response,
    responses={
        200: {"content": {"text/javascript": {}, "text/css": {}, "text/html": {}}, "description": "The asset."},
        **responses(404, 422),
    },
)
async def static_asset(name: Annotated[str, Path(pattern=r"^[a-z0-9_.-]{1,64}$")]) -> Response:
    media_type = ASSETS.get(name)
    if media_type is None:
        raise errors.NotFound(f"no dashboard asset {name!r}")
    return Response(_asset(name), media_type=media_type, headers=NO_CACHE)


@router.get(
    "/ui/api/runs",
    response_model=RunList,
    summary="The runs this proxy's Redis knows that the caller's token may see (for the dashboard's run picker).",
    responses=responses(401, 403, 422, 503),
)
async def list_runs(ctx: CtxDep, principal: ViewerRole) -> RunList:
    return RunList(runs=[run for run in await runs.list_runs(ctx.redis) if principal.may_run(run)])
