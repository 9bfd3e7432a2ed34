"""The hot routes' own handlers (``bucketrl/proxy/lean.py``) answer exactly what FastAPI's did, and the proxy's
Redis commands are packed by hiredis byte for byte as redis-py packs them (``bucketrl/proxy/redis_pack.py``).

Each request below is sent twice to the same real proxy (uvicorn, Redis, bucket): once through the lean handler,
once through FastAPI's own (swapped in on the route), and the two answers must match: the status, and the error
body or the answer's fields. The requests cover the happy path and every refusal the routes' parameters and
dependencies make (401, 403, 404, 409, 415, 422 on the path, a header, the body), in FastAPI's order.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import msgpack
import pytest
from fastapi.routing import APIRoute, request_response
from redis.asyncio.connection import Connection

from bucketrl import errors
from bucketrl.proxy import lean
from bucketrl.proxy.app import create_app
from bucketrl.proxy.redis_pack import fast_packing
from bucketrl.proxy.settings import ProxySettings
from bucketrl.wire import packed
from tests.proxy.harness import TOKENS, ProxyHarness, make_spec
from tests.proxy.test_rollouts_routes import Setup


def test_every_lean_route_exists_with_its_endpoint() -> None:
    # install() raises if a listed route's endpoint changed name (its signature may have changed too)
    app = create_app(ProxySettings(tokens="admin:" + "x" * 32))
    assert sorted(f"{r.method} {r.route.path}" for r in lean.install(app)) == sorted(f"{m} {p}" for m, p in lean.ROUTES)


def _hot_routes(proxy: ProxyHarness) -> list[APIRoute]:
    return [
        r for r in proxy.app.routes if isinstance(r, APIRoute) and any((m, r.path) in lean.ROUTES for m in r.methods)
    ]


@contextmanager
def fastapi_handlers(proxy: ProxyHarness) -> Iterator[None]:
    """The hot routes served by FastAPI's own handlers, through Starlette's whole middleware chain and router,
    while inside (HotPath, in front of them, matches none of its routes meanwhile)."""
    hot: list[lean.LeanRoute] = proxy.app.state.lean_routes
    saved = list(hot)
    hot.clear()
    routes = _hot_routes(proxy)
    lean_apps = [r.app for r in routes]
    for r in routes:
        r.app = request_response(r.get_route_handler())
    try:
        yield
    finally:
        for r, app in zip(routes, lean_apps, strict=True):
            r.app = app
        hot.extend(saved)


def _shape(resp: httpx.Response) -> tuple[int, Any]:
    """What must match: the status and the error body, or the answer's keys (ids and leases differ per call)."""
    if resp.status_code >= 400:
        return resp.status_code, resp.json()
    if not resp.content:
        return resp.status_code, None
    if resp.headers.get("content-type", "").startswith("application/msgpack"):
        return resp.status_code, sorted(msgpack.unpackb(resp.content))
    return resp.status_code, sorted(resp.json())


