"""Issue 10's replay rule for the lease routes: version lease create/renew/release and prompt renew/release.

Each request is sent twice: concurrently (threads posting the same body at once) and after the first completed
(through the real client, whose first answer is lost on the way back, so its transport retry replays it). These
routes touch only Redis, so there is no bucket to slow: the lost answer stands in for the client's timeout.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from bucketrl import errors
from bucketrl.proxy.state import leases
from tests.proxy.harness import ProxyHarness
from tests.proxy.test_rollouts_routes import Setup


class LoseAnswers(httpx.HTTPTransport):
    """A real transport whose first ``n`` answers to requests on ``path_suffix`` are lost after the proxy acted on
    them (the edge a test cannot order up otherwise: a response dropped on the network, a client timeout)."""

    def __init__(self, path_suffix: str, n: int = 1) -> None:
        super().__init__()
        self.path_suffix, self.n, self.sent = path_suffix, n, 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        resp = super().handle_request(request)
        if request.url.path.endswith(self.path_suffix) and self.n > 0:
            resp.read()
            resp.close()
            self.n -= 1
            self.sent += 1
            raise httpx.ReadTimeout("answer lost", request=request)
        return resp


def _losing(proxy: ProxyHarness, path_suffix: str, role: str = "generator") -> tuple[Any, LoseAnswers]:
    lose = LoseAnswers(path_suffix)
    return proxy.client("r1", role, retries=3, backoff_s=0.01, transport=lose), lose


def _at_once(
    proxy: ProxyHarness, send: Callable[[httpx.Client], httpx.Response], n: int = 6, role: str = "generator"
) -> list[httpx.Response]:
    """``n`` identical requests sent at the same time, each on its own connection."""
    clients = [proxy.http(role) for _ in range(n)]
    try:
        with ThreadPoolExecutor(n) as pool:
            return list(pool.map(send, clients))
    finally:
        for c in clients:
            c.close()


def _live(proxy: ProxyHarness) -> dict[int, int]:
    return proxy.call(lambda ctx: leases.live_counts(ctx.redis, "r1"))


def test_version_lease_create_replayed_is_one_lease(proxy_file: ProxyHarness) -> None:
    """A replay (same request id) answers the lease its first attempt created: the old route created a second
    lease per replay, holding the version back from GC until it expired."""
    s = Setup(proxy_file)  # gen-0 holds one lease on v1
    c, lose = _losing(proxy_file, "/leases")
    got = c.lease_version("gen-1")  # the client's own request id rides on its retry
    assert lose.sent == 1 and got.version == 1
    assert _live(proxy_file) == {1: 2}

    body = {"worker_id": "gen-2", "ttl_s": 60, "request_id": "fetch-7"}
    answers = _at_once(proxy_file, lambda h: h.post("/v1/runs/r1/leases", json=body))
    assert {r.status_code for r in answers} == {200}
    assert len({json.dumps(r.json(), sort_keys=True) for r in answers}) == 1  # the same lease, same expiry
    first = answers[0].json()
    assert _live(proxy_file) == {1: 3}
    with proxy_file.http("generator") as h:
        assert h.post("/v1/runs/r1/leases", json=body).json() == first  # after completion
        # Another worker's request id is its own lease.
        other = h.post("/v1/runs/r1/leases", json=body | {"worker_id": "gen-3"}).json()
    assert other["lease_id"] != first["lease_id"]
    assert _live(proxy_file) == {1: 4}
    # A replay arriving after the lease was released answers that ended lease; it protects nothing again.
    s.g.release_lease(first["lease_id"])
    with proxy_file.http("generator") as h:
        late = h.post("/v1/runs/r1/leases", json=body).json()
    assert late["lease_id"] == first["lease_id"] and late["expires_at"] <= first["expires_at"]
    assert _live(proxy_file) == {1: 3}
    with pytest.raises(errors.Gone):
        s.g.renew_lease(first["lease_id"])


def test_version_lease_renew_and_release_replayed(proxy_file: ProxyHarness) -> None:
    """Renew replays extend the one lease; every replay of a release answers 204 like the first (the old route
    answered a replay 410 lease_expired for a lease released on purpose)."""
    s = Setup(proxy_file)
    path = f"/v1/runs/r1/leases/{s.lease_id}"
    renewed = _at_once(proxy_file, lambda h: h.post(f"{path}/renew", json={"ttl_s": 120}))
    assert {r.status_code for r in renewed} == {200}
    assert {(r.json()["lease_id"], r.json()["version"]) for r in renewed} == {(s.lease_id, 1)}
    assert _live(proxy_file) == {1: 1}
    c, lose = _losing(proxy_file, "/renew")
    assert c.renew_lease(s.lease_id, ttl_s=120).lease_id == s.lease_id and lose.sent == 1

    released = _at_once(proxy_file, lambda h: h.delete(path))
    assert [r.status_code for r in released] == [204] * len(released)
    assert _live(proxy_file) == {1: 0}
    c, lose = _losing(proxy_file, s.lease_id)
    c.release_lease(s.lease_id)  # after completion, through the client's retry
    assert lose.sent == 1
    with pytest.raises(errors.Gone):  # a late renew cannot bring a released lease back
        s.g.renew_lease(s.lease_id)
    assert _live(proxy_file) == {1: 0}


def test_prompt_renew_and_release_replayed(proxy_file: ProxyHarness) -> None:
    """Released prompts are issued again exactly once however often the release is replayed, and a replay that
    arrives after they went to another worker neither takes them back nor renews them for the old holder."""
    s = Setup(proxy_file, groups_per_step=8)
    held = [p.prompt_id for p in s.g.lease_prompts("gen-0", 3).prompts]
    body = {"worker_id": "gen-0", "prompt_ids": held, "ttl_s": 120}
    renewed = _at_once(proxy_file, lambda h: h.post("/v1/runs/r1/prompts/renew", json=body))
    assert {r.status_code for r in renewed} == {200}
    assert all([p["prompt_id"] for p in r.json()["prompts"]] == held for r in renewed)
    c, lose = _losing(proxy_file, "/prompts/renew")
    assert [p.prompt_id for p in c.renew_prompts("gen-0", held).prompts] == held and lose.sent == 1

    released = _at_once(proxy_file, lambda h: h.post("/v1/runs/r1/prompts/release", json=body))
    assert [r.status_code for r in released] == [204] * len(released)
    c, lose = _losing(proxy_file, "/prompts/release")
    c.release_prompts("gen-0", held)
    assert lose.sent == 1
    again = [p.prompt_id for p in s.g.lease_prompts("gen-1", 5).prompts]
    assert sorted(again[:3]) == sorted(held) and again[3:] == ["0-3", "0-4"]  # each released prompt once
    assert s.t.status().prompts_inflight == 5
    # Late replays of gen-0's renew and release: gen-1 keeps what it holds.
    with proxy_file.http("generator") as h:
        assert h.post("/v1/runs/r1/prompts/renew", json=body).status_code == 410
        assert h.post("/v1/runs/r1/prompts/release", json=body).status_code == 204
    assert s.t.status().prompts_inflight == 5
    assert [p.prompt_id for p in s.g.renew_prompts("gen-1", again).prompts] == again
    assert [p.prompt_id for p in s.g.lease_prompts("gen-2", 1).prompts] == ["0-5"]
