"""Runs: the spec (JSON), the run state hash and the trainer fencing epoch.

Keys (``bucketrl.proxy.keys``): ``brl:runs`` (set of run ids), ``brl:{run}:spec`` (RunSpec JSON),
``brl:{run}:state`` (hash: latest_version, trainer_epoch, trainer_step, created_at, updated_at, and
``max_new_tokens_bound``: the largest ``sampling.max_new_tokens`` the run's spec has ever had).

The bound is what a submitted batch's completions are checked against (``validation.validate_batch``): a batch
sampled under an older, larger spec stays acceptable after the spec lowers it, and a generator cannot declare
its own, larger one. It only grows; the bucket keeps it as ``runs/{run}/sampling-bounds/{n}`` markers (the
largest wins), so a rebuild after a Redis wipe restores it.

``put_spec`` is a WATCH/MULTI compare-and-set, so two trainers creating the same run concurrently
agree on one spec and the loser of a conflicting immutable field gets 409.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from redis import exceptions as redis_exc

from bucketrl import errors
from bucketrl.proxy import keys
from bucketrl.proxy.state.lua import Lua
from bucketrl.wire import RunSpec, RunState


def _int(v: bytes | None) -> int:
    return int(v) if v else 0


async def list_runs(r: Any) -> list[str]:
    return sorted(m.decode() for m in await r.smembers(keys.RUNS_SET))


@functools.lru_cache(maxsize=256)
def parse_spec(raw: bytes) -> RunSpec:
    # Every request resolves its run's spec; parsing the same bytes once is enough (RunSpec is only read).
    return RunSpec.model_validate_json(raw)


async def get_spec(r: Any, run: str) -> RunSpec | None:
    raw = await r.get(keys.run_key(run, keys.SPEC))
    return None if raw is None else parse_spec(bytes(raw))


async def get_spec_and_epoch(r: Any, run: str) -> tuple[RunSpec | None, int]:
    """The spec (None for an unknown run) and the current trainer epoch, in one round trip (every request
    resolves its run; trainer writes also check their epoch)."""
    raw, epoch = await _SPEC_AND_EPOCH(r, [keys.run_key(run, keys.SPEC), keys.run_key(run, keys.STATE)], [])
    return (None if raw is None else parse_spec(bytes(raw))), _int(epoch)


# One command (cheaper for the proxy than a two-command pipeline). ``or false``: a Lua table cannot hold nil.
_SPEC_AND_EPOCH = Lua.load("run_spec_and_epoch.lua")


async def get_state(r: Any, run: str) -> RunState:
    h = await r.hgetall(keys.run_key(run, keys.STATE))
    now = time.time()
    return RunState(
        latest_version=_int(h.get(b"latest_version")),
        trainer_epoch=_int(h.get(b"trainer_epoch")),
        trainer_step=_int(h.get(b"trainer_step")),
        created_at=float(h.get(b"created_at") or now),
        updated_at=float(h.get(b"updated_at") or now),
    )


async def latest_version(r: Any, run: str) -> int:
    return _int(await r.hget(keys.run_key(run, keys.STATE), "latest_version"))


async def trainer_epoch(r: Any, run: str) -> int:
    return _int(await r.hget(keys.run_key(run, keys.STATE), "trainer_epoch"))


def check_epoch(run: str, given: int, current: int) -> None:
    if given < current:
        raise errors.Fenced(
            f"run {run!r}: trainer epoch {given} is fenced by epoch {current} (a newer trainer registered)"
        )
    if given > current:
        raise errors.Fenced(f"run {run!r}: trainer epoch {given} was never issued (current is {current})")


BOUND_FIELD = "max_new_tokens_bound"


def bound_marker_key(run: str, max_new_tokens: int) -> str:
    return f"runs/{run}/sampling-bounds/{max_new_tokens:012d}"


def bound_of(spec: RunSpec, stored: bytes | str | int | None) -> int:
    """The run's max_new_tokens bound: the stored one, never below the spec's current value (a run created
    before the bound was kept has none stored)."""
    return max(spec.sampling.max_new_tokens, int(stored or 0))


async def put_spec(r: Any, run: str, spec: RunSpec) -> tuple[bool, bool]:
    """Create or confirm ``run``; returns ``(created, changed)``. 409 if an immutable field differs."""
    spec_key, state_key = keys.run_key(run, keys.SPEC), keys.run_key(run, keys.STATE)
    body = spec.model_dump_json()
    async with r.pipeline(transaction=True) as pipe:
        while True:
            try:
                await pipe.watch(spec_key)
                raw = await pipe.get(spec_key)
                now = time.time()
                if raw is None:
                    pipe.multi()
                    pipe.set(spec_key, body)
                    pipe.hsetnx(state_key, "latest_version", 0)
                    pipe.hsetnx(state_key, "trainer_epoch", 0)
                    pipe.hsetnx(state_key, "trainer_step", 0)
                    pipe.hsetnx(state_key, "created_at", now)
                    pipe.hset(state_key, mapping={"updated_at": now, BOUND_FIELD: spec.sampling.max_new_tokens})
                    pipe.sadd(keys.RUNS_SET, run)
                    await pipe.execute()
                    return True, False
                current = RunSpec.model_validate_json(raw)
                diff = current.immutable_diff(spec)
                if diff:
                    raise errors.Conflict(
                        f"run {run!r} exists with different immutable field(s) {', '.join(diff)}; "
                        "create a new run id to change them",
                        code="immutable_field",
                    )
                if current == spec:
                    await pipe.reset()
                    return False, False
                # Under the WATCH on the spec: the bound only changes with the spec, so this read is current.
                bound = max(bound_of(current, await pipe.hget(state_key, BOUND_FIELD)), spec.sampling.max_new_tokens)
                pipe.multi()
                pipe.set(spec_key, body)
                pipe.hset(state_key, mapping={"updated_at": now, BOUND_FIELD: bound})
                await pipe.execute()
                return False, True
            except redis_exc.WatchError:
                continue


def epoch_record_key(run: str, epoch: int) -> str:
    """The bucket's record of a registered trainer epoch (its content: the trainer's worker id)."""
    return f"runs/{run}/trainer-epochs/{epoch:012d}"


# How long a registration's request id answers its replays with the same epoch (s).
REGISTER_REPLAY_TTL_S = 600

# KEYS: state, request. ARGV: now, request_ttl_s. Returns {epoch, 1 if new}.
_REGISTER = Lua.load("trainer_register.lua")


async def register_trainer(r: Any, run: str) -> int:
    """A new, strictly larger epoch. Every trainer write with a smaller one is fenced from now on."""
    state_key = keys.run_key(run, keys.STATE)
    pipe = r.pipeline(transaction=True)
    pipe.hincrby(state_key, "trainer_epoch", 1)
    pipe.hset(state_key, "updated_at", time.time())
    epoch, _ = await pipe.execute()
    return int(epoch)


async def register_trainer_once(r: Any, run: str, request_id: str | None) -> tuple[int, bool]:
    """:func:`register_trainer` for a request: (epoch, True when this call took it).

    A replay of a registration (same ``request_id``) answers the epoch its first attempt took (and False),
    even if a newer trainer registered since (then it is fenced, as its first attempt would be): a retry must
    never fence the very trainer that sent it."""
    if request_id is None:
        return await register_trainer(r, run), True
    request_key = keys.run_key(run, f"trainer:registerreq:{request_id}")
    epoch, new = await _REGISTER(r, [keys.run_key(run, keys.STATE), request_key], [time.time(), REGISTER_REPLAY_TTL_S])
    return int(epoch), bool(new)


async def set_trainer_step(r: Any, run: str, step: int) -> None:
    await r.hset(keys.run_key(run, keys.STATE), "trainer_step", step)