def test_lean_handlers_answer_what_fastapi_answers(proxy_file: ProxyHarness) -> None:
    s = Setup(proxy_file, queue_capacity_groups=64, groups_per_step=16)
    epoch = str(s.t.epoch)
    gen = {"Authorization": f"Bearer {TOKENS['generator']}"}
    trn = {"Authorization": f"Bearer {TOKENS['trainer']}", "X-Trainer-Epoch": epoch}
    view = {"Authorization": f"Bearer {TOKENS['viewer']}"}
    lease_body = {"worker_id": "gen-0", "ttl_s": 60}
    claim_body = {"consumer": "trainer-0", "max_groups": 1}

    def submit_body() -> bytes:
        return packed.packb(s.batch(1))

    def requests() -> list[tuple[str, str, dict[str, str], Any]]:
        live = s.g.lease_version("gen-0").lease_id
        sub = {**gen, "Content-Type": "application/msgpack", "Idempotency-Key": uuid.uuid4().hex}
        return [
            # version leases
            ("POST", s.path("/leases"), gen, lease_body),
            ("POST", s.path("/leases"), {}, lease_body),
            ("POST", s.path("/leases"), view, lease_body),
            ("POST", "/v1/runs/nope/leases", gen, lease_body),
            ("POST", "/v1/runs/bad$run/leases", gen, lease_body),
            ("POST", s.path("/leases"), gen, {"worker_id": "gen-0", "ttl_s": -1}),
            ("POST", s.path("/leases"), {**gen, "Content-Type": "text/plain"}, "x"),
            ("POST", s.path("/leases"), gen, {"worker_id": "gen-0", "version": 99}),
            ("DELETE", s.path(f"/leases/{live}"), gen, None),
            ("DELETE", s.path(f"/leases/{live}"), gen, None),  # released already
            ("DELETE", s.path("/leases/bad$id"), gen, None),
            ("DELETE", "/v1/runs/nope/leases/abc", gen, None),
            ("DELETE", s.path(f"/leases/{live}"), view, None),
            # prompt leases
            ("POST", s.path("/prompts/lease"), gen, {"worker_id": "gen-0", "n": 1}),
            ("POST", s.path("/prompts/lease"), gen, {"worker_id": "bad id", "n": 1}),
            ("POST", "/v1/runs/nope/prompts/lease", gen, {"worker_id": "gen-0", "n": 1}),
            ("POST", s.path("/prompts/lease"), trn, {"worker_id": "gen-0", "n": 1}),
            # rollout submit
            ("POST", s.path("/rollouts"), sub, submit_body()),
            ("POST", s.path("/rollouts"), {**sub, "Idempotency-Key": ""}, submit_body()),
            ("POST", s.path("/rollouts"), {k: v for k, v in sub.items() if k != "Idempotency-Key"}, submit_body()),
            ("POST", s.path("/rollouts"), sub, b"\xc1"),
            ("POST", "/v1/runs/nope/rollouts", sub, submit_body()),
            ("POST", "/v1/runs/bad$run/rollouts", sub, submit_body()),
            ("POST", s.path("/rollouts"), {**sub, "Authorization": "Bearer wrong-token-0123456789"}, b""),
            # claim and ack
            ("POST", s.path("/rollouts/claim"), trn, claim_body),
            ("POST", s.path("/rollouts/claim"), {**trn, "Accept": "application/msgpack"}, claim_body),
            ("POST", s.path("/rollouts/claim"), {**trn, "X-Trainer-Epoch": "abc"}, claim_body),
            ("POST", s.path("/rollouts/claim"), {**trn, "X-Trainer-Epoch": "0"}, claim_body),
            ("POST", s.path("/rollouts/claim"), {**trn, "X-Trainer-Epoch": "007"}, claim_body),
            ("POST", s.path("/rollouts/claim"), {**trn, "X-Trainer-Epoch": "99"}, claim_body),
            ("POST", s.path("/rollouts/claim"), {"Authorization": trn["Authorization"]}, claim_body),
            ("POST", s.path("/rollouts/claim"), trn, {"consumer": "trainer-0", "max_groups": 0}),
            ("POST", "/v1/runs/nope/rollouts/claim", trn, claim_body),
            ("POST", s.path("/rollouts/claim"), gen, claim_body),
            ("POST", s.path("/rollouts/ack"), trn, {"delivery_ids": []}),
            ("POST", s.path("/rollouts/ack"), trn, {"delivery_ids": ["not-an-id"]}),
            (
                "POST",
                s.path("/rollouts/ack"),
                {**trn, "X-Trainer-Epoch": "99"},
                {"delivery_ids": ["b" + "0" * 32 + ":0"]},
            ),
            ("POST", s.path("/rollouts/ack"), {"Authorization": trn["Authorization"]}, {"delivery_ids": []}),
            ("POST", s.path("/rollouts/ack"), {**trn, "X-Trainer-Epoch": "1x"}, {"delivery_ids": []}),
            ("POST", "/v1/runs/bad$run/rollouts/ack", trn, {"delivery_ids": []}),
        ]

    def send(http: httpx.Client, method: str, path: str, headers: dict[str, str], body: Any) -> httpx.Response:
        content = body if isinstance(body, (bytes, str)) else None if body is None else json.dumps(body).encode()
        if body is not None and not isinstance(body, (bytes, str)):
            headers = {"Content-Type": "application/json", **headers}
        return http.request(method, path, content=content, headers=headers)

    with httpx.Client(base_url=proxy_file.url, timeout=30) as http:
        lean_answers = [_shape(send(http, *req)) for req in requests()]
        with fastapi_handlers(proxy_file):
            slow_answers = [_shape(send(http, *req)) for req in requests()]
    statuses = [a[0] for a in lean_answers]
    assert {200, 202, 204, 401, 403, 404, 409, 415, 422} <= set(statuses), statuses
    for req, a, b in zip(requests(), lean_answers, slow_answers, strict=True):
        assert a == b, (req[:2], a, b)


