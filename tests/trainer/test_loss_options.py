"""Loss options and edge cases (issue 13): GSPO against the paper's formula, KL from temperature-only logprobs
under top-k sampling, truncated and aborted completions (tests/proxy/test_finish_reason.py: their plumbing)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from bucketrl.trainer.learner import Learner, StepGroup
from bucketrl.trainer.loss import LossBatch, finalize_stats, grpo_loss
from bucketrl.wire.rollouts import Completion, RolloutGroup
from bucketrl.wire.runs import LossSpec, SamplingSpec
from tests.trainer.helpers import settings, tiny_spec
from tests.trainer.test_model import perturb_adapter

PROMPT = [5, 6, 7]


# -- GSPO ---------------------------------------------------------------------------------------------------


Rows = list[list[float]]


def _paper_gspo(
    lp: Rows, behav: Rows, adv: list[float], mask: list[list[int]], eps_lo: float, eps_hi: float
) -> tuple[float, Rows]:
    """GSPO (Zheng et al. 2025, eq. 5-7), loop by loop: s_i = (prod_t pi/pi_old)^(1/|y_i|),
    J = 1/G sum_i min(s_i A_i, clip(s_i) A_i); loss = -J. Gradient (eq. 10): where the unclipped term is the
    minimum, d(-J)/d log pi(y_i,t) = -1/G * s_i * A_i / |y_i|; where the clipped constant is, 0."""
    g = len(lp)
    total = 0.0
    grad = [[0.0] * len(row) for row in lp]
    for i in range(g):
        toks = [t for t in range(len(lp[i])) if mask[i][t]]
        n = len(toks)
        s = math.exp(sum(lp[i][t] - behav[i][t] for t in toks) / n)
        clipped = min(max(s, 1 - eps_lo), 1 + eps_hi)
        unclipped_term, clipped_term = s * adv[i], clipped * adv[i]
        total += min(unclipped_term, clipped_term)
        if unclipped_term <= clipped_term:
            for t in toks:
                grad[i][t] = -s * adv[i] / n / g
    return -total / g, grad


def test_gspo_value_and_gradient_equal_the_papers_formula() -> None:
    rng = random.Random(3)
    b, t = 6, 5
    mask = [[1] * rng.randint(1, t) for _ in range(b)]
    mask = [row + [0] * (t - len(row)) for row in mask]
    behav = [[math.log(rng.uniform(0.05, 0.9)) for _ in range(t)] for _ in range(b)]
    # Moves of +-0.3 in log space: some sequences land outside the (narrow) band, some inside.
    lp_vals = [[behav[i][j] + rng.uniform(-0.3, 0.3) for j in range(t)] for i in range(b)]
    adv = [rng.choice([-1.0, 1.0]) * rng.uniform(0.2, 2.0) for _ in range(b)]
    spec = LossSpec(objective="gspo", epsilon_low=0.05, epsilon_high=0.08, aggregation="sequence")
    x = torch.tensor(lp_vals, dtype=torch.float64, requires_grad=True)
    behav_t, adv_t, mask_t = (torch.tensor(v, dtype=torch.float64) for v in (behav, adv, mask))
    out = grpo_loss(LossBatch(x, behav_t, adv_t, mask_t), spec)
    want_loss, want_grad = _paper_gspo(lp_vals, behav, adv, mask, 0.05, 0.08)
    assert out.loss.item() == pytest.approx(want_loss, rel=1e-12, abs=1e-12)
    out.loss.backward()
    assert x.grad is not None
    assert torch.allclose(x.grad, torch.tensor(want_grad, dtype=torch.float64), atol=1e-12)
    # Not vacuous: some sequences were clipped (zero gradient) and some not; token-level PPO differs.
    zero_rows = [i for i in range(b) if float(x.grad[i].abs().sum()) == 0.0]
    assert 0 < len(zero_rows) < b
    stats = finalize_stats([out])
    assert 0.0 < stats["clip_ratio/region_mean"] < 1.0
    assert "ratio/sequence" in stats
    ppo = grpo_loss(
        LossBatch(x.detach(), behav_t, adv_t, mask_t),
        LossSpec(objective="ppo_clip", epsilon_low=0.05, epsilon_high=0.08, aggregation="sequence"),
    )
    assert abs(ppo.loss.item() - want_loss) > 1e-4


def test_gspo_token_aggregation_weighs_each_sequence_by_its_length() -> None:
    behav = torch.tensor([[math.log(0.5)] * 3, [math.log(0.5)] * 3], dtype=torch.float64)
    x = behav.clone()  # on-policy: s_i = 1, loss_i = -A_i
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    token = grpo_loss(LossBatch(x, behav, adv, mask), LossSpec(objective="gspo")).loss.item()
    seq = grpo_loss(LossBatch(x, behav, adv, mask), LossSpec(objective="gspo", aggregation="sequence")).loss.item()
    assert token == pytest.approx((3 * -1.0 + 1 * 2.0) / 4)
    assert seq == pytest.approx((-1.0 + 2.0) / 2)


def test_a_gspo_step_trains_through_the_learner(tiny_model_dir: Path) -> None:
    learner = Learner(tiny_spec(tiny_model_dir, loss=LossSpec(objective="gspo")), settings())
    comps = [Completion(token_ids=[10 + i, 1], logprobs=[-4.0, -4.0], reward=float(i % 2)) for i in range(4)]
    group = RolloutGroup(prompt_id="0-0", prompt_index=0, prompt_token_ids=PROMPT, completions=comps)
    stats = learner.train_step([StepGroup(group, 1)], policy_version=1)
    assert stats["train/grad_norm"] > 0 and "ratio/sequence" in stats


# -- KL under top-k/top-p: temperature-only logprobs ----------------------------------------------------------


def _next_token_logprobs(learner: Learner, adapter: bool) -> torch.Tensor:
    model = learner.policy.model
    with torch.no_grad():
        if adapter:
            logits = model(input_ids=torch.tensor([PROMPT])).logits[0, -1]
        else:
            with model.disable_adapter():
                logits = model(input_ids=torch.tensor([PROMPT])).logits[0, -1]
    return torch.log_softmax(logits.double(), -1)


NUCLEI = {"top_k": SamplingSpec(temperature=1.0, top_k=1, max_new_tokens=8), "top_p": SamplingSpec(top_p=1e-6)}


@pytest.mark.parametrize("nucleus", sorted(NUCLEI))
@pytest.mark.parametrize("outside", ["policy", "reference"])
def test_kl_with_top_k_or_top_p_is_finite_and_uses_temperature_only_logprobs(
    tiny_model_dir: Path, outside: str, nucleus: str
) -> None:
    """top_k=1 (or a top_p so small that only the most likely token is kept): only each model's argmax is inside
    its nucleus. A sampled token that is the reference's argmax but not the policy's (outside the policy's
    nucleus) made the k3 term infinite and the step was skipped; one that is the policy's argmax but not the
    reference's gave a per-token KL near 1e4."""
    spec = tiny_spec(tiny_model_dir, sampling=NUCLEI[nucleus])
    spec = spec.model_copy(update={"loss": LossSpec(kl_coef=0.1)})
    learner = Learner(spec, settings())
    for seed in range(1, 20):  # an adapter whose argmax after PROMPT differs from the base model's
        perturb_adapter(learner.policy, seed=seed, scale=2.0)
        pol, ref = _next_token_logprobs(learner, True), _next_token_logprobs(learner, False)
        if int(pol.argmax()) != int(ref.argmax()):
            break
    else:
        pytest.fail("no perturbation moved the argmax")
    token = int(ref.argmax()) if outside == "policy" else int(pol.argmax())
    # Behaviour logprob of a top_k=1 sample is log 1 = 0; two completions so the group has variance.
    comps = [Completion(token_ids=[token], logprobs=[0.0], reward=r) for r in (1.0, 0.0)]
    group = RolloutGroup(prompt_id="0-0", prompt_index=0, prompt_token_ids=PROMPT, completions=comps)
    stats = learner.train_step([StepGroup(group, 1)], policy_version=1)
    assert "train/skipped" not in stats
    delta = float(ref[token] - pol[token])
    want = math.exp(delta) - delta - 1.0  # k3 over the full temperature-1 distributions
    assert 0.0 < want < 50.0
    assert stats["kl"] == pytest.approx(want, rel=1e-3)
    assert math.isfinite(stats["train/loss"]) and stats["train/grad_norm"] > 0


