"""Shared builders for trainer tests: a run spec on the tiny model, random groups, settings."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from bucketrl.trainer.settings import TrainerSettings
from bucketrl.wire.rollouts import Completion, RolloutGroup
from bucketrl.wire.runs import DatasetSpec, LoraSpec, LossSpec, RewardSpec, RunSpec, SamplingSpec

EOS = 1


def tiny_spec(model_dir: Path, **overrides: Any) -> RunSpec:
    fields: dict[str, Any] = {
        "base_model": str(model_dir),
        "lora": LoraSpec(r=4, alpha=8.0),
        "group_size": 4,
        "max_staleness": 4,
        "sampling": SamplingSpec(temperature=1.0, max_new_tokens=8),
        "reward": RewardSpec(name="toy"),
        "dataset": DatasetSpec(uri="toy:test", size=16),
        "vocab_size": 64,
        "queue_capacity_groups": 64,
        "groups_per_step": 2,
        "loss": LossSpec(),
    }
    fields.update(overrides)
    return RunSpec(**fields)


def settings(**overrides: Any) -> TrainerSettings:
    base: dict[str, Any] = {"device": "cpu", "lr": 1e-2, "seed": 0, "micro_token_budget": 64}
    base.update(overrides)
    return TrainerSettings(**base)


def random_group(rng: random.Random, *, index: int = 0, group_size: int = 4, reward_fn=None) -> RolloutGroup:
    """A plausible group: random prompt/completions (tokens 3..63), behaviour logprobs near -log(64)."""
    prompt = [rng.randrange(3, 64) for _ in range(rng.randint(2, 6))]
    completions = []
    for _ in range(group_size):
        n = rng.randint(1, 8)
        tokens = [rng.randrange(3, 64) for _ in range(n)]
        if rng.random() < 0.5:
            tokens[-1] = EOS
        reward = reward_fn(tokens) if reward_fn else float(rng.random() < 0.5)
        completions.append(
            Completion(token_ids=tokens, logprobs=[-4.1 - 0.1 * rng.random() for _ in tokens], reward=reward)
        )
    return RolloutGroup(prompt_id=f"0-{index}", prompt_index=index, prompt_token_ids=prompt, completions=completions)
