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
rollouts reports the same figures for comparison.
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

from bucketrl.trainer.batching import TrainingSample


def trained_versions(sample: TrainingSample) -> Counter[int]:
    """Tokens the sample trains, per version that sampled them."""
    if sample.token_versions is None:
        return Counter({sample.version: sample.trained_tokens})
    mask = sample.loss_mask or (1,) * len(sample.token_versions)
    n = sample.n_valid
    return Counter(v for v, m in zip(sample.token_versions[:n], mask[:n], strict=True) if m)


def token_version_stats(samples: list[TrainingSample], policy_version: int) -> dict[str, float]:
    """The figures of the module docstring over a step's samples (before wholly masked ones are dropped)."""
    if not samples:
        return {}
    staleness: Counter[int] = Counter()
    mixed = 0
    spans: list[int] = []
    for s in samples:
        by_version = trained_versions(s)
        for version, n in by_version.items():
            staleness[policy_version - version] += n
        sampled_by = set(s.token_versions) if s.token_versions is not None else {s.version}
        if len(sampled_by) > 1:
            mixed += sum(by_version.values())
        spans.append(_span_count(s))
    trained = sum(staleness.values())
    stats = {
        "tokens/stale_masked": float(sum(s.stale_masked for s in samples)),
        "tokens/stale_masked_completions": float(sum(1 for s in samples if s.stale_masked and not s.trained_tokens)),
        "tokens/mixed_version_frac": mixed / trained if trained else 0.0,
        "tokens/spans_per_completion": sum(spans) / len(spans),
        "tokens/spans_per_completion_max": float(max(spans)),
    }
    if trained:
        stats["tokens/staleness_p50"] = float(_median(staleness))
        stats["tokens/staleness_max"] = float(max(staleness))
    return stats


def _span_count(sample: TrainingSample) -> int:
    versions = sample.token_versions
    if versions is None:
        return 1
    return 1 + sum(1 for a, b in pairwise(versions) if a != b)


def _median(counts: Counter[int]) -> int:
    """The lower median of values given as value -> count."""
    half, seen = (sum(counts.values()) + 1) // 2, 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= half:
            return value
    raise ValueError("no values")  # pragma: no cover - callers pass a non-empty counter
