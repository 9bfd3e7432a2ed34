"""Partial rollouts (issue 35, a run with ``partial_rollouts``): a call that a newer adapter version overtakes goes on
under it instead of being abandoned.

While a call samples under version v, the engine's hook watches the versions loaded meanwhile. Once a newer one is
loaded and v is ``switch_lag`` versions behind it (or v is about to leave the staleness window), the hook raises
:class:`~bucketrl.rollout.engine.StopAtStep`; the engine stops at that step and hands back what each completion
sampled (:class:`~bucketrl.rollout.engine.CallInterrupted`). Finished completions stay as they are; each unfinished
one is continued under the newer version from its prompt ids plus its token ids so far (never re-tokenised text),
with the ``max_new_tokens`` it has left. The engine prefills that continuation in full: a KV cache computed under
one adapter is not another's. A continuation may be overtaken in turn.

Every completion records which version sampled which of its tokens (``VersionSpan``: half-open, contiguous, versions
non-decreasing); the batch holds every version it sampled with (:class:`~bucketrl.generator.submit.HeldVersions`) and
is submitted once, as of the newest, under its one idempotency key. The trainer masks tokens whose version left the
window by the time it trains them. Multi-turn episodes and completion jobs stay whole-version.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bucketrl.rollout.engine import CallInterrupted, SampledCompletion, StopAtStep
from bucketrl.wire import VersionSpan
from bucketrl.wire.runs import versions_left

if TYPE_CHECKING:
    from bucketrl.generator.adapters import VersionBook, VersionSlot
    from bucketrl.generator.submit import HeldVersions
    from bucketrl.rollout.engine import Engine, FinishReason
    from bucketrl.wire import RunSpec

log = logging.getLogger(__name__)


@dataclass
class Growing:
    """One completion as it is sampled, span by span."""

    prompt: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[VersionSpan] = field(default_factory=list)
    finish_reason: FinishReason = "abort"

    def extend(self, version: int, s: SampledCompletion) -> None:
        if s.token_ids:  # spans are never empty (the wire refuses them)
            start = len(self.token_ids)
            self.spans.append(VersionSpan(version=version, start=start, end=start + len(s.token_ids)))
            self.token_ids += s.token_ids
            self.logprobs += s.logprobs
        self.finish_reason = s.finish_reason

    @property
    def done(self) -> bool:
        return self.finish_reason != "abort"

    def sample(self) -> SampledCompletion:
        return SampledCompletion(self.token_ids, self.logprobs, self.finish_reason)


@dataclass
class PartialResult:
    samples: list[list[SampledCompletion]]
    # Per completion, the versions that sampled it; None when one version sampled the whole batch (bytes as today).
    spans: list[list[list[VersionSpan]]] | None
    continuations: int  # engine calls that continued completions under a newer version


def overtaken(book: VersionBook, version: int, heard: int, spec: RunSpec, switch_lag: int) -> bool:
    """Whether a call under ``version`` should stop and go on under the newest loaded version."""
    cur = book.current()
    if cur is None or cur.version <= version:
        return False  # nothing newer to go on with (yet)
    return cur.version - version >= switch_lag or versions_left(version, heard, spec.max_staleness) <= 0


def sample_partial(
    engine: Engine,
    held: HeldVersions,
    book: VersionBook,
    ids: list[list[int]],
    spec: RunSpec,
    hook: Callable[[VersionSlot], None],
    *,
    names: Sequence[str] = (),
) -> PartialResult:
    """Sample ``spec.group_size`` completions per prompt, continuing them under newer versions as they come.
    ``hook(slot)`` is the engine's ``while_running`` for a call under ``slot``: it raises ``StopAtStep`` when
    the call should go on under a newer version. ``names``: the prompts' ids, for the log line of each cut."""
    g = spec.group_size
    grid = [[Growing(list(p)) for _ in range(g)] for p in ids]
    slot = held.newest
    got = _call(engine, slot, ids, g, spec.sampling.max_new_tokens, spec, hook)
    for row, group in zip(grid, got, strict=True):
        for c, s in zip(row, group, strict=True):
            c.extend(slot.version, s)
    continuations = 0
    while todo := [c for row in grid for c in row if not c.done]:
        newest = book.current()
        if newest is None:  # the held versions are never retired: only a broken book gets here
            raise RuntimeError(
                f"partial rollouts: {len(todo)} completion(s) of a v{slot.version} call were stopped to go on under a "
                "newer version, but no adapter version is loaded to go on with"
            )
        cut_under = slot.version
        if newest.version > slot.version:
            slot = held.hold(newest.version)
        # A line per cut: when a continuation runs, and which prompts' leases it keeps (what the kill tests watch).
        log.info(
            "partial rollouts: continuing %d of %d completion(s) of prompts [%s] under v%d (cut under v%d)",
            len(todo),
            g * len(grid),
            ", ".join(names),
            slot.version,
            cut_under,
        )
        # Completions cut at the same step have the same budget left: one call each (usually one in all).
        by_left: dict[int, list[Growing]] = {}
        for c in todo:
            by_left.setdefault(spec.sampling.max_new_tokens - len(c.token_ids), []).append(c)
        for left, cs in by_left.items():
            continuations += 1
            out = _call(engine, slot, [c.prompt + c.token_ids for c in cs], 1, left, spec, hook)
            for c, group in zip(cs, out, strict=True):
                c.extend(slot.version, group[0])
    samples = [[c.sample() for c in row] for row in grid]
    versions = {s.version for row in grid for c in row for s in c.spans}
    # Spans unless every token is of the version the batch is submitted as (a version held for a continuation
    # that was overtaken before its first token would otherwise claim tokens it did not sample).
    spans = None if versions <= {held.newest.version} else [[c.spans for c in row] for row in grid]
    return PartialResult(samples, spans, continuations)


def _call(
    engine: Engine,
    slot: VersionSlot,
    prompts: list[list[int]],
    n: int,
    max_new_tokens: int,
    spec: RunSpec,
    hook: Callable[[VersionSlot], None],
) -> list[list[SampledCompletion]]:
    """One engine call under ``slot``; an interrupted one gives what it sampled (nothing, stopped before a step)."""
    sampling = spec.sampling.model_copy(update={"max_new_tokens": max_new_tokens})
    try:
        return engine.generate(prompts, adapter=slot.name, n=n, sampling=sampling, while_running=lambda: hook(slot))
    except CallInterrupted as cut:
        return cut.partial
    except StopAtStep:
        return [[SampledCompletion([], [], "abort") for _ in range(n)] for _ in prompts]
