"""What keeps the hot routes cheap on the one router: a prompt lease takes its run's spec from the app's cache
(``routes/prompts.py``: one Redis round trip) and sees every change of it, and the proxy's Redis commands are
packed by hiredis byte for byte as redis-py packs them (``bucketrl/proxy/redis_pack.py``)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from redis.asyncio.connection import Connection

from bucketrl import errors
from bucketrl.proxy.redis_pack import fast_packing
from bucketrl.proxy.routes import prompts as prompt_routes
from tests.proxy.harness import ProxyHarness, make_spec


def test_prompt_leases_take_the_cached_spec_and_see_every_change_of_it(
    proxy_file: ProxyHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A prompt lease reads its run's spec only when this app has none cached for the run or the lease's
    # script found the stored spec changed; the numbers it leases by are always the stored spec's.
    reads: list[str] = []
    real_resolve_run = prompt_routes.resolve_run

    async def counting_resolve_run(ctx: Any, run: str) -> Any:
        reads.append(run)
        return await real_resolve_run(ctx, run)

    monkeypatch.setattr(prompt_routes, "resolve_run", counting_resolve_run)
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
