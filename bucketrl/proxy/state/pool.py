"""The generator pool's Redis state: per-run pause, the fair-share pick, and each run's place in the pool.

Fair share (docs/pool.md): a pool lease tries the runs a generator may serve in the order of
``(tokens generated + credit + tokens of its prompts in flight) / share``, lowest first, and takes the first
run whose own admission control grants. Tokens are counted by the submit script with ``accepted_total``
(``tokens_generated_total``: exactly once per accepted group, restored with the other counters after a
Redis wipe), so over time each run with work gets tokens in proportion to its share. The in-flight term
makes concurrent leases see each other: the prompts a lease took raise its run's score in the same Redis
state the next pick reads (one script, so every proxy replica and generator agrees on the order).

Held runs are skipped, never failed: ``paused`` (POST /v1/runs/{run}/generation/pause) and ``budget`` (its
``budget_tokens`` generated). A per-run prompt lease of a held run answers 429 too (``prompt_lease.lua``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bucketrl.proxy import keys
from bucketrl.proxy.state import accounting, leases, workers
from bucketrl.proxy.state.lua import Lua
from bucketrl.proxy.state.prompts import PromptKeys
from bucketrl.wire import QueueStatus, RunSpec, WorkerStatus
from bucketrl.wire.pool import RunPoolStatus, lora_slots_needed

_PICK = Lua.load("pool_pick.lua")
_HOLD_CHANGE = Lua.load("pool_hold_change.lua")

RECENT_SLOT_S = 10  # submit_enqueue.lua's slot of the recent tokens
RECENT_WINDOW_S = 60.0  # what pool status calls recent: the last 6 slots, the current one included


def recent_tokens(slots: dict[Any, Any], now: float, window_s: float = RECENT_WINDOW_S) -> int:
    """The tokens of ``slots`` (slot index -> tokens, as submit_enqueue.lua counts them) within ``window_s`` of
    ``now``: the current slot (partly elapsed) and the whole ones before it."""
    first = int(now // RECENT_SLOT_S) - int(window_s // RECENT_SLOT_S) + 1
    return sum(int(v) for k, v in slots.items() if int(k) >= first)


# A run that got no pool lease for this long is "inactive": when it has work again it starts at the
# least-served active run's score rather than its own, lower one (pool_pick.lua).
ACTIVE_WINDOW_S = 10.0


def pool_key(run: str) -> str:
    return keys.run_key(run, keys.POOL)


def tokens_per_group_guess(spec: RunSpec) -> int:
    """What a group in flight is assumed to cost before the run has any accepted group: half the most it may."""
    per = spec.episode.max_episode_tokens if spec.env is not None else spec.sampling.max_new_tokens
    return max(1, spec.group_size * per // 2)


@dataclass(frozen=True)
class Pick:
    now: float
    order: list[str]  # runs to try, fair-share order
    holds: dict[str, str]  # run -> ok | paused | budget
    scores: dict[str, float]


async def pick(r: Any, candidates: list[tuple[str, RunSpec]], window_s: float = ACTIVE_WINDOW_S) -> Pick:
    """The fair-share order of ``candidates`` (one script: a consistent reading of every run's counters)."""
    ks: list[str] = []
    args: list[Any] = [window_s]
    for run, spec in candidates:
        ks += [PromptKeys.of(run).counters, pool_key(run), PromptKeys.of(run).inflight]
        budget = "" if spec.budget_tokens is None else spec.budget_tokens
        args += [repr(float(spec.share)), budget, tokens_per_group_guess(spec)]
    now, order, holds, scores = await _PICK(r, ks, args)
    names = [run for run, _ in candidates]
    return Pick(
        now=float(now),
        order=[names[int(i) - 1] for i in order],
        holds={names[i]: _str(h) for i, h in enumerate(holds)},
        scores={names[i]: float(s) for i, s in enumerate(scores)},
    )


async def record_pass(r: Any, granted: str | None, now: float, passed_over: list[str]) -> None:
    """One pool lease's outcome, in one round trip: the run granted is active as of ``now``; a run that could not
    take a lease (its own admission control, or held) is out of the competition from now. When it has room again,
    the pick credits it up to the least-served active run, so a run whose trainer stalled does not take the whole
    pool on its return to catch up (bench/pool_isolation.py measured the other run at 44 % of its rate for seconds
    after such a return, within the 10 s window)."""
    if granted is None and not passed_over:
        return
    pipe = r.pipeline(transaction=False)
    for run in passed_over:
        pipe.hdel(pool_key(run), "last_granted")
    if granted is not None:
        pipe.hset(pool_key(granted), "last_granted", repr(now))
    await pipe.execute()


HOLDS = {"ok": "0", "paused": "1", "finished": "2"}  # the pool hash's ``paused`` field (and the Lua scripts')


async def set_hold(r: Any, run: str, hold: str) -> None:
    """``ok`` (resume), ``paused`` or ``finished``."""
    # Resume drops last_granted: the run starts again at the pool's current score, not its old lower one.
    pipe = r.pipeline(transaction=True)
    pipe.hset(pool_key(run), "paused", HOLDS[hold])
    if hold == "ok":
        pipe.hdel(pool_key(run), "last_granted")
    await pipe.execute()


async def unfinish(r: Any, run: str) -> bool:
    """A finished run's hold lifted (a trainer registered again, to train past its max_steps); a pause stays."""
    return bool(await _HOLD_CHANGE(r, [pool_key(run)], [HOLDS["ok"], "if", HOLDS["finished"]]))


async def finish(r: Any, run: str) -> bool:
    """Hold ``finished`` (the run's trainer reached max_steps) unless the run is paused: True when it changed."""
    return bool(await _HOLD_CHANGE(r, [pool_key(run)], [HOLDS["finished"], "unless", HOLDS["paused"]]))


async def run_status(r: Any, run: str, spec: RunSpec) -> RunPoolStatus:
    k = PromptKeys.of(run)
    pipe = r.pipeline(transaction=False)
    pipe.hmget(k.counters, "tokens_generated_total", "accepted_total")
    pipe.hget(pool_key(run), "paused")
    pipe.zcard(k.inflight)
    pipe.hgetall(keys.run_key(run, keys.TOKENS_RECENT))
    pipe.time()
    (tokens, groups), paused_raw, inflight, slots, (sec, usec) = await pipe.execute()
    tokens_i, held = int(tokens or 0), _str(paused_raw)
    paused = held == "1"
    over = spec.budget_tokens is not None and tokens_i >= spec.budget_tokens
    return RunPoolStatus(
        run=run,
        share=spec.share,
        tokens_generated=tokens_i,
        groups_accepted=int(groups or 0),
        paused=paused,
        budget_tokens=spec.budget_tokens,
        hold="paused" if paused else "finished" if held == "2" else "budget" if over else "ok",
        prompts_inflight=int(inflight),
        tokens_recent=recent_tokens(slots, int(sec) + int(usec) / 1e6),
        budget_used=None if spec.budget_tokens is None else tokens_i / max(1, spec.budget_tokens),
    )


def with_occupancy(
    s: RunPoolStatus, spec: RunSpec, live: dict[int, int], seen: list[WorkerStatus], queue: QueueStatus
) -> RunPoolStatus:
    """``s`` with the run's queue, its leased versions and the LoRA slots its generators hold for it."""
    gens = [w for w in seen if w.role == "generator"]
    return s.model_copy(
        update={
            "queue_groups": queue.groups,
            "queue_capacity": queue.capacity,
            "live_versions": sorted(v for v, n in live.items() if n > 0),
            "generators": len(gens),
            "adapters_loaded": sum(len(w.loaded_versions) for w in gens),
            "slots_per_generator": lora_slots_needed(spec.max_staleness),
        }
    )


async def full_status(r: Any, run: str, spec: RunSpec, worker_ttl_s: float) -> RunPoolStatus:
    """:func:`run_status` with its occupancy (``GET /v1/pool``; the run status fills it from what it read)."""
    s = await run_status(r, run, spec)
    live = await leases.live_counts(r, run)
    seen, _ = await workers.live_workers(r, run, worker_ttl_s)
    return with_occupancy(s, spec, live, seen, await accounting.queue_status(r, run, spec))


def _str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v or "")