def test_kl_logprobs_equal_the_processed_ones_without_truncation(tiny_model_dir: Path) -> None:
    """Plain temperature sampling: the KL's logprobs are the ratio's (no second pass, same values)."""
    spec = tiny_spec(tiny_model_dir, sampling=SamplingSpec(temperature=0.7, max_new_tokens=8))
    learner = Learner(spec, settings())
    from bucketrl.trainer.batching import collate, group_samples

    group = RolloutGroup(
        prompt_id="0-0",
        prompt_index=0,
        prompt_token_ids=PROMPT,
        completions=[Completion(token_ids=[9, 12, 1], logprobs=[-1.0] * 3, reward=1.0)],
    )
    mb = collate(group_samples(group, [1.0], [True], version=1, worker_id="w", eos_token_ids={1}), 0)
    out = learner.policy.forward_logprobs(mb, with_kl=True)
    assert out.kl_logprobs is out.logprobs


# -- truncated and aborted completions ---------------------------------------------------------------------


def _group(reasons: list[str], rewards: list[float]) -> RolloutGroup:
    comps = [
        Completion(token_ids=[10 + i, 11, 12], logprobs=[-4.0] * 3, reward=r, finish_reason=f)  # type: ignore[arg-type]
        for i, (f, r) in enumerate(zip(reasons, rewards, strict=True))
    ]
    return RolloutGroup(prompt_id="0-0", prompt_index=0, prompt_token_ids=PROMPT, completions=comps)


