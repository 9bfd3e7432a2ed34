"""The training step learns, and a checkpoint restores a state whose next step equals the uninterrupted one."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from bucketrl.trainer.batching import collate, group_samples
from bucketrl.trainer.checkpoint import TrainerState, pack_checkpoint, restore_checkpoint
from bucketrl.trainer.learner import MISMATCH_PREFIX, Learner, StepGroup
from bucketrl.wire.rollouts import Completion, RolloutGroup
from bucketrl.wire.runs import LoraSpec, LossSpec
from tests.trainer.helpers import random_group, settings, tiny_spec

PROMPT = [5, 6, 7]
GOOD, BAD = 10, 11


def on_policy_group(learner: Learner, index: int) -> RolloutGroup:
    """Completions GOOD (reward 1) and BAD (reward 0) with behaviour logprobs from the current weights."""
    comps = [Completion(token_ids=[tok], logprobs=[-1.0], reward=float(tok == GOOD)) for tok in (GOOD, BAD, GOOD, BAD)]
    group = RolloutGroup(prompt_id=f"0-{index}", prompt_index=index, prompt_token_ids=PROMPT, completions=comps)
    mb = collate(group_samples(group, [0.0] * 4, [True] * 4, version=1, worker_id="w", eos_token_ids=set()), 0)
    with torch.no_grad():
        lp, _ = learner.policy.token_logprobs(mb)
    for comp, value in zip(group.completions, lp[:, 0].tolist(), strict=True):
        comp.logprobs = [value]
    return group


def token_logprob(learner: Learner, token: int) -> float:
    group = RolloutGroup(
        prompt_id="0-0",
        prompt_index=0,
        prompt_token_ids=PROMPT,
        completions=[Completion(token_ids=[token], logprobs=[-1.0], reward=0.0)],
    )
    mb = collate(group_samples(group, [0.0], [True], version=1, worker_id="w", eos_token_ids=set()), 0)
    with torch.no_grad():
        return float(learner.policy.token_logprobs(mb)[0][0, 0])


@pytest.mark.parametrize("objective", ["ppo_clip", "decoupled"])
def test_steps_raise_the_probability_of_rewarded_completions(tiny_model_dir: Path, objective: str) -> None:
    learner = Learner(tiny_spec(tiny_model_dir, loss=LossSpec(objective=objective)), settings(lr=5e-2))
    good0, bad0 = token_logprob(learner, GOOD), token_logprob(learner, BAD)
    for i in range(4):
        stats = learner.train_step(
            [StepGroup(on_policy_group(learner, i), version=i + 1, worker_id="gen-a")], policy_version=i + 1
        )
        # On-policy data: the ratio is 1 and the per-generator mismatch is ~0.
        assert stats["ratio"] == pytest.approx(1.0, abs=1e-5)
        assert stats[MISMATCH_PREFIX + "gen-a"] < 1e-5
        assert stats["train/grad_norm"] > 0
    assert token_logprob(learner, GOOD) > good0 + 0.1
    assert token_logprob(learner, BAD) < bad0 - 0.1
    assert learner.step == 4


def test_step_stats_cover_staleness_rewards_and_zero_variance(tiny_model_dir: Path) -> None:
    learner = Learner(tiny_spec(tiny_model_dir, loss=LossSpec(kl_coef=0.1)), settings())
    rng = random.Random(0)
    flat = random_group(rng, index=1, reward_fn=lambda toks: 0.5)
    groups = [StepGroup(random_group(rng, index=0), 3, "a"), StepGroup(flat, 5, "b")]
    stats = learner.train_step(groups, policy_version=5)
    assert stats["sample/staleness_mean"] == 1.0 and stats["sample/staleness_max"] == 2.0
    assert stats["sample/zero_variance_groups"] == 1.0
    # Only generator b's samples were made at the trainer's current version (5): only b gets a mismatch metric.
    assert MISMATCH_PREFIX + "b" in stats and MISMATCH_PREFIX + "a" not in stats
    for key in ("train/loss", "train/lr", "ratio", "kl", "entropy", "clip_ratio/region_mean", "reward", "reward_std"):
        assert key in stats, key
    assert stats["kl"] >= 0.0


def test_a_step_with_nothing_trainable_counts_but_keeps_the_weights(tiny_model_dir: Path) -> None:
    learner = Learner(tiny_spec(tiny_model_dir, loss=LossSpec(filter_zero_variance=True)), settings())
    before = learner.policy.adapter_state()
    flat = random_group(random.Random(2), reward_fn=lambda toks: 1.0)
    stats = learner.train_step([StepGroup(flat, 1, "a")], policy_version=1)
    assert stats["train/sequences"] == 0.0 and stats["sample/zero_variance_groups"] == 1.0
    assert learner.step == 1
    for k, v in learner.policy.adapter_state().items():
        assert torch.equal(v, before[k])


def make_batches(n: int, seed: int = 0) -> list[list[StepGroup]]:
    rng = random.Random(seed)
    return [
        [StepGroup(random_group(rng, index=2 * i + j), version=1, worker_id="g") for j in range(2)] for i in range(n)
    ]


def test_first_step_after_resume_equals_the_uninterrupted_run(tiny_model_dir: Path) -> None:
    # LoRA dropout makes the step depend on the RNG; warmup makes it depend on the step; AdamW on its moments.
    spec = tiny_spec(tiny_model_dir, lora=LoraSpec(r=4, alpha=8.0, dropout=0.1), loss=LossSpec(kl_coef=0.05))
    cfg = settings(warmup_steps=5, lr=1e-2)
    batches = make_batches(4)

    uninterrupted = Learner(spec, cfg)
    for b in batches[:2]:
        uninterrupted.train_step(b, policy_version=1)
    state = TrainerState(step=0, policy_version=3, consumed_delivery_ids=["d1", "d2"], counters={"x": 2.0}, epoch=4)
    tar = pack_checkpoint(uninterrupted, state)
    want = [uninterrupted.train_step(b, policy_version=1)["train/loss"] for b in batches[2:]]
    want_weights = uninterrupted.policy.adapter_state()

    torch.manual_seed(1234)  # the restore must overwrite whatever RNG state the new process has
    resumed = Learner(spec, settings(warmup_steps=5, lr=1e-2, seed=7))  # another init: the restore overwrites it
    restored = restore_checkpoint(resumed, tar)
    assert (restored.step, restored.policy_version, restored.epoch) == (2, 3, 4)
    assert restored.consumed_delivery_ids == ["d1", "d2"] and restored.counters == {"x": 2.0}
    got = [resumed.train_step(b, policy_version=1)["train/loss"] for b in batches[2:]]
    assert got == want  # bit-exact, not approximately
    for k, v in resumed.policy.adapter_state().items():
        assert torch.equal(v, want_weights[k]), k

    # The comparison is sensitive: restoring only the adapter (no optimizer, RNG, step) gives other weights.
    partial = Learner(spec, cfg)
    restore_checkpoint(partial, tar)
    partial.optimizer = torch.optim.AdamW(partial.params, lr=1e-2)
    partial.train_step(batches[2], policy_version=1)
    assert any(not torch.equal(v, want_weights[k]) for k, v in partial.policy.adapter_state().items())


def test_checkpoint_of_another_lora_shape_is_refused(tiny_model_dir: Path) -> None:
    tar = pack_checkpoint(Learner(tiny_spec(tiny_model_dir), settings()), TrainerState(step=0, policy_version=1))
    other = Learner(tiny_spec(tiny_model_dir, lora=LoraSpec(r=2, alpha=4.0)), settings())
    before = other.policy.adapter_state()
    with pytest.raises(ValueError, match="checkpoint was written for"):
        restore_checkpoint(other, tar)
    for k, v in other.policy.adapter_state().items():
        assert torch.equal(v, before[k]), "a refused checkpoint must change nothing"


def test_mismatch_is_measured_under_each_samples_own_version(tiny_model_dir: Path) -> None:
    spec = tiny_spec(tiny_model_dir)
    checked = Learner(spec, settings(lr=5e-2))
    unchecked = Learner(spec, settings(lr=5e-2, mismatch_max_samples=0))
    for learner in (checked, unchecked):
        learner.remember_version(1, learner.policy.adapter_snapshot())
    g1 = on_policy_group(checked, 0)  # behaviour logprobs under v1
    for learner in (checked, unchecked):
        learner.train_step([StepGroup(g1, 1, "gen-a")], policy_version=1)
        learner.remember_version(2, learner.policy.adapter_snapshot())
    g2 = on_policy_group(checked, 1)  # behaviour logprobs under v2
    step = [
        StepGroup(g1, 1, "gen-stale"),  # honest and one version behind: checked under v1's weights
        StepGroup(g2, 2, "gen-fresh"),  # on-policy: checked by the training forward
        StepGroup(g1, 2, "gen-liar"),  # claims v2 but sampled with v1 (an adapter that never loaded)
    ]
    stats = checked.train_step(step, policy_version=2)
    assert stats[MISMATCH_PREFIX + "gen-stale"] < 1e-5
    assert stats[MISMATCH_PREFIX + "gen-fresh"] < 1e-5
    assert stats[MISMATCH_PREFIX + "gen-liar"] > 1e-3, "a generator serving the wrong weights must show"
    assert abs(stats["ratio"] - 1.0) > 1e-4  # the policy moved: stale samples have ratio != 1
    plain = unchecked.train_step(step, policy_version=2)
    assert MISMATCH_PREFIX + "gen-stale" not in plain and MISMATCH_PREFIX + "gen-liar" in plain
    # The check swaps weights in and out: training is bit-for-bit unaffected.
    assert plain["train/loss"] == stats["train/loss"]
    for k, v in checked.policy.adapter_state().items():
        assert torch.equal(v, unchecked.policy.adapter_state()[k]), k
    assert checked.policy.model.training
    # Only max_staleness + 1 versions are kept.
    for v in range(3, 10):
        checked.remember_version(v, checked.policy.adapter_snapshot())
    assert list(checked.versions) == list(range(10 - spec.max_staleness - 1, 10))
