"""Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective", arXiv 2503.20783)
against the paper's formulas, on hand-computed tensors: advantages ``R_i - mean(R)`` with no std, and the loss
``-1/(G * C) * sum_i sum_t min(r A_i, clip(r) A_i)`` with a CONSTANT ``C`` (the generation budget: TRL's
``max_completion_length``, oat's ``generate_max_length``) where GRPO divides each sequence by its own ``|o_i|``.
Then the run-spec fields (``aggregation: constant``, ``constant_normalizer``) and the refusals (TRL's
``loss_type`` among them), through ``bucketrl up`` as a user meets them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from bucketrl.trainer.advantages import STD_EPS, group_advantages
from bucketrl.trainer.batching import collate, group_samples
from bucketrl.trainer.learner import Learner, StepGroup
from bucketrl.trainer.loss import LossBatch, grpo_loss
from bucketrl.wire.rollouts import Completion, RolloutGroup
from bucketrl.wire.runs import EnvSpec, EpisodeSpec, LossSpec, RunSpec, SamplingSpec
from tests.trainer.helpers import settings, tiny_spec

ROOT = Path(__file__).resolve().parents[2]


def dr(c: int = 4, **kw: object) -> LossSpec:
    return LossSpec(aggregation="constant", constant_normalizer=c, **kw)


def t(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# -- advantages: centred, not scaled ------------------------------------------------------------------------


def test_dr_grpo_advantages_are_the_reward_minus_the_group_mean() -> None:
    """One right answer in four: Dr.GRPO's A = R - mean = [0.75, -0.25, -0.25, -0.25]. GRPO divides by the
    (n - 1) std, sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5, doubling every advantage; with two right answers the
    std is 0.577, so a group's scale depends on how hard its prompt is (the paper's difficulty bias)."""
    one = group_advantages([1.0, 0.0, 0.0, 0.0], scale_rewards="none")
    assert one.advantages == pytest.approx([0.75, -0.25, -0.25, -0.25], abs=1e-15)
    scaled = group_advantages([1.0, 0.0, 0.0, 0.0], scale_rewards="group")
    assert scaled.advantages == pytest.approx([a / (0.5 + STD_EPS) for a in one.advantages], rel=1e-12)
    two = group_advantages([1.0, 1.0, 0.0, 0.0], scale_rewards="none")
    assert two.advantages == pytest.approx([0.5, 0.5, -0.5, -0.5], abs=1e-15)
    # Scaled, the two groups' right answers get 1.5 and 0.866: the std, not the reward, sets the step.
    assert group_advantages([1.0, 1.0, 0.0, 0.0]).advantages[0] == pytest.approx(0.5 / math.sqrt(1 / 3), rel=1e-3)
    # Unscorable completions stay out of the mean without std scaling too: mean of [2, 0] is 1.
    partial = group_advantages([2.0, None, 0.0], scale_rewards="none")
    assert partial.advantages == [1.0, 0.0, -1.0] and partial.trainable == [True, False, True]


# -- the loss: sum over tokens / (sequences * constant) --------------------------------------------------------


def test_constant_aggregation_is_the_token_sum_over_sequences_times_the_constant() -> None:
    # Sequence 0 has 3 tokens, sequence 1 has 1 (plus padding). On policy: per-token loss = -A.
    x = torch.zeros((2, 3), dtype=torch.float64, requires_grad=True)
    mask = t([[1, 1, 1], [1, 0, 0]])
    out = grpo_loss(LossBatch(x, x.detach().clone(), t([1.0, 3.0]), mask), dr(c=4))
    assert out.loss.item() == pytest.approx(-(3 * 1.0 + 1 * 3.0) / (2 * 4))
    out.loss.backward()
    # Every token gets -A_i / (G * C), whatever its sequence's length: sequence aggregation would give
    # -A_i / (G * |o_i|) = [-1/6, -1/6, -1/6] and [-3/2]; token aggregation -A_i / 4.
    assert x.grad.flatten().tolist() == pytest.approx([-1 / 8, -1 / 8, -1 / 8, -3 / 8, 0.0, 0.0], abs=1e-15)


def test_a_tokens_gradient_is_independent_of_every_sequences_length_and_the_padding() -> None:
    """Lengthening sequence 0, or sequence 1, or padding the batch wider changes no other token's gradient: the
    step per token is A_i / (G * C). Under sequence (or token) aggregation each of these changes it."""

    def grads(lengths: list[int], width: int, aggregation: str) -> list[list[float]]:
        x = torch.zeros((2, width), dtype=torch.float64, requires_grad=True)
        mask = t([[1.0 if j < n else 0.0 for j in range(width)] for n in lengths])
        spec = dr(c=16) if aggregation == "constant" else LossSpec(aggregation=aggregation)
        grpo_loss(LossBatch(x, x.detach().clone(), t([1.0, -1.0]), mask), spec).loss.backward()
        return [
            [g for g, m in zip(row, mrow, strict=True) if m] for row, mrow in zip(x.grad.tolist(), mask, strict=True)
        ]

    base = grads([2, 5], 5, "constant")
    assert base == [[-1 / 32] * 2, [1 / 32] * 5]
    assert grads([7, 5], 7, "constant") == [[-1 / 32] * 7, [1 / 32] * 5]  # sequence 0 longer
    assert grads([2, 1], 9, "constant") == [[-1 / 32] * 2, [1 / 32]]  # sequence 1 shorter, wider padding
    for aggregation in ("sequence", "token"):  # the biases Dr.GRPO removes: each moves a token's gradient
        assert grads([2, 5], 5, aggregation)[0][0] != grads([7, 5], 7, aggregation)[0][0]


def _paper_dr_grpo(lp, behav, prox, adv, mask, spec: LossSpec, ref) -> torch.Tensor:
    """The objective loop by loop: -1/(G * C) sum_i sum_{t <= |o_i|} [w min(r A_i, clip(r) A_i) - beta k3]."""
    g = lp.shape[0]
    total = torch.zeros((), dtype=torch.float64)
    for i in range(g):
        for j in range(lp.shape[1]):
            if not mask[i, j]:
                continue
            if spec.objective == "ppo_clip":
                r, w = torch.exp(lp[i, j] - behav[i, j]), 1.0
            else:  # decoupled: the ratio against the proximal policy, the truncated IS weight detached
                r, w = torch.exp(lp[i, j] - prox[i, j]), min(math.exp(float(prox[i, j] - behav[i, j])), spec.is_cap)
            rc = torch.clamp(r, 1 - spec.epsilon_low, 1 + spec.epsilon_high)
            term = -w * torch.minimum(r * adv[i], rc * adv[i])
            d = ref[i, j] - lp[i, j]
            total = total + term + spec.kl_coef * (torch.exp(d) - d - 1)
    assert spec.constant_normalizer is not None
    return total / (g * spec.constant_normalizer)


@pytest.mark.parametrize("objective", ["ppo_clip", "decoupled"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_value_and_gradient_equal_the_papers_formula_with_clipping(objective: str, kl_coef: float) -> None:
    g = torch.Generator().manual_seed(11)
    shape = (8, 7)
    behav = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    cur = (behav + torch.randn(shape, generator=g, dtype=torch.float64) * 0.8).clamp(max=0.0)
    prox = (behav + torch.randn(shape, generator=g, dtype=torch.float64) * 0.8).clamp(max=0.0)
    ref = (behav + torch.randn(shape, generator=g, dtype=torch.float64) * 0.3).clamp(max=0.0)
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    adv = t(group_advantages(rewards, scale_rewards="none").advantages)
    lengths = [7, 3, 5, 1, 6, 7, 2, 4]
    mask = t([[1.0 if j < n else 0.0 for j in range(shape[1])] for n in lengths])
    spec = dr(c=10, objective=objective, kl_coef=kl_coef, is_cap=1.5)
    x1 = cur.clone().requires_grad_(True)
    out = grpo_loss(LossBatch(x1, behav, adv, mask, proximal_logprobs=prox, ref_logprobs=ref), spec)
    out.loss.backward()
    x2 = cur.clone().requires_grad_(True)
    want = _paper_dr_grpo(x2, behav, prox, adv, mask, spec, ref)
    want.backward()
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert torch.allclose(x1.grad, x2.grad, atol=1e-14)
    assert float(x1.grad.abs().sum()) > 0


def test_micro_batches_with_the_steps_sequence_count_equal_the_whole_batch() -> None:
    g = torch.Generator().manual_seed(5)
    behav = -torch.rand((6, 4), generator=g, dtype=torch.float64)
    cur = behav + 0.3 * torch.randn((6, 4), generator=g, dtype=torch.float64)
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    mask = t([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    whole_x = cur.clone().requires_grad_(True)
    whole = grpo_loss(LossBatch(whole_x, behav, adv, mask), dr(c=4))
    whole.loss.backward()
    parts_x = cur.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        o = grpo_loss(LossBatch(parts_x[rows], behav[rows], adv[rows], mask[rows]), dr(c=4), sequence_normalizer=6.0)
        o.loss.backward()
        total += o.loss.item()
    assert total == pytest.approx(whole.loss.item(), rel=1e-12)
    assert torch.allclose(parts_x.grad, whole_x.grad, atol=1e-15)


def test_constant_aggregation_without_its_constant_is_refused() -> None:
    x = torch.zeros((1, 2), dtype=torch.float64)
    with pytest.raises(ValueError, match="constant_normalizer"):
        grpo_loss(LossBatch(x, x, t([1.0]), t([[1, 1]])), LossSpec(aggregation="constant"))


# -- through the learner: the spec's budget and centred advantages reach the loss -----------------------------


def test_a_learner_step_is_the_dr_grpo_loss_of_its_group(tiny_model_dir: Path) -> None:
    """Four on-policy completions of 1..4 tokens, rewards [1, 0, 0, 0]: A = [0.75, -0.25, -0.25, -0.25] and the
    loss is -sum_i A_i |o_i| / (G * max_new_tokens) = 1.5 / (4 * 8). With the std it would be twice that, with
    token aggregation 1.5 / 10 and with sequence aggregation 0."""
    spec = tiny_spec(tiny_model_dir, loss=LossSpec(objective="decoupled", aggregation="constant", scale_rewards="none"))
    assert spec.sampling.max_new_tokens == 8 and spec.loss.constant_normalizer == 8  # filled from the budget
    learner = Learner(spec, settings())
    comps = [
        Completion(token_ids=[10 + k for k in range(n)], logprobs=[0.0] * n, reward=float(n == 1)) for n in (1, 2, 3, 4)
    ]
    group = RolloutGroup(prompt_id="0-0", prompt_index=0, prompt_token_ids=[5, 6, 7], completions=comps)
    mb = collate(group_samples(group, [0.0] * 4, [True] * 4, version=1, worker_id="w", eos_token_ids=set()), 0)
    with torch.no_grad():
        lp, _ = learner.policy.token_logprobs(mb)
    for i, comp in enumerate(comps):  # behaviour logprobs = the trainer's: the IS weight is 1
        comp.logprobs = lp[i, : len(comp.token_ids)].tolist()
    stats = learner.train_step([StepGroup(group, version=1, worker_id="w")], policy_version=1)
    assert stats["train/sequences"] == 4 and stats["train/tokens"] == 10
    assert stats["train/loss"] == pytest.approx(1.5 / (4 * 8), rel=1e-4)
    assert stats["train/grad_norm"] > 0


# -- the run spec ------------------------------------------------------------------------------------------------


def _spec(**loss: object) -> dict:
    return {
        "base_model": "m",
        "reward": {"name": "toy"},
        "dataset": {"uri": "toy:digits", "size": 4},
        "vocab_size": 64,
        "sampling": {"max_new_tokens": 300},
        "loss": loss,
    }


def test_defaults_are_unchanged_and_the_constant_is_filled_from_the_budget() -> None:
    assert LossSpec() == LossSpec(aggregation="token", scale_rewards="group", constant_normalizer=None)
    assert RunSpec.model_validate(_spec()).loss == LossSpec()
    filled = RunSpec.model_validate(_spec(aggregation="constant", scale_rewards="none"))
    assert filled.loss.constant_normalizer == 300
    assert RunSpec.model_validate(filled.model_dump(mode="json")) == filled  # what GET returns validates the same
    assert (
        RunSpec.model_validate(_spec(aggregation="constant", constant_normalizer=3000)).loss.constant_normalizer == 3000
    )
    multi = RunSpec.model_validate(
        {
            **_spec(aggregation="constant"),
            "env": EnvSpec(name="external"),
            "episode": EpisodeSpec(max_episode_tokens=900),
        }
    )
    assert multi.loss.constant_normalizer == 900  # a multi-turn sample holds up to max_episode_tokens
    # The caller's LossSpec object is not changed by the RunSpec that fills its copy.
    mine = LossSpec(aggregation="constant")
    RunSpec(**{**_spec(), "loss": mine, "sampling": SamplingSpec(max_new_tokens=7)})
    assert mine.constant_normalizer is None


@pytest.mark.parametrize(
    ("loss", "needle"),
    [
        (
            {"aggregation": "token", "constant_normalizer": 512},
            "constant_normalizer is only used by aggregation 'constant'",
        ),
        # TRL's field, refused with bucketrl's spelling of it (as an alias it would disagree with the aggregation
        # of a spec merged over the defaults, which is what `bucketrl up --run-spec` builds).
        ({"loss_type": "dr_grpo"}, "write aggregation 'constant' for TRL's 'dr_grpo' \\(with scale_rewards 'none'"),
        ({"loss_type": "grpo"}, "write aggregation 'sequence' for TRL's 'grpo'"),
        ({"loss_type": "bnpo"}, "TRL's 'bnpo' has no equivalent"),
        ({"aggregation": "constant", "constant_normalizer": 0}, "greater than or equal to 1"),
        ({"aggregation": "lengthwise"}, "'token', 'sequence' or 'constant'"),
    ],
)
def test_nonsense_combinations_are_refused(loss: dict, needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        RunSpec.model_validate(_spec(**loss))


@pytest.mark.parametrize(
    ("loss", "needle"),
    [
        ({"aggregation": "token", "constant_normalizer": 512}, "constant_normalizer is only used by aggregation"),
        ({"objective": "decoupled", "loss_type": "dr_grpo"}, "write aggregation 'constant' for TRL's 'dr_grpo'"),
        ({"entropy_coef": -0.01}, "field loss.entropy_coef: Input should be greater than or equal to 0"),
    ],
    ids=["constant without constant aggregation", "TRL's loss_type", "a negative entropy bonus"],
)
def test_bucketrl_up_refuses_a_wrong_loss_with_one_line_and_starts_nothing(
    tmp_path: Path, loss: dict, needle: str
) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"loss": loss}))
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bucketrl.cli",
            "up",
            "--dir",
            str(run_dir),
            "--no-live",
            "--generators",
            "1",
            "--run-spec",
            str(spec),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)},
    )
    stderr = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out.stdout + out.stderr
    assert len(stderr) == 1 and "Traceback" not in out.stdout + out.stderr, out.stderr
    assert stderr[0].startswith("bucketrl up: run spec field loss") and needle in stderr[0], stderr[0]
    assert not (run_dir / "services.json").exists()