def test_aborted_completions_are_never_trained_nor_enter_the_group_statistics(tiny_model_dir: Path) -> None:
    learner = Learner(tiny_spec(tiny_model_dir), settings())
    group = _group(["stop", "stop", "abort", "stop"], [1.0, 0.0, 5.0, 0.0])
    samples, stats = learner.build_samples([StepGroup(group, 1)])
    assert [s.completion_ids[0] for s in samples] == [10, 11, 13]
    assert stats["reward"] == pytest.approx(1 / 3)  # the aborted 5.0 is not in the mean
    assert stats["sample/aborted"] == 1.0 and stats["sample/unscorable"] == 0.0
    # The advantages are those of the three finished completions alone.
    mean, std = 1 / 3, math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    assert samples[0].advantage == pytest.approx((1.0 - mean) / (std + 1e-4))


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_mask_truncated_completions(tiny_model_dir: Path, mask_truncated: bool) -> None:
    learner = Learner(tiny_spec(tiny_model_dir, loss=LossSpec(mask_truncated_completions=mask_truncated)), settings())
    group = _group(["stop", "length", "stop", "length"], [1.0, 1.0, 0.0, 0.0])
    samples, stats = learner.build_samples([StepGroup(group, 1)])
    trained = [s.completion_ids[0] for s in samples]
    assert trained == ([10, 12] if mask_truncated else [10, 11, 12, 13])
    # Truncated completions stay in the group's statistics either way (TRL: only their mask is zeroed).
    assert stats["reward"] == pytest.approx(0.5)
    assert samples[0].advantage == pytest.approx(0.5 / (math.sqrt(1 / 3) + 1e-4))
    assert stats["completions/clipped_ratio"] == pytest.approx(0.5)
    assert stats["completions/mean_length"] == pytest.approx(3.0)
