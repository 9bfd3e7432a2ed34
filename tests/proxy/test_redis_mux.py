"""The shared pipelined Redis connection of the proxy's Lua calls (``bucketrl/proxy/redis_mux.py``), on a real Redis.

- many concurrent calls from one event-loop pass leave in one write and each gets its own reply, in order,
  exactly what the pool answers; an error reply fails only its own call; a caller cancelled mid-call does not
  shift the replies of the others, and one cancelled while the shared connection opens does not fail them;
- a Redis that forgot its scripts (SCRIPT FLUSH) is answered through EVAL;
- Redis going away fails the waiting calls and :class:`Lua` sends them through the pool instead (which fails
  while Redis is down, as before); once Redis is back, calls go through the shared connection again.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis import exceptions as redis_exc

from bucketrl.proxy import redis_mux
from bucketrl.proxy.redis_mux import RedisMux
from bucketrl.proxy.state.lua import Lua
from tests.support.services import RedisServer

ECHO = Lua("return {KEYS[1], ARGV[1], redis.call('INCR', KEYS[1])}")
FAIL = Lua("return redis.error_reply('BAD ' .. ARGV[1])")
SLOW = Lua(
    "local t = redis.call('TIME'); local s = t[1] * 1e6 + t[2]; "
    "repeat t = redis.call('TIME') until t[1] * 1e6 + t[2] - s > 20000; return ARGV[1]"
)


def _client(server: RedisServer) -> Any:
    pool = aioredis.BlockingConnectionPool.from_url(server.url, max_connections=50, timeout=5, socket_timeout=5)
    r = aioredis.Redis.from_pool(pool)
    r.bucketrl_mux = RedisMux(pool)
    return r


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_concurrent_calls_share_writes_and_get_their_own_replies(redis_server: RedisServer) -> None:
    async def body() -> None:
        r = _client(redis_server)
        mux: RedisMux = r.bucketrl_mux
        writes = 0
        flush = mux._flush

        def counting_flush() -> None:
            nonlocal writes
            writes += 1
            flush()

        await ECHO(r, ["warm"], [0])  # the connection open and the scripts loaded (NOSCRIPT answers come first)
        with pytest.raises(redis_exc.ResponseError):
            await FAIL(r, [], ["warm"])
        mux._flush = counting_flush  # type: ignore[method-assign]
        calls = [ECHO(r, [f"k{i % 7}"], [i]) for i in range(200)]
        calls += [FAIL(r, [], ["x"])]
        got = await asyncio.gather(*calls, return_exceptions=True)
        assert writes == 1, writes  # 201 calls from one pass of the loop: one write
        for i, reply in enumerate(got[:200]):
            assert reply[:2] == [f"k{i % 7}".encode(), str(i).encode()]
        counts = sorted(int(g[2]) for g in got[:200])
        assert counts == sorted(n for k in range(7) for n in range(1, 1 + len(range(k, 200, 7))))
        assert isinstance(got[200], redis_exc.ResponseError) and "BAD x" in str(got[200])
        # the pool answers the same
        plain = aioredis.Redis.from_url(redis_server.url)
        assert await ECHO(plain, ["k0"], ["p"]) == [b"k0", b"p", int(await plain.get("k0"))]
        await plain.aclose()
        await mux.aclose()
        await r.aclose()

    _run(body())


def test_a_caller_cancelled_while_the_connection_opens_does_not_fail_the_others(redis_server: RedisServer) -> None:
    async def body() -> None:
        r = _client(redis_server)
        mux: RedisMux = r.bucketrl_mux
        first = asyncio.create_task(mux.execute("PING"))
        others = [asyncio.create_task(mux.execute("ECHO", str(i))) for i in range(3)]
        await asyncio.sleep(0)  # every caller is now waiting on the one connect
        assert mux._opening is not None and not mux._opening.done()
        first.cancel()
        assert await asyncio.gather(*others) == [str(i).encode() for i in range(3)]
        assert first.cancelled()
        await mux.aclose()
        await r.aclose()

    _run(body())


def test_a_cancelled_caller_does_not_shift_the_others_replies(redis_server: RedisServer) -> None:
    async def body() -> None:
        r = _client(redis_server)
        slow = asyncio.create_task(SLOW(r, [], ["slow"]))
        after = [asyncio.create_task(ECHO(r, ["c"], [i])) for i in range(5)]
        await asyncio.sleep(0.005)
        slow.cancel()
        got = await asyncio.gather(*after)
        assert [g[1] for g in got] == [str(i).encode() for i in range(5)]
        assert await ECHO(r, ["c"], ["last"]) == [b"c", b"last", 6]
        await r.bucketrl_mux.aclose()
        await r.aclose()

    _run(body())


def test_scripts_flushed_from_redis_run_through_eval(redis_server: RedisServer) -> None:
    async def body() -> None:
        r = _client(redis_server)
        assert (await ECHO(r, ["f"], ["a"]))[2] == 1
        await r.script_flush()
        assert (await ECHO(r, ["f"], ["b"]))[2] == 2
        await r.bucketrl_mux.aclose()
        await r.aclose()

    _run(body())


def test_redis_gone_then_back(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_mux, "REOPEN_AFTER_S", 0.2)

    async def body() -> None:
        r = _client(redis_server)
        mux: RedisMux = r.bucketrl_mux
        assert (await ECHO(r, ["g"], ["1"]))[2] == 1
        redis_server.kill()
        with pytest.raises(redis_exc.ConnectionError):
            await ECHO(r, ["g"], ["2"])  # the shared connection fails, then the pool does: the caller sees it
        assert not mux.available
        redis_server.start()
        deadline = time.monotonic() + 10
        while True:  # the pool reconnects at once; the shared connection after its rest
            try:
                reply = await ECHO(r, ["g"], ["3"])
                break
            except redis_exc.ConnectionError:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
        assert reply[1] == b"3"
        await asyncio.sleep(0.25)
        assert mux.available
        assert (await ECHO(r, ["g"], ["4"]))[1] == b"4"
        assert mux._conn is not None and mux._conn.is_connected  # the shared connection carries calls again
        await mux.aclose()
        await r.aclose()

    _run(body())
