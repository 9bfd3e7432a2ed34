"""Group advantages (ties, unscorable rewards) and batching (padding, EOS masking, token budget)."""

from __future__ import annotations

import math

import pytest

from bucketrl.trainer.advantages import STD_EPS, group_advantages
from bucketrl.trainer.batching import collate, group_samples, make_micro_batches, plan_micro_batches, valid_length
from bucketrl.wire.rollouts import Completion, RolloutGroup


def test_advantages_are_centred_and_scaled_by_the_unbiased_group_std() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    std = math.sqrt((4 * 0.25) / 3)
    a = 0.5 / (std + STD_EPS)
    assert adv.advantages == pytest.approx([a, -a, -a, a])
    assert adv.trainable == [True] * 4
    assert not adv.zero_variance
    assert adv.reward_mean == pytest.approx(0.5)


def test_scale_none_only_centres() -> None:
    assert group_advantages([3.0, 1.0, 2.0], scale_rewards="none").advantages == pytest.approx([1.0, -1.0, 0.0])


def test_zero_variance_group_gets_zero_advantages_and_is_counted_and_optionally_filtered() -> None:
    kept = group_advantages([0.5, 0.5, 0.5])
    assert kept.zero_variance and kept.advantages == [0.0, 0.0, 0.0] and kept.trainable == [True] * 3
    dropped = group_advantages([0.5, 0.5, 0.5], filter_zero_variance=True)
    assert dropped.zero_variance and dropped.trainable == [False] * 3


def test_unscorable_completions_are_excluded_from_statistics_and_training() -> None:
    adv = group_advantages([1.0, None, 0.0, None], scale_rewards="none")
    assert adv.unscorable == 2
    # Mean over the two scored rewards only (0.5), not over four with None as 0 (0.25).
    assert adv.advantages == pytest.approx([0.5, 0.0, -0.5, 0.0])
    assert adv.trainable == [True, False, True, False]
    # One scorable completion left: no signal (zero variance), and nothing scorable at all.
    single = group_advantages([None, 2.0, None])
    assert single.zero_variance and single.advantages == [0.0] * 3 and single.trainable == [False, True, False]
    none = group_advantages([None, None])
    assert none.zero_variance and none.trainable == [False, False] and none.reward_mean is None


def test_bad_scale_rewards_is_refused() -> None:
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages([1.0, 0.0], scale_rewards="batch")


def test_valid_length_stops_after_the_first_eos() -> None:
    assert valid_length([5, 6, 1, 7, 1], {1}) == 3
    assert valid_length([5, 6, 7], {1}) == 3
    assert valid_length([2, 5], {1, 2}) == 1
    assert valid_length([5], set()) == 1


def make_group(prompt: list[int], completions: list[list[int]], rewards: list[float | None]) -> RolloutGroup:
    return RolloutGroup(
        prompt_id="0-0",
        prompt_index=0,
        prompt_token_ids=prompt,
        completions=[
            Completion(token_ids=c, logprobs=[-0.1 * (i + 1) for i in range(len(c))], reward=r)
            for c, r in zip(completions, rewards, strict=True)
        ],
    )


def test_group_samples_skip_untrainable_and_mask_after_eos() -> None:
    group = make_group([10, 11], [[20, 1, 21, 22], [30, 31], [40]], [1.0, None, 0.0])
    adv = group_advantages([c.reward for c in group.completions])
    samples = group_samples(group, adv.advantages, adv.trainable, version=3, worker_id="g", eos_token_ids={1})
    assert [s.completion_ids for s in samples] == [[20, 1, 21, 22], [40]]
    assert [s.n_valid for s in samples] == [2, 1]
    assert samples[0].version == 3 and samples[0].worker_id == "g"


def test_collate_right_pads_and_points_each_completion_token_at_its_predicting_logit() -> None:
    group = make_group([10, 11, 12], [[20, 1, 21]], [1.0])
    group2 = make_group([13], [[30, 31, 32, 33, 34]], [1.0])
    s1 = group_samples(group, [1.0], [True], version=1, worker_id="a", eos_token_ids={1})
    s2 = group_samples(group2, [-1.0], [True], version=1, worker_id="b", eos_token_ids={1})
    mb = collate(s1 + s2, pad_id=0)
    assert mb.input_ids.tolist() == [[10, 11, 12, 20, 1, 21], [13, 30, 31, 32, 33, 34]]
    assert mb.attention_mask.tolist() == [[1] * 6, [1] * 6]
    assert mb.completion_ids.tolist() == [[20, 1, 21, 0, 0], [30, 31, 32, 33, 34]]
    assert mb.mask.tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert mb.advantages.tolist() == [1.0, -1.0]
    # keep = 6 - 1 + 1 = 6 logits: kept row r is absolute position r. Completion token t of a prompt of
    # length p is predicted by position p + t - 1.
    assert mb.logits_to_keep == 6
    assert mb.logit_index[0, :3].tolist() == [2, 3, 4]
    assert mb.logit_index[1].tolist() == [0, 1, 2, 3, 4]
    for b in range(2):
        for t_ in range(int(mb.mask[b].sum())):
            assert mb.input_ids[b, mb.logit_index[b, t_] + 1] == mb.completion_ids[b, t_]
    assert mb.behaviour[0].tolist() == pytest.approx([-0.1, -0.2, -0.3, 0.0, 0.0])


def test_micro_batches_respect_the_token_budget_and_keep_every_sample_once() -> None:
    lengths = [10, 3, 7, 7, 2, 12, 5]
    plans = plan_micro_batches(lengths, token_budget=14)
    assert sorted(i for p in plans for i in p) == list(range(len(lengths)))
    for plan in plans:
        assert len(plan) == 1 or len(plan) * max(lengths[i] for i in plan) <= 14
    # A sample longer than the budget still gets a micro-batch of its own.
    assert plan_micro_batches([20, 1], token_budget=8) == [[0], [1]]
    with pytest.raises(ValueError):
        plan_micro_batches([1], token_budget=0)


def test_make_micro_batches_covers_all_tokens() -> None:
    groups = [make_group([5] * (i + 1), [[7] * (2 * i + 1), [8] * (i + 2)], [1.0, 0.0]) for i in range(4)]
    samples = []
    for g in groups:
        samples += group_samples(g, [1.0, -1.0], [True, True], version=1, worker_id="w", eos_token_ids=set())
    mbs = make_micro_batches(samples, token_budget=24, pad_id=0)
    assert len(mbs) > 1
    assert sum(float(mb.mask.sum()) for mb in mbs) == sum(len(s.completion_ids) for s in samples)
    assert all(mb.input_ids.numel() <= 24 or mb.size == 1 for mb in mbs)
