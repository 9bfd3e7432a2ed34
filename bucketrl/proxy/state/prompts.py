"""Prompt leases: a persisted cursor over the dataset, reissue-first redelivery, admission control.

This module holds the prompt state's keys and ids, renewals and releases; a lease with its admission control
is ``prompt_lease.py``, the snapshot in the bucket (and its restore after a wipe) ``snapshot.py``.

What a generator sees
---------------------
``POST /v1/runs/{run}/prompts/lease {"worker_id", "n", "ttl_s"}`` hands out up to ``n`` prompts as
``prompt_id = "{pass}-{index}"`` (``index`` in ``0..dataset.size-1``; ``pass`` counts trips over the
dataset). A prompt is *completed* when a rollout group for it is accepted (202, see ``state/queue.py``).
A lease that expires or is released before completion puts the prompt back on the *reissue list*, and
reissues are handed out before any never-issued position (docs/design.md invariant 5: no prompt is skipped, and a
completed one is never issued again within its pass).

Redis state (all changes in single Lua scripts, so concurrent proxies cannot interleave)
---------------------------------------------------------------------------------------
``brl:{run}:prompts:cursor``    next never-issued global position g (pass = g // size, index = g % size)
``brl:{run}:prompts:inflight``  zset prompt_id -> lease expiry (unix s)
``brl:{run}:prompts:owner``     hash prompt_id -> worker_id holding the lease
``brl:{run}:prompts:reissue``   list of prompt ids to issue again (expired / released), issued first
``brl:{run}:prompts:open``      set of issued, not yet completed prompt ids (inflight ∪ reissue ∪ expired)
``brl:{run}:prompts:meta``      hash seq (bumped on every change), persisted_seq, persisted_reserved, ready

Runbook: ``redis-cli ZRANGE brl:{run}:prompts:inflight 0 -1 WITHSCORES`` lists leases;
``LRANGE brl:{run}:prompts:reissue 0 -1`` what will be reissued next; ``GET brl:{run}:prompts:cursor``.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from bucketrl import errors
from bucketrl.proxy import keys
from bucketrl.proxy.state.clock import redis_now
from bucketrl.proxy.state.lua import Lua
from bucketrl.wire import PromptLease, PromptLeaseItem, RunSpec

# The Redis consumer group of the rollout stream (shared with state/queue.py, which builds on this module).
STREAM_GROUP = "trainer"
PROMPT_ID_RE = re.compile(r"^(0|[1-9][0-9]{0,11})-(0|[1-9][0-9]{0,11})$")


@dataclass(frozen=True)
class PromptKeys:
    cursor: str
    inflight: str
    owner: str
    reissue: str
    open: str
    meta: str
    lock: str
    stream: str
    counters: str
    queue_meta: str
    state: str
    pace: str
    channel: str
    usage: str  # the run's cost usage (state/cost.py): in the snapshot with the counters

    @classmethod
    @functools.lru_cache(maxsize=4096)  # frozen, and built on every request: once per run is enough
    def of(cls, run: str) -> PromptKeys:
        k = keys.run_key
        return cls(
            cursor=k(run, keys.PROMPT_CURSOR),
            inflight=k(run, keys.PROMPT_INFLIGHT),
            owner=k(run, "prompts:owner"),
            reissue=k(run, keys.PROMPT_REISSUE),
            open=k(run, "prompts:open"),
            meta=k(run, "prompts:meta"),
            lock=k(run, "prompts:persist-lock"),
            stream=k(run, keys.QUEUE_STREAM),
            counters=k(run, keys.COUNTERS),
            queue_meta=k(run, "queue:meta"),
            state=k(run, keys.STATE),
            pace=k(run, "queue:pace"),
            channel=k(run, keys.PIPELINE_CHANNEL),
            usage=k(run, keys.COST_USAGE),
        )


def admission_limit(spec: RunSpec) -> int:
    """Most queued groups + in-flight prompts the pipeline may hold (see the module docstring)."""
    return max(1, min(spec.queue_capacity_groups, spec.groups_per_step * max(1, spec.max_staleness)))


def parse_prompt_id(prompt_id: str) -> tuple[int, int] | None:
    """``"3-17"`` -> ``(3, 17)`` (pass, index); None when malformed."""
    m = PROMPT_ID_RE.match(prompt_id)
    return (int(m.group(1)), int(m.group(2))) if m else None


def prompt_item(prompt_id: str) -> PromptLeaseItem:
    parsed = parse_prompt_id(prompt_id)
    assert parsed is not None, prompt_id
    return PromptLeaseItem(prompt_id=prompt_id, index=parsed[1], pass_=parsed[0])


def as_str(v: bytes | str) -> str:
    """A Redis reply item as text."""
    return v.decode() if isinstance(v, bytes) else v


_RENEW = Lua.load("prompt_renew.lua")

_RELEASE = Lua.load("prompt_release.lua")


async def renew(r: Any, run: str, worker_id: str, prompt_ids: list[str], ttl_s: float) -> PromptLease:
    """Extend the leases this worker still holds; the answer lists those renewed. 410 if none was."""
    k = PromptKeys.of(run)
    res = await _RENEW(r, [k.inflight, k.owner], [repr(float(ttl_s)), worker_id, *prompt_ids])
    expires_at, renewed = float(res[0]), [as_str(p) for p in res[1:]]
    if prompt_ids and not renewed:
        raise errors.Gone(
            f"run {run!r}: worker {worker_id!r} holds none of these prompt leases any more "
            "(expired and reissued, completed, or never leased by it)"
        )
    return PromptLease(prompts=[prompt_item(p) for p in renewed], expires_at=expires_at)


async def release(r: Any, run: str, worker_id: str, prompt_ids: list[str]) -> int:
    """Give prompts back (issued again first); returns how many this worker held."""
    k = PromptKeys.of(run)
    return int(await _RELEASE(r, [k.inflight, k.owner, k.reissue, k.open, k.meta, k.channel], [worker_id, *prompt_ids]))


async def cursor(r: Any, run: str) -> int:
    raw = await r.get(PromptKeys.of(run).cursor)
    return int(raw) if raw else 0


async def prompts_inflight(r: Any, run: str, now: float | None = None) -> int:
    """Prompts under a live lease (for ``RunStatus.prompts_inflight``)."""
    now = await redis_now(r) if now is None else now
    return int(await r.zcount(PromptKeys.of(run).inflight, f"({now!r}", "+inf"))


def validate_prompt_ids(prompt_ids: list[str], field: str = "prompt_ids") -> None:
    for i, pid in enumerate(prompt_ids):
        if parse_prompt_id(pid) is None:
            raise errors.Invalid(f"{field}[{i}]: {pid[:60]!r} is not a prompt id of the form '<pass>-<index>'")


def redropped_key(run: str) -> str:
    """Redis hash: re-queued (rebuilt) deliveries dropped as stale, which a trainer that trained them may still
    ack (the ack then counts them acked instead of dropped; ``state/queue.py``)."""
    return keys.run_key(run, "queue:redropped")
