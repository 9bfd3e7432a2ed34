"""A step's per-token version figures (partial rollouts, issue 35): which version sampled the tokens it trains, how
stale they are against the policy version being trained, and what it masked out as too old.

    tokens/stale_masked               tokens of trainable completions (up to their first EOS) masked out because
                                      the version that sampled them is older than the policy - max_staleness
    tokens/stale_masked_completions   completions wholly masked so (they train nothing; their group counts as
                                      trained all the same: exactly-once is per group)
    tokens/mixed_version_frac         share of the trained tokens that come from completions sampled by more
                                      than one version
    tokens/spans_per_completion       mean version spans per trainable completion (1: whole-version), and _max
    tokens/staleness_p50, _max        per trained token: the policy version trained - the version that sampled it

Whole-version completions count too (one span, every token their batch's version), so a run without partial
rollouts reports the same figures for comparison. Torch-free: the simulated trainer (``bucketrl/sim/trainer.py``)
reports the same figures from its groups with :func:`tally_completion`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING

from bucketrl.wire.rollouts import Completion

if TYPE_CHECKING:
    from bucketrl.trainer.batching import TrainingSample


@dataclass(frozen=True)
class TokenTally:
    """One trainable completion's tokens by version."""

    trained: Counter[int]  # trained tokens per version that sampled them
    mixed: bool  # sampled by more than one version
    spans: int  # runs of one version
    stale_masked: int  # tokens masked out as too old


def tally_sample(sample: TrainingSample) -> TokenTally:
    """A training sample's tally (its loss mask already holds the staleness floor)."""
    versions = sample.token_versions
    n = sample.n_valid
    if versions is None:
        return TokenTally(+Counter({sample.version: sample.trained_tokens}), False, 1, sample.stale_masked)
    mask = sample.loss_mask or (1,) * len(versions)
    trained = Counter(v for v, m in zip(versions[:n], mask[:n], strict=True) if m)
    return TokenTally(trained, len(set(versions)) > 1, _runs(versions), sample.stale_masked)


def tally_completion(completion: Completion, version: int, floor: int) -> TokenTally:
    """A completion's tally when every token is trained unless older than ``floor`` (no EOS cut: the simulated
    trainer's view)."""
    versions = completion.token_versions(version)
    trained = Counter(v for v in versions if v >= floor)
    stale = len(versions) - sum(trained.values())
    return TokenTally(trained, len(set(versions)) > 1, _runs(versions), stale)


def token_version_stats(tallies: list[TokenTally], policy_version: int) -> dict[str, float]:
    """The figures of the module docstring over a step's trainable completions (wholly masked ones included)."""
    if not tallies:
        return {}
    staleness: Counter[int] = Counter()
    mixed = 0
    for t in tallies:
        for version, n in t.trained.items():
            staleness[policy_version - version] += n
        if t.mixed:
            mixed += sum(t.trained.values())
    staleness = +staleness  # only counts > 0
    trained = sum(staleness.values())
    stats = {
        "tokens/stale_masked": float(sum(t.stale_masked for t in tallies)),
        "tokens/stale_masked_completions": float(sum(1 for t in tallies if t.stale_masked and not t.trained.total())),
        "tokens/mixed_version_frac": mixed / trained if trained else 0.0,
        "tokens/spans_per_completion": sum(t.spans for t in tallies) / len(tallies),
        "tokens/spans_per_completion_max": float(max(t.spans for t in tallies)),
    }
    if trained:
        stats["tokens/staleness_p50"] = float(_median(staleness))
        stats["tokens/staleness_max"] = float(max(staleness))
    return stats


def _runs(versions: list[int] | tuple[int, ...]) -> int:
    return 1 + sum(1 for a, b in pairwise(versions) if a != b)


def _median(counts: Counter[int]) -> int:
    """The lower median of values given as value -> count."""
    half, seen = (sum(counts.values()) + 1) // 2, 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= half:
            return value
    raise ValueError("no values")  # pragma: no cover - callers pass a non-empty counter
