"""Group-relative advantages (docs/design.md section 5): ``A_i = r_i - mean(r)``, optionally ``/ (std(r) + eps)``.

Unscorable completions (``reward is None``: the reward function raised or timed out) are EXCLUDED from
their group: they do not enter the group's mean and std and they are not trained on (weight 0). Why not
score them 0: a reward that fails is an infrastructure problem, not evidence about the completion, and a 0
would push the policy away from whatever the reward function chokes on (often long or unusual answers)
while pulling the rest of the group up. Excluding them keeps the estimator unbiased for the completions
that were actually judged; the count is reported (``sample/unscorable``).

A group whose scorable rewards all agree (or that has fewer than two scorable completions) carries no
signal: every advantage is 0. Such groups are counted (``sample/zero_variance_groups``); with
``filter_zero_variance`` they are dropped from the step, otherwise they stay in the token normaliser
(TRL's behaviour) and contribute no gradient.

``std`` is the unbiased (n - 1) standard deviation, as in TRL.

``scale_rewards="none"`` is Dr.GRPO's advantage (Liu et al. 2025, "Understanding R1-Zero-Like Training"):
``A_i = R_i - mean(R)``. Dividing by the std weighs a group by the inverse of its reward spread, so prompts
almost always solved (or almost never) get the largest steps: the paper's question-level difficulty bias.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Added to the std before dividing so near-constant groups do not explode (TRL uses 1e-4).
STD_EPS = 1e-4
# Rewards closer than this count as equal for the zero-variance test.
ZERO_VARIANCE_TOL = 1e-8


@dataclass(frozen=True)
class GroupAdvantages:
    """Per completion of one group: its advantage and whether it is trained on."""

    advantages: list[float]
    trainable: list[bool]
    zero_variance: bool
    unscorable: int
    # Mean and std (n - 1) of the scorable rewards; None when no completion was scorable.
    reward_mean: float | None
    reward_std: float | None


def group_advantages(
    rewards: list[float | None], *, scale_rewards: str = "group", filter_zero_variance: bool = False
) -> GroupAdvantages:
    """Advantages of one group's completions; see the module docstring for the policy on None and ties."""
    if scale_rewards not in ("group", "none"):
        raise ValueError(f"scale_rewards must be 'group' or 'none', not {scale_rewards!r}")
    scored = [r for r in rewards if r is not None]
    unscorable = len(rewards) - len(scored)
    if not scored:
        return GroupAdvantages([0.0] * len(rewards), [False] * len(rewards), True, unscorable, None, None)
    mean = sum(scored) / len(scored)
    std = math.sqrt(sum((r - mean) ** 2 for r in scored) / (len(scored) - 1)) if len(scored) > 1 else 0.0
    zero_variance = len(scored) < 2 or max(scored) - min(scored) <= ZERO_VARIANCE_TOL
    advantages: list[float] = []
    trainable: list[bool] = []
    for r in rewards:
        if r is None or zero_variance:
            advantages.append(0.0)
        else:
            a = r - mean
            advantages.append(a / (std + STD_EPS) if scale_rewards == "group" else a)
        trainable.append(r is not None and not (zero_variance and filter_zero_variance))
    return GroupAdvantages(advantages, trainable, zero_variance, unscorable, mean, std)
