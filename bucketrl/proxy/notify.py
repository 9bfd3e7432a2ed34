"""Run announcements: one Redis pub/sub connection per app, fanned out to waiting long-polls.

Two topics per run, each a channel ``brl:{run}:{topic}:channel`` that a Lua script ``PUBLISH``es on in the
same atomic step as the change it announces:

- ``versions``: a publish committed a new adapter version (``GET /adapters/latest?after=N`` waits on it);
- ``pipeline``: a claim took groups off the queue (or changed the trainer's pace), or prompts were released:
  admission control may now grant a prompt lease that was refused (``POST /prompts/lease`` with ``wait_s``);
- ``jobs`` / ``jobdone``: a completion job was queued / answered (``state/completion_jobs.py``);
- ``drains``: a worker was told to drain (``state/drains.py``). The message is the worker's id, and only that
  worker's ``GET .../drain?wait_s`` long-polls wake (topic ``drains:{worker}``), not every drain poll of the run.

Each proxy app keeps ONE pattern subscription per topic and wakes the in-process waiters of that run and
topic, so a thousand waiting generators cost one Redis connection, not a thousand.

No lost wake-up: a waiter registers its event FIRST and only then reads ``latest_version`` from Redis. A
publish that committed before the read is seen by the read; one that commits after it is delivered by
pub/sub to the already-registered event. Pub/sub drops messages while the subscription is down, so after
every (re)subscribe all waiters are woken to re-read Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

from redis import exceptions as redis_exc

from bucketrl.proxy import keys

log = logging.getLogger("bucketrl.proxy.notify")

TOPICS = {
    keys.VERSION_CHANNEL: "versions",
    keys.PIPELINE_CHANNEL: "pipeline",
    keys.CJOBS_CHANNEL: "jobs",
    keys.CJOBS_DONE_CHANNEL: "jobdone",
    keys.DRAIN_CHANNEL: "drains",
}
PATTERNS = [keys.run_key("*", channel) for channel in TOPICS]
_PREFIX = "brl:"
T = TypeVar("T")


def drain_topic(worker_id: str) -> str:
    """The topic one worker's drain long-polls wait on."""
    return f"drains:{worker_id}"


def _topic(topic: str, data: Any) -> str:
    if topic == "drains" and data:  # keyed by the worker the drain names
        return drain_topic(data.decode() if isinstance(data, bytes) else str(data))
    return topic


class Notifier:
    """Pass a Redis client WITHOUT command retries: a silent reconnect would hide a gap in the messages."""

    def __init__(self, redis: Any) -> None:
        self._redis = redis
        self._waiters: dict[tuple[str, str], set[asyncio.Event]] = defaultdict(set)
        self._task: asyncio.Task[None] | None = None
        self.subscribed = asyncio.Event()
        self.generation = 0  # how many times the subscription was (re)established
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._listen(), name="bucketrl-version-notifier")

    @classmethod
    def from_url(cls, url: str, timeout_s: float) -> Notifier:
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
    def waiter(self, run: str, *topics: str) -> Iterator[asyncio.Event]:
        """An event set when ``run`` announces on any of ``topics`` (default: ``versions``); register it BEFORE
        reading Redis."""
        event = asyncio.Event()
        slots = [(run, t) for t in topics or ("versions",)]
        for slot in slots:
            self._waiters[slot].add(event)
        try:
            yield event
        finally:
            for slot in slots:
                waiters = self._waiters.get(slot)
                if waiters is not None:
                    waiters.discard(event)
                    if not waiters:
                        self._waiters.pop(slot, None)

    def wake(self, run: str | None = None, topic: str | None = None) -> None:
        """Wake the waiters of ``run`` on ``topic`` (None = every run / every topic) so they re-read Redis."""
        if run is not None and topic is not None:  # every announcement: a keyed lookup, not a scan
            groups = [self._waiters.get((run, topic), set())]
        else:  # (re)subscribed: every waiter of a run, or of every run, re-checks
            groups = [w for (r, t), w in self._waiters.items() if run in (None, r) and topic in (None, t)]
        for group in groups:
            for event in list(group):
                event.set()

    async def _listen(self) -> None:
        backoff = 0.05
        while not self._stopping:  # a flag too: a cancel can surface as a Redis TimeoutError (see gc.py)
            pubsub = self._redis.pubsub()
            try:
                await pubsub.psubscribe(*PATTERNS)
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
                    run, _, name = channel.removeprefix(_PREFIX).partition(":")  # run ids hold no ':'
                    if name in TOPICS:
                        self.wake(run, _topic(TOPICS[name], msg.get("data")))
            except asyncio.CancelledError:
                raise
            except (redis_exc.RedisError, OSError) as exc:
                self.subscribed.clear()
                log.warning("announcement subscription lost (%r); resubscribing in %.2fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()


async def poll_until(
    notifier: Notifier | None,
    run: str,
    topics: tuple[str, ...],
    wait_s: float,
    read: Callable[[], Awaitable[T]],
    ready: Callable[[T], bool],
    recheck_s: float | None = None,
) -> T:
    """A long-poll's loop: ``read()`` until ``ready`` or ``wait_s`` passed, woken by ``run``'s announcements on
    ``topics``. The waiter is registered BEFORE each read (no lost wake-up, see the module docstring);
    ``recheck_s`` reads again that often with no announcement (what expires silently, a lease). Without a
    notifier (tests of the state alone), a 0.2 s sleep instead."""
    deadline = time.monotonic() + wait_s
    while True:
        with notifier.waiter(run, *topics) if notifier is not None else contextlib.nullcontext() as event:
            got = await read()
            left = deadline - time.monotonic()
            if ready(got) or left <= 0:
                return got
            if event is None:
                await asyncio.sleep(min(0.2, left))
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout=left if recheck_s is None else min(left, recheck_s))
