"""The GRPO loss against hand-computed values and against autograd of a direct, loop-by-loop formula."""

from __future__ import annotations

import math

import pytest
import torch

from bucketrl.trainer.loss import LossBatch, finalize_stats, grpo_loss
from bucketrl.wire.runs import LossSpec

LN = math.log


def lp(values: list[list[float]], grad: bool = True) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=grad)


def t(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_on_policy_token_loss_is_minus_mean_advantage_and_gradient_is_minus_a_over_n() -> None:
    x = lp([[LN(0.5), LN(0.25)]])
    out = grpo_loss(LossBatch(x, x.detach().clone(), t([2.0]), t([[1, 1]])), LossSpec())
    assert out.loss.item() == pytest.approx(-2.0)
    out.loss.backward()
    # d/dlp of -(r * A) / N with r = exp(lp - behav) = 1: -A / N = -1.
    assert x.grad[0].tolist() == pytest.approx([-1.0, -1.0])
    stats = finalize_stats([out])
    assert stats["ratio"] == pytest.approx(1.0)
    assert stats["clip_ratio/region_mean"] == 0.0


def test_clipping_high_side_for_positive_advantage() -> None:
    behav = t([[LN(0.2), LN(0.2)]])
    # Token 0: ratio 1.5 > 1.28 with A > 0 -> clipped, no gradient. Token 1: ratio 1.1 -> not clipped.
    x = lp([[LN(0.3), LN(0.22)]])
    out = grpo_loss(LossBatch(x, behav, t([1.0]), t([[1, 1]])), LossSpec(epsilon_low=0.2, epsilon_high=0.28))
    assert out.loss.item() == pytest.approx((-1.28 - 1.1) / 2)
    out.loss.backward()
    assert x.grad[0, 0].item() == 0.0
    assert x.grad[0, 1].item() == pytest.approx(-1.1 / 2)
    stats = finalize_stats([out])
    assert stats["clip_ratio/high_mean"] == pytest.approx(0.5)
    assert stats["clip_ratio/low_mean"] == 0.0
    assert stats["clip_ratio/region_mean"] == pytest.approx(0.5)
    assert stats["ratio"] == pytest.approx((1.5 + 1.1) / 2)


def test_clipping_low_side_for_negative_advantage() -> None:
    behav = t([[LN(0.4), LN(0.4)]])
    # Token 0: ratio 0.5 < 0.8 with A < 0 -> -min(0.5 * -1, 0.8 * -1) = 0.8, clipped (no gradient).
    # Token 1: ratio 1.5 with A < 0 -> -min(-1.5, -1.28) = 1.5, NOT clipped (the objective is pessimistic).
    x = lp([[LN(0.2), LN(0.6)]])
    out = grpo_loss(LossBatch(x, behav, t([-1.0]), t([[1, 1]])), LossSpec(epsilon_low=0.2, epsilon_high=0.28))
    assert out.loss.item() == pytest.approx((0.8 + 1.5) / 2)
    out.loss.backward()
    assert x.grad[0, 0].item() == 0.0
    assert x.grad[0, 1].item() == pytest.approx(1.5 / 2)
    stats = finalize_stats([out])
    assert stats["clip_ratio/low_mean"] == pytest.approx(0.5)
    assert stats["clip_ratio/high_mean"] == 0.0


def test_positive_advantage_below_the_band_is_not_clipped() -> None:
    behav = t([[LN(0.4)]])
    x = lp([[LN(0.2)]])  # ratio 0.5, A > 0: min(0.5 A, 0.8 A) = 0.5 A, gradient flows
    out = grpo_loss(LossBatch(x, behav, t([2.0]), t([[1]])), LossSpec())
    assert out.loss.item() == pytest.approx(-1.0)
    out.loss.backward()
    assert x.grad.item() == pytest.approx(-1.0)
    assert finalize_stats([out])["clip_ratio/region_mean"] == 0.0


def test_decoupled_importance_weight_is_truncated_at_cap_and_detached() -> None:
    behav = t([[LN(0.1), LN(0.4)]])
    prox = t([[LN(0.3), LN(0.2)]])  # pi_prox / pi_behav = 3 (-> capped at 2) and 0.5
    x = lp([[LN(0.3), LN(0.2)]])  # pi_theta == pi_prox: r = 1
    spec = LossSpec(objective="decoupled", is_cap=2.0)
    out = grpo_loss(LossBatch(x, behav, t([1.0]), t([[1, 1]]), proximal_logprobs=prox), spec)
    assert out.loss.item() == pytest.approx((-2.0 - 0.5) / 2)
    out.loss.backward()
    # Gradient of -w * r * A / N w.r.t. lp: -w * A / N (w a constant).
    assert x.grad[0].tolist() == pytest.approx([-1.0, -0.25])
    stats = finalize_stats([out])
    assert stats["is_weight_mean"] == pytest.approx(1.25)
    assert stats["is_weight_truncated_frac"] == pytest.approx(0.5)
    assert stats["ratio/proximal"] == pytest.approx(1.0)
    assert stats["ratio"] == pytest.approx((3.0 + 0.5) / 2)  # pi_theta / pi_behav


def test_decoupled_clips_against_the_proximal_policy_not_the_behaviour_one() -> None:
    behav = t([[LN(0.1)]])
    prox = t([[LN(0.2)]])
    x = lp([[LN(0.3)]])  # r = pi_theta/pi_prox = 1.5 > 1.28 -> clipped; w = 2 (exactly the cap)
    out = grpo_loss(
        LossBatch(x, behav, t([1.0]), t([[1]]), proximal_logprobs=prox), LossSpec(objective="decoupled", is_cap=2.0)
    )
    assert out.loss.item() == pytest.approx(-2.0 * 1.28)
    out.loss.backward()
    assert x.grad.item() == 0.0


def test_token_vs_sequence_aggregation() -> None:
    # Sequence 0 has 3 tokens, sequence 1 has 1 (plus a padded column). On policy: per-token loss = -A.
    x = lp([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    adv = t([1.0, 3.0])
    token = grpo_loss(LossBatch(x, x.detach().clone(), adv, mask), LossSpec(aggregation="token"))
    assert token.loss.item() == pytest.approx(-(3 * 1.0 + 1 * 3.0) / 4)
    seq = grpo_loss(LossBatch(x, x.detach().clone(), adv, mask), LossSpec(aggregation="sequence"))
    assert seq.loss.item() == pytest.approx(-(1.0 + 3.0) / 2)
    seq.loss.backward()
    # Each token of sequence 0 carries 1/3 of its sequence's weight; sequence 1's single token all of it.
    assert x.grad.flatten().tolist() == pytest.approx([-1 / 6, -1 / 6, -1 / 6, -3 / 2, 0.0, 0.0])


@pytest.mark.parametrize("objective", ["ppo_clip", "decoupled"])
def test_padding_and_after_eos_positions_change_nothing_even_when_garbage(objective: str) -> None:
    spec = LossSpec(objective=objective, kl_coef=0.1)
    clean = lp([[LN(0.5), LN(0.5)]])
    base = grpo_loss(
        LossBatch(
            clean,
            t([[LN(0.4), LN(0.6)]]),
            t([1.0]),
            t([[1, 1]]),
            proximal_logprobs=t([[LN(0.45), LN(0.5)]]),
            ref_logprobs=t([[LN(0.4), LN(0.6)]]),
        ),
        spec,
    )
    # The same sequence plus two masked columns holding -inf / huge values (after-EOS tokens, padding).
    dirty = lp([[LN(0.5), LN(0.5), -math.inf, 50.0]])
    out = grpo_loss(
        LossBatch(
            dirty,
            t([[LN(0.4), LN(0.6), -1e30, -math.inf]]),
            t([1.0]),
            t([[1, 1, 0, 0]]),
            proximal_logprobs=t([[LN(0.45), LN(0.5), 90.0, -math.inf]]),
            ref_logprobs=t([[LN(0.4), LN(0.6), math.inf, -1e9]]),
        ),
        spec,
    )
    assert out.loss.item() == pytest.approx(base.loss.item())
    out.loss.backward()
    base.loss.backward()
    assert dirty.grad[0, 2:].tolist() == [0.0, 0.0]
    assert dirty.grad[0, :2].tolist() == pytest.approx(clean.grad[0].tolist())
    stats = finalize_stats([out])
    assert all(math.isfinite(v) for v in stats.values())
    assert stats == pytest.approx(finalize_stats([base]))


def test_kl_k3_estimator_value_and_gradient() -> None:
    x = lp([[LN(0.5)]])
    ref = t([[LN(0.25)]])
    out = grpo_loss(LossBatch(x, x.detach().clone(), t([0.0]), t([[1]]), ref_logprobs=ref), LossSpec(kl_coef=0.5))
    d = LN(0.25) - LN(0.5)
    k3 = math.exp(d) - d - 1.0  # 0.5 + ln 2 - 1
    assert out.loss.item() == pytest.approx(0.5 * k3)
    assert finalize_stats([out])["kl"] == pytest.approx(k3)
    out.loss.backward()
    # d k3 / d lp = -exp(d) + 1
    assert x.grad.item() == pytest.approx(0.5 * (1.0 - math.exp(d)))


def direct_loss(lp_, behav, prox, adv, mask, ref, spec: LossSpec) -> torch.Tensor:
    """The objective written out token by token, independent of the implementation's vectorisation."""
    b_, t_ = lp_.shape
    seq_terms = []
    token_terms = []
    for i in range(b_):
        terms = []
        for j in range(t_):
            if mask[i, j] == 0:
                continue
            a = adv[i]
            if spec.objective == "ppo_clip":
                r = torch.exp(lp_[i, j] - behav[i, j])
                w = 1.0
            else:
                r = torch.exp(lp_[i, j] - prox[i, j])
                w = min(math.exp(float(prox[i, j] - behav[i, j])), spec.is_cap)
            rc = torch.clamp(r, 1 - spec.epsilon_low, 1 + spec.epsilon_high)
            term = -w * torch.minimum(r * a, rc * a)
            if spec.kl_coef:
                d = ref[i, j] - lp_[i, j]
                term = term + spec.kl_coef * (torch.exp(d) - d - 1)
            terms.append(term)
        token_terms += terms
        seq_terms.append(sum(terms) / len(terms))
    if spec.aggregation == "token":
        return sum(token_terms) / len(token_terms)
    return sum(seq_terms) / len(seq_terms)


@pytest.mark.parametrize("objective", ["ppo_clip", "decoupled"])
@pytest.mark.parametrize("aggregation", ["token", "sequence"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_gradient_equals_autograd_of_the_direct_formula(objective: str, aggregation: str, kl_coef: float) -> None:
    g = torch.Generator().manual_seed(7)
    shape = (8, 7)
    behav = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    # Large perturbations so both clip sides and the IS cap are exercised.
    cur = (behav + torch.randn(shape, generator=g, dtype=torch.float64) * 0.8).clamp(max=0.0)
    prox = (behav + torch.randn(shape, generator=g, dtype=torch.float64) * 0.8).clamp(max=0.0)
    ref = (behav + torch.randn(shape, generator=g, dtype=torch.float64) * 0.3).clamp(max=0.0)
    adv = torch.randn(shape[0], generator=g, dtype=torch.float64)
    lengths = [7, 3, 5, 1, 6, 7, 2, 4]
    mask = torch.tensor([[1.0 if j < n else 0.0 for j in range(shape[1])] for n in lengths], dtype=torch.float64)
    spec = LossSpec(objective=objective, aggregation=aggregation, kl_coef=kl_coef, is_cap=1.5)

    x1 = cur.clone().requires_grad_(True)
    out = grpo_loss(LossBatch(x1, behav, adv, mask, proximal_logprobs=prox, ref_logprobs=ref), spec)
    out.loss.backward()
    x2 = cur.clone().requires_grad_(True)
    want = direct_loss(x2, behav, prox, adv, mask, ref, spec)
    want.backward()
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-10)
    assert torch.allclose(x1.grad, x2.grad, atol=1e-12)
    low = finalize_stats([out])["clip_ratio/low_mean"]
    high = finalize_stats([out])["clip_ratio/high_mean"]
    if objective == "ppo_clip":
        assert low > 0 and high > 0, "the random case must exercise both clip sides"


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_micro_batches_with_step_normalisers_equal_the_whole_batch(aggregation: str) -> None:
    g = torch.Generator().manual_seed(3)
    behav = -torch.rand((6, 4), generator=g, dtype=torch.float64)
    cur = behav + 0.3 * torch.randn((6, 4), generator=g, dtype=torch.float64)
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    mask = torch.tensor(
        [[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float64
    )
    spec = LossSpec(aggregation=aggregation)
    whole_x = cur.clone().requires_grad_(True)
    whole = grpo_loss(LossBatch(whole_x, behav, adv, mask), spec)
    whole.loss.backward()
    parts_x = cur.clone().requires_grad_(True)
    total = 0.0
    outs = []
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        o = grpo_loss(
            LossBatch(parts_x[rows], behav[rows], adv[rows], mask[rows]),
            spec,
            token_normalizer=float(mask.sum()),
            sequence_normalizer=6.0,
        )
        o.loss.backward()
        total += o.loss.item()
        outs.append(o)
    assert total == pytest.approx(whole.loss.item(), rel=1e-12)
    assert torch.allclose(parts_x.grad, whole_x.grad, atol=1e-14)
    assert finalize_stats(outs)["ratio"] == pytest.approx(finalize_stats([whole])["ratio"])


def test_entropy_stat_is_a_masked_mean() -> None:
    x = lp([[0.0, 0.0, 0.0]])
    out = grpo_loss(
        LossBatch(x, x.detach().clone(), t([1.0]), t([[1, 1, 0]]), entropy=t([[1.0, 2.0, math.nan]])), LossSpec()
    )
    assert finalize_stats([out])["entropy"] == pytest.approx(1.5)


def test_bad_batches_are_refused_with_a_clear_error() -> None:
    x = lp([[0.0, 0.0]])
    with pytest.raises(ValueError, match="proximal_logprobs"):
        grpo_loss(LossBatch(x, x.detach(), t([1.0]), t([[1, 1]])), LossSpec(objective="decoupled"))
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(LossBatch(x, x.detach(), t([1.0]), t([[1, 1]])), LossSpec(kl_coef=0.1))
    with pytest.raises(ValueError, match="shape mismatch"):
        grpo_loss(LossBatch(x, t([[0.0]]), t([1.0]), t([[1, 1]])), LossSpec())
