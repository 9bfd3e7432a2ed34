"""Many requests in flight at once hold many Redis connections: the proxy's pool must let them wait, not 503.

Found by ``bench/scale_sim.py``: at 128+ simulated generators every route answered some 503s ("redis
unreachable: MaxConnectionsError") because redis-py's default pool refuses a 101st connection per process.
Here 150 long-polled claims block in Redis at once (each holds a connection while it waits).
"""

from __future__ import annotations

import asyncio

import httpx

from tests.proxy.harness import TOKENS, ProxyHarness, adapter_tar, make_spec

CLAIMS = 150


def test_150_blocking_claims_at_once_all_answer(proxy_file: ProxyHarness) -> None:
    t = proxy_file.client("r1", "trainer")
    t.put_run(make_spec())
    epoch = t.register_trainer("t0").epoch
    t.publish_adapter(1, adapter_tar(1))
    headers = {"Authorization": f"Bearer {TOKENS['trainer']}", "X-Trainer-Epoch": str(epoch)}
    body = {"consumer": "t0", "max_groups": 1, "wait_s": 2.0}

    async def claims() -> list[int]:
        limits = httpx.Limits(max_connections=CLAIMS, max_keepalive_connections=CLAIMS)
        async with httpx.AsyncClient(base_url=proxy_file.url, limits=limits, timeout=60) as http:
            answers = await asyncio.gather(
                *(http.post("/v1/runs/r1/rollouts/claim", json=body, headers=headers) for _ in range(CLAIMS))
            )
        return [a.status_code for a in answers]

    statuses = asyncio.run(claims())
    assert statuses == [200] * CLAIMS, {s: statuses.count(s) for s in set(statuses)}
    assert proxy_file.ctx.redis.connection_pool.max_connections == proxy_file.settings.redis_max_connections
