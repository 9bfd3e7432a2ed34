"""The loss's entropy bonus (``loss.entropy_coef``, verl's ``entropy_coeff``): its value and gradient against hand
computations, bit-identical to the loss without it at 0, and through the learner (the model's entropy carries grad)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from bucketrl.trainer.learner import Learner, StepGroup
from bucketrl.trainer.loss import LossBatch, finalize_stats, grpo_loss
from bucketrl.trainer.model import _entropy
from bucketrl.wire.rollouts import Completion, RolloutGroup
from bucketrl.wire.runs import LossSpec, SamplingSpec
from tests.trainer.helpers import settings, tiny_spec

NAN = math.nan


def _t(values: list, grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=grad)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_the_bonus_is_minus_coef_times_the_aggregated_entropy(aggregation: str) -> None:
    # On-policy (r = 1), so the policy term is -A per token: rows A = 1 and -2, trained lengths 2 and 1.
    x = _t([[0.0, -1.0, 0.0], [-0.5, 0.0, 0.0]], grad=True)
    h = _t([[0.5, 1.0, NAN], [2.0, NAN, NAN]], grad=True)  # nan where masked: must reach neither value nor grad
    mask = _t([[1, 1, 0], [1, 0, 0]])
    spec = LossSpec(entropy_coef=0.1, aggregation=aggregation)
    out = grpo_loss(LossBatch(x, x.detach().clone(), _t([1.0, -2.0]), mask, entropy=h), spec)
    out.loss.backward()
    if aggregation == "token":  # sum over the 3 trained tokens / 3
        want = (-1.0 - 1.0 + 2.0) / 3 - 0.1 * (0.5 + 1.0 + 2.0) / 3
        want_grad = [[-0.1 / 3, -0.1 / 3, 0.0], [-0.1 / 3, 0.0, 0.0]]
    else:  # per-row means, then their mean
        want = ((-1.0 - 0.1 * 0.75) + (2.0 - 0.1 * 2.0)) / 2
        want_grad = [[-0.1 / 4, -0.1 / 4, 0.0], [-0.1 / 2, 0.0, 0.0]]
    assert out.loss.item() == pytest.approx(want, rel=1e-12)
    assert torch.allclose(h.grad, _t(want_grad), rtol=1e-12, atol=0)
    assert finalize_stats([out])["entropy"] == pytest.approx(3.5 / 3)


def test_the_entropy_and_its_gradient_by_hand_under_temperature_and_top_k() -> None:
    # p = (0.2, 0.3, 0.5) at temperature 1; top_k 2 keeps (0.3, 0.5) -> (0.375, 0.625).
    z = _t([[math.log(0.2), math.log(0.3), math.log(0.5)]], grad=True)
    h = _entropy(z, (1.0, -1, 1.0))
    assert h.item() == pytest.approx(
        -sum(p * math.log(p) for p in (0.2, 0.3, 0.5)), rel=1e-6
    )  # process_logits works in float32
    h.sum().backward()
    # dH/dz_k = -p_k (log p_k + H)
    want = [-p * (math.log(p) + h.item()) for p in (0.2, 0.3, 0.5)]
    assert z.grad[0].tolist() == pytest.approx(want, rel=1e-5)

    z.grad = None
    h = _entropy(z, (1.0, 2, 1.0))
    kept = (0.375, 0.625)
    hk = -sum(p * math.log(p) for p in kept)
    assert h.item() == pytest.approx(hk, rel=1e-6)
    h.sum().backward()  # the removed token: p = 0, a gradient of 0 (not nan)
    assert z.grad[0].tolist() == pytest.approx([0.0, *(-p * (math.log(p) + hk) for p in kept)], rel=1e-5, abs=1e-7)

    z.grad = None
    h = _entropy(z, (2.0, -1, 1.0))  # temperature 2: softmax(z / 2)
    q = torch.softmax(z.detach()[0] / 2, -1).tolist()
    assert h.item() == pytest.approx(-sum(p * math.log(p) for p in q), rel=1e-6)


def test_at_zero_the_loss_and_gradient_are_bit_identical_to_the_loss_without_it() -> None:
    g = torch.Generator().manual_seed(5)
    behav = -torch.rand((4, 5), generator=g, dtype=torch.float64) * 2
    cur = behav + 0.5 * torch.randn((4, 5), generator=g, dtype=torch.float64)
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    mask = (torch.rand((4, 5), generator=g) > 0.3).double()
    ent = torch.rand((4, 5), generator=g, dtype=torch.float64, requires_grad=True)
    for aggregation in ("token", "sequence"):
        x0 = cur.clone().requires_grad_(True)
        before = grpo_loss(LossBatch(x0, behav, adv, mask), LossSpec(aggregation=aggregation))
        before.loss.backward()
        x1 = cur.clone().requires_grad_(True)
        now = grpo_loss(
            LossBatch(x1, behav, adv, mask, entropy=ent), LossSpec(aggregation=aggregation, entropy_coef=0.0)
        )
        now.loss.backward()
        assert torch.equal(now.loss, before.loss) and torch.equal(x1.grad, x0.grad)
        assert ent.grad is None  # nothing of the entropy enters the loss at 0


def test_a_detached_or_missing_entropy_is_refused_and_the_spec_bounds_the_coefficient() -> None:
    x = _t([[0.0, 0.0]], grad=True)
    for entropy in (None, _t([[1.0, 1.0]])):
        with pytest.raises(ValueError, match="entropy_coef > 0 needs the policy's per-token entropy with grad"):
            grpo_loss(LossBatch(x, x.detach(), _t([1.0]), _t([[1, 1]]), entropy=entropy), LossSpec(entropy_coef=0.1))
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        LossSpec(entropy_coef=-0.01)
    with pytest.raises(ValidationError, match="less than or equal to 1"):
        LossSpec(entropy_coef=2.0)


def test_through_the_learner_the_bonus_alone_raises_the_entropy(tiny_model_dir: Path) -> None:
    """Equal rewards: every advantage is 0, so without the bonus nothing moves; with it the policy's entropy over
    the trained tokens rises step by step (the model's entropy carries grad into the adapter)."""
    prompt = [5, 6, 7]
    comps = [Completion(token_ids=[9 + i, 12, 1], logprobs=[-4.0] * 3, reward=1.0) for i in range(4)]
    group = RolloutGroup(prompt_id="0-0", prompt_index=0, prompt_token_ids=prompt, completions=comps)
    still = Learner(tiny_spec(tiny_model_dir), settings())
    assert still.train_step([StepGroup(group, 1)], policy_version=1)["train/grad_norm"] == 0.0
    learner = Learner(
        tiny_spec(
            tiny_model_dir, loss=LossSpec(entropy_coef=0.5), sampling=SamplingSpec(temperature=0.1, max_new_tokens=8)
        ),
        settings(lr=1e-2),
    )
    seen = [learner.train_step([StepGroup(group, v)], policy_version=v)["entropy"] for v in range(1, 5)]
    assert all(b > a for a, b in itertools.pairwise(seen)), seen
