"""Version announcements: one Redis pub/sub subscription per app, fanned out to waiting long-polls.

A publish commits the new version and ``PUBLISH``es its number on ``brl:{run}:versions:channel`` in the
same Lua script. Each proxy app keeps ONE pattern subscription (``brl:*:versions:channel``) and wakes the
in-process waiters of that run, so a thousand waiting generators cost one Redis connection, not a
thousand.

No lost wake-up: a waiter registers its event FIRST and only then reads ``latest_version`` from Redis. A
publish that committed before the read is seen by the read; one that commits after it is delivered by
pub/sub to the already-registered event. Pub/sub drops messages while the subscription is down, so after
every (re)subscribe all waiters are woken to re-read Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from redis import exceptions as redis_exc

from bucketrl.proxy import keys

log = logging.getLogger("bucketrl.proxy.notify")

PATTERN = keys.run_key("*", keys.VERSION_CHANNEL)
_PREFIX, _SUFFIX = "brl:", ":" + keys.VERSION_CHANNEL


class VersionNotifier:
    """Pass a Redis client WITHOUT command retries: a silent reconnect would hide a gap in the messages."""

    def __init__(self, redis: Any) -> None:
        self._redis = redis
        self._waiters: dict[str, set[asyncio.Event]] = defaultdict(set)
        self._task: asyncio.Task[None] | None = None
        self.subscribed = asyncio.Event()
        self.generation = 0  # how many times the subscription was (re)established
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._listen(), name="bucketrl-version-notifier")

    @classmethod
    def from_url(cls, url: str, timeout_s: float) -> VersionNotifier:
        import redis.asyncio as aioredis

        return cls(aioredis.Redis.from_url(url, socket_connect_timeout=timeout_s, health_check_interval=5))

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        with contextlib.suppress(Exception):
            await self._redis.aclose()

    @contextlib.contextmanager
    def waiter(self, run: str) -> Iterator[asyncio.Event]:
        """An event set when ``run`` may have a new version; register BEFORE reading Redis."""
        event = asyncio.Event()
        self._waiters[run].add(event)
        try:
            yield event
        finally:
            waiters = self._waiters.get(run)
            if waiters is not None:
                waiters.discard(event)
                if not waiters:
                    self._waiters.pop(run, None)

    def wake(self, run: str | None = None) -> None:
        """Wake the waiters of ``run`` (all runs when None) so they re-read Redis."""
        groups = [self._waiters.get(run, set())] if run is not None else list(self._waiters.values())
        for group in groups:
            for event in list(group):
                event.set()

    async def _listen(self) -> None:
        backoff = 0.05
        while not self._stopping:  # a flag too: a cancel can surface as a Redis TimeoutError (see gc.py)
            pubsub = self._redis.pubsub()
            try:
                await pubsub.psubscribe(PATTERN)
                self.subscribed.set()
                self.generation += 1
                backoff = 0.05
                # Announcements may have been missed while (re)connecting: let every waiter re-check.
                self.wake()
                while not self._stopping:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is None or msg.get("type") != "pmessage":
                        continue
                    channel = msg["channel"].decode() if isinstance(msg["channel"], bytes) else msg["channel"]
                    if channel.startswith(_PREFIX) and channel.endswith(_SUFFIX):
                        self.wake(channel[len(_PREFIX) : -len(_SUFFIX)])
            except asyncio.CancelledError:
                raise
            except (redis_exc.RedisError, OSError) as exc:
                self.subscribed.clear()
                log.warning("version subscription lost (%r); resubscribing in %.2fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
