"""The generator pool: one lease route for generators serving several runs (docs/pool.md, issue 23)."""

from typing import Literal

from pydantic import Field

from bucketrl.wire.common import RequestId, RunId, ShortStr, Version, WireModel, WorkerId
from bucketrl.wire.leases import PromptLeaseItem


class PoolLeaseRequest(WireModel):
    worker_id: WorkerId
    # The runs this generator may serve (None: every run its token reaches). Naming an unknown run is 404, one
    # out of the token's scope 403: a typo must not silently shrink the pool.
    runs: list[RunId] | None = Field(None, min_length=1, max_length=256)
    # Only runs of this base model (a generator loads one base model; None: no filter).
    base_model: ShortStr | None = None
    # The policy version the caller has loaded per run (absent: the latest), as PromptLeaseRequest.version.
    versions: dict[RunId, Version] = Field(default_factory=dict, max_length=256)
    n: int = Field(1, ge=1, le=4096)
    ttl_s: float = Field(300.0, gt=0.0, le=86_400.0)
    wait_s: float = Field(0.0, ge=0.0, le=60.0)
    # Unique per lease, the same on its retries: a replay is answered from the run the first attempt picked.
    request_id: RequestId | None = None


class PoolLease(WireModel):
    run: str
    prompts: list[PromptLeaseItem]
    expires_at: float
    waited_s: float = 0.0
    # The runs tried before this one, in fair-share order, and why each was passed over.
    passed_over: dict[str, str] = Field(default_factory=dict)


PoolHold = Literal["ok", "paused", "budget", "finished"]


def lora_slots_needed(max_staleness: int) -> int:
    """The LoRA slots a pool generator gives one run: its staleness window plus one to load the next version."""
    return max_staleness + 2


class RunPoolStatus(WireModel):
    """One run's place in the pool: its weight, what it got, and whether it is held."""

    run: str
    share: float
    tokens_generated: int
    groups_accepted: int
    paused: bool
    budget_tokens: int | None
    # "ok", or why pool leases skip it (and per-run leases answer 429): paused, its budget spent, or finished (its
    # trainer reached max_steps: its share goes to the other runs at once, until a trainer registers again).
    hold: PoolHold
    prompts_inflight: int = 0
    # Generated tokens of groups accepted over the last ``PoolStatus.recent_window_s`` (not kept across a wipe).
    tokens_recent: int = 0
    # Of ``budget_tokens``, the fraction generated so far (None: no budget). 1.0 or more: hold ``budget``.
    budget_used: float | None = None
    # Its queue: groups accepted and not yet claimed by its trainer, out of its ``queue_capacity_groups``.
    queue_groups: int = 0
    queue_capacity: int | None = None
    # Its live versions (those a lease still holds, oldest first) and the LoRA slots they take on the engines:
    # ``generators`` heard from lately, ``adapters_loaded`` the run's adapters they hold, ``slots_per_generator``
    # what one pool generator gives the run (max_staleness + 2, docs/pool.md). Empty/0 from an older proxy.
    live_versions: list[int] = Field(default_factory=list)
    generators: int = 0
    adapters_loaded: int = 0
    slots_per_generator: int | None = None


class PoolStatus(WireModel):
    runs: list[RunPoolStatus]
    # Each run's tokens_generated over the sum of all listed runs' (what share it actually got).
    token_fraction: dict[str, float] = Field(default_factory=dict)
    # The same over the recent window: the share each run is getting now (a sweep's late run, a paused one).
    recent_fraction: dict[str, float] = Field(default_factory=dict)
    recent_window_s: float = 60.0
