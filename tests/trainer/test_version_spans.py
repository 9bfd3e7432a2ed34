"""Partial rollouts in the trainer (issue 35): a token is trained only while the version that sampled it is within
``max_staleness`` of the policy version trained; the step's loss on a mixed-span group equals a reference computed
token by token, for each objective; the step reports the per-token version figures."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest

from bucketrl.sim.trainer import SimLearner, SimTrainerSettings
from bucketrl.trainer.advantages import group_advantages
from bucketrl.trainer.batching import group_samples
from bucketrl.trainer.learner import Learner, StepGroup
from bucketrl.trainer.recompute import recompute_logprobs
from bucketrl.wire import Completion, DatasetSpec, LossSpec, RewardSpec, RolloutGroup, RunSpec, VersionSpan
from tests.trainer.helpers import EOS, settings, tiny_spec
from tests.trainer.test_model import perturb_adapter

BATCH_VERSION, POLICY_VERSION, MAX_STALENESS = 6, 7, 2  # tokens of versions >= 5 are trained
FLOOR = POLICY_VERSION - MAX_STALENESS


def _spans(*triples: tuple[int, int, int]) -> list[VersionSpan]:
    return [VersionSpan(version=v, start=a, end=b) for v, a, b in triples]


# (tokens, spans, reward): c0 began under v4 (its 2 first tokens too old), c1 under v5 (all trained), c2 is
# whole-version, c3 ends at its EOS within the v3 span: nothing of it is trained (it is no sample).
COMPLETIONS: list[tuple[list[int], list[VersionSpan] | None, float]] = [
    ([11, 12, 13, 14, 15], _spans((4, 0, 2), (6, 2, 5)), 1.0),
    ([21, 22, 23, 24], _spans((5, 0, 1), (6, 1, 4)), 0.0),
    ([31, 32, 33], None, 1.0),
    ([41, EOS, 43, 44], _spans((3, 0, 2), (6, 2, 4)), 0.0),
]


def _group(logprobs: list[list[float]]) -> RolloutGroup:
    comps = [
        Completion(token_ids=ids, logprobs=lps, reward=r, version_spans=spans)
        for (ids, spans, r), lps in zip(COMPLETIONS, logprobs, strict=True)
    ]
    return RolloutGroup(prompt_id="0-0", prompt_index=0, prompt_token_ids=[5, 6, 7], completions=comps)


def _trained(i: int) -> list[int]:
    """Positions of completion i the loss trains: up to its first EOS, sampled by a version >= FLOOR."""
    ids, spans, _ = COMPLETIONS[i]
    versions = Completion(token_ids=ids, logprobs=[-1.0] * len(ids), reward=0.0, version_spans=spans)
    n = ids.index(EOS) + 1 if EOS in ids else len(ids)
    return [t for t, v in enumerate(versions.token_versions(BATCH_VERSION)[:n]) if v >= FLOOR]


def _reference(lp: list[list[float]], behav: list[list[float]], adv: list[float], spec: LossSpec) -> float:
    """The loss, token by token in plain floats, over the trained positions only (a sequence with none is left
    out, also from the sequence counts)."""
    lo, hi = 1 - spec.epsilon_low, 1 + spec.epsilon_high
    rows = [(i, _trained(i)) for i in range(len(lp)) if _trained(i)]
    per_seq: list[float] = []
    for i, toks in rows:
        if spec.objective == "gspo":  # one ratio over the sequence's trained tokens only
            s = math.exp(sum(lp[i][t] - behav[i][t] for t in toks) / len(toks))
            per_seq.append(-min(s * adv[i], min(max(s, lo), hi) * adv[i]) * len(toks))
            continue
        total = 0.0
        for t in toks:
            if spec.objective == "decoupled":  # pi_theta == pi_prox at the step's only forward: r = 1
                total += -min(math.exp(lp[i][t] - behav[i][t]), spec.is_cap) * adv[i]
            else:
                r = math.exp(lp[i][t] - behav[i][t])
                total += -min(r * adv[i], min(max(r, lo), hi) * adv[i])
        per_seq.append(total)
    if spec.aggregation == "token":
        return sum(per_seq) / sum(len(toks) for _, toks in rows)
    if spec.aggregation == "constant":
        assert spec.constant_normalizer is not None
        return sum(per_seq) / (len(rows) * spec.constant_normalizer)
    return sum(p / len(toks) for p, (_, toks) in zip(per_seq, rows, strict=True)) / len(rows)


@pytest.mark.parametrize(
    "loss",
    [
        {"objective": "ppo_clip"},
        {"objective": "decoupled", "aggregation": "constant", "scale_rewards": "none"},  # Dr.GRPO
        {"objective": "gspo", "aggregation": "sequence", "epsilon_low": 0.05, "epsilon_high": 0.08},
    ],
)
def test_a_mixed_span_step_is_the_token_by_token_loss_and_masks_too_old_tokens(
    tiny_model_dir: Path, loss: dict[str, Any]
) -> None:
    spec = tiny_spec(tiny_model_dir, max_staleness=MAX_STALENESS, partial_rollouts=True, loss=LossSpec(**loss))
    learner = Learner(spec, settings(micro_token_budget=24))  # several micro-batches: the step's normalisers
    perturb_adapter(learner.policy, seed=5, scale=0.3)
    lp = recompute_logprobs(learner.policy, _group([[-1.0] * len(c[0]) for c in COMPLETIONS]))
    rng = random.Random(0)  # behaviour = the trainer's +- 0.3: ratios off 1, some clipped
    behav = [[x + rng.uniform(-0.3, 0.3) for x in row] for row in lp]
    adv = group_advantages([c[2] for c in COMPLETIONS], scale_rewards=spec.loss.scale_rewards).advantages

    stats = learner.train_step([StepGroup(_group(behav), BATCH_VERSION, "gen")], policy_version=POLICY_VERSION)

    assert stats["train/loss"] == pytest.approx(_reference(lp, behav, adv, spec.loss), rel=1e-4, abs=1e-6)
    assert (stats["train/tokens"], stats["train/sequences"]) == (3 + 4 + 3, 3)
    assert stats["tokens/stale_masked"] == 2 + 2 and stats["tokens/stale_masked_completions"] == 1
    assert stats["tokens/mixed_version_frac"] == pytest.approx(7 / 10)
    assert stats["tokens/spans_per_completion"] == pytest.approx(7 / 4)
    assert (stats["tokens/staleness_p50"], stats["tokens/staleness_max"]) == (1, 2)


def test_without_a_floor_nothing_is_masked_and_tokens_keep_their_versions() -> None:
    """recompute and other callers without a policy version: the mask is untouched, the versions are known."""
    group = _group([[-1.0] * len(c[0]) for c in COMPLETIONS])
    samples = group_samples(group, [1.0] * 4, [True] * 4, version=BATCH_VERSION, worker_id="g", eos_token_ids={EOS})
    assert [s.trained_tokens for s in samples] == [5, 4, 3, 2]
    assert [s.token_versions for s in samples][:3] == [(4, 4, 6, 6, 6), (5, 6, 6, 6), None]
    floored = group_samples(
        group, [1.0] * 4, [True] * 4, version=BATCH_VERSION, worker_id="g", eos_token_ids={EOS}, min_version=FLOOR
    )
    assert [(s.trained_tokens, s.stale_masked) for s in floored] == [(3, 2), (4, 0), (3, 0), (0, 2)]


def test_the_mismatch_check_compares_only_tokens_of_the_weights_version(tiny_model_dir: Path) -> None:
    """Invariant 6 on a continued completion: its v6 tokens are off by 1.0 (they were sampled by other weights),
    its v7 tokens are the trainer's own: the training forward (v7 weights) sees no gap."""
    spec = tiny_spec(tiny_model_dir, max_staleness=MAX_STALENESS, partial_rollouts=True, group_size=2)
    learner = Learner(spec, settings())
    perturb_adapter(learner.policy, seed=5, scale=0.3)
    ids = [11, 12, 13, 14, 15]
    plain = RolloutGroup(
        prompt_id="0-0",
        prompt_index=0,
        prompt_token_ids=[5, 6, 7],
        completions=[Completion(token_ids=ids, logprobs=[-1.0] * 5, reward=float(r)) for r in (0, 1)],
    )
    lp = recompute_logprobs(learner.policy, plain)
    spans = _spans((6, 0, 2), (7, 2, 5))
    comps = [
        Completion(token_ids=ids, logprobs=[x - (t < 2) for t, x in enumerate(row)], reward=r, version_spans=spans)
        for r, row in zip((0.0, 1.0), lp, strict=True)
    ]
    group = plain.model_copy(update={"completions": comps})
    stats = learner.train_step([StepGroup(group, POLICY_VERSION, "gen")], policy_version=POLICY_VERSION)
    assert stats["mismatch/logprob_abs_diff/gen"] < 1e-4


def test_the_simulated_trainer_reports_the_same_figures_without_a_model() -> None:
    """What bench/ runs on: every token trained unless older than the floor (the simulated trainer cuts no EOS, so
    c3's v6 tokens count there)."""
    spec = RunSpec(
        base_model="sim",
        reward=RewardSpec(name="toy"),
        dataset=DatasetSpec(uri="toy:digits", size=4),
        vocab_size=64,
        group_size=4,
        max_staleness=MAX_STALENESS,
        partial_rollouts=True,
    )
    learner = SimLearner(spec, SimTrainerSettings(sim_step_s=0.0, sim_adapter_bytes=4096))
    group = _group([[-1.0] * len(c[0]) for c in COMPLETIONS])
    stats = learner.train_step([StepGroup(group, BATCH_VERSION, "gen")], policy_version=POLICY_VERSION)
    assert (stats["tokens/stale_masked"], stats["tokens/stale_masked_completions"]) == (4, 0)
    assert stats["tokens/mixed_version_frac"] == pytest.approx(9 / 12)
    assert (stats["tokens/staleness_p50"], stats["tokens/staleness_max"]) == (1, 2)