def test_hot_path_serves_the_hot_routes_past_the_router_with_their_route_labels(proxy_file: ProxyHarness) -> None:
    # The router's copies of the hot routes are made to fail: every hot request must still be answered (HotPath
    # took it before the router), while a route HotPath does not hold still goes through the router.
    s = Setup(proxy_file, queue_capacity_groups=64, groups_per_step=16)
    routes = [
        r
        for r in proxy_file.app.routes
        if isinstance(r, APIRoute) and any((m, r.path) in lean.ROUTES for m in r.methods)
    ]
    saved = [r.app for r in routes]

    async def unreachable(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError(f"the router was reached for {scope['method']} {scope['path']}")

    for r in routes:
        r.app = unreachable
    try:
        batch = s.batch(2)
        assert s.g.submit_rollouts(batch, uuid.uuid4().hex, use_msgpack=True).accepted_groups == 2
        claimed = s.t.claim("trainer-0", max_groups=2)
        assert len(claimed.deliveries) == 2
        s.t.ack([d.delivery_id for d in claimed.deliveries])
        assert s.g.lease_version("gen-0").version == 1
        assert s.t.status().queue.acked_total == 2  # the status route is not a hot one: the router serves it
    finally:
        for r, app in zip(routes, saved, strict=True):
            r.app = app
    with proxy_file.http("viewer") as http:
        metrics = http.get("/metrics").text
    # The latency middleware outside HotPath labels each request by its route template (scope["route"] in place).
    for method, path in [("POST", "/v1/runs/{run}/rollouts"), ("POST", "/v1/runs/{run}/rollouts/claim")]:
        assert f'method="{method}",route="{path}",status="2' in metrics, (method, path)
    assert 'route="unmatched"' not in metrics


def test_prompt_leases_take_the_cached_spec_and_see_every_change_of_it(
    proxy_file: ProxyHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A prompt lease reads its run's spec only when this process has none cached for the run or the lease's
    # script found the stored spec changed; the numbers it leases by are always the stored spec's.
    reads: list[str] = []
    real_get_run = lean.deps.get_run

    async def counting_get_run(request: Any, run: str) -> Any:
        reads.append(run)
        return await real_get_run(request, run)

    monkeypatch.setattr(lean.deps, "get_run", counting_get_run)
    run = f"spec-{uuid.uuid4().hex[:8]}"
    admin = proxy_file.client(run)
    gen = proxy_file.client(run, "generator")
    admin.put_run(make_spec(groups_per_step=2, max_staleness=1))  # admission: 2 prompts in flight at most
    assert len(gen.lease_prompts("gen-0", 1).prompts) == 1
    assert len(gen.lease_prompts("gen-0", 8).prompts) == 1  # the cached spec's limit: 2 in all
    assert reads == [run]  # read once: the second lease took it from the cache
    with pytest.raises(errors.Backpressure):
        gen.lease_prompts("gen-0", 1)
    admin.put_run(make_spec(groups_per_step=6, max_staleness=1))  # another spec: 6 in flight
    assert len(gen.lease_prompts("gen-0", 8).prompts) == 4  # by the new spec, read again when the script said so
    assert reads == [run, run]
    # The run gone from Redis behind the cache: the route's own answer (404 unknown_run), not a stale lease.
    proxy_file.call(lambda ctx: ctx.redis.delete(f"brl:{run}:spec"))
    with pytest.raises(errors.NotFound) as gone:
        gen.lease_prompts("gen-0", 1)
    assert gone.value.code == "unknown_run"


@pytest.mark.parametrize(
    "args",
    [
        ("EVALSHA", "a" * 40, 3, "brl:r:k1", "brl:r:k2", "brl:r:k3", 5, -3, 2**40, 1.5, 0.1, 1e16, b"\x00\xff", "ünï"),
        ("CONFIG GET", "maxmemory"),
        ("SET", "k", memoryview(b"ab")),
        ("SET", "k", 2**70),
        ("SET", "k", ""),
    ],
)
def test_hiredis_packing_is_byte_identical_to_redis_py(args: tuple[Any, ...]) -> None:
    assert b"".join(fast_packing(Connection)().pack_command(*args)) == b"".join(Connection().pack_command(*args))


def test_hiredis_packing_refuses_what_redis_py_refuses() -> None:
    from redis.exceptions import DataError

    for bad in (True, None, [1]):
        with pytest.raises(DataError):
            fast_packing(Connection)().pack_command("SET", "k", bad)
