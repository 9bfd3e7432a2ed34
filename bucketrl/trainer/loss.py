"""The GRPO loss (docs/design.md section 5): a pure function over a typed batch of per-token tensors.

Three objectives, chosen per run by ``LossSpec.objective`` (docs/training.md compares them with TRL and AReaL):

* ``ppo_clip`` (TRL's): ``r = pi_theta / pi_behav`` against the generator's behaviour logprobs,
  ``loss_t = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)``.
* ``decoupled`` (AReaL's, for stale samples): ``r = pi_theta / pi_prox`` where ``pi_prox`` is the trainer's
  own detached logprob at the start of the step, clipped as above, times the truncated importance weight
  ``w = min(pi_prox / pi_behav, C)`` (detached): ``loss_t = -w * min(r * A, clip(r) * A)``. With one
  optimizer step per batch ``pi_theta == pi_prox`` in value, so ``r == 1`` and this is truncated-IS policy
  gradient; the clip only bites when a batch gets several optimizer steps.
* ``gspo`` (Zheng et al. 2025, "Group Sequence Policy Optimization"): one importance ratio per sequence,
  ``s_i = exp(mean_t(log pi_theta - log pi_behav))`` over its unmasked tokens, and
  ``loss_i = -min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i)``, the same value on each of its
  tokens. With ``aggregation="sequence"`` the loss is the paper's ``-1/G sum_i min(...)`` exactly; with
  ``token`` each sequence weighs by its length (TRL's ``importance_sampling_level="sequence"`` with a
  token-summing loss_type). The paper's clip range is far narrower (3e-4 / 4e-4) than the token-level one.
  A partly masked sequence (a partial rollout whose oldest tokens are past ``max_staleness``, masked by the
  batching) gets its ratio over the unmasked tokens only: ``s_i`` is the geometric mean ratio of the tokens it
  trains, each against the behaviour logprob of the version that sampled it; a wholly masked one is no sample.

Optional KL to the base model (``kl_coef > 0``) with the k3 estimator
``exp(ref - lp) - (ref - lp) - 1`` (unbiased, always >= 0), added per token. Both ``ref`` and ``lp`` here
are TEMPERATURE-ONLY logprobs (``LossBatch.kl_logprobs``), as in TRL: the top-k/top-p processed ones are
-inf (floored at -1e4) for a sampled token outside either model's nucleus, which made the k3 term infinite
(the whole step skipped) or ~1e4.

Aggregation (``LossSpec.aggregation``):

* ``token``: sum of per-token losses over every unmasked token of the step / number of those tokens
  (DAPO / TRL's default: long completions weigh in proportion to their length).
* ``sequence``: mean over each sequence's tokens, then mean over sequences (the original GRPO).
* ``constant`` (Liu et al. 2025, "Understanding R1-Zero-Like Training", Dr.GRPO): sum of per-token losses over
  every unmasked token of the step / (number of sequences * ``constant_normalizer``), the paper's
  ``1/G sum_i sum_t`` with the generation budget as the constant (TRL's ``loss_type="dr_grpo"`` with
  ``max_completion_length``, oat's ``generate_max_length``). A token's gradient no longer depends on its own
  sequence's length (``sequence`` divides it by ``|o_i|``: larger steps for short correct answers, smaller
  penalties for long wrong ones) nor on the other sequences' lengths (``token``). Dr.GRPO also drops the std
  from the advantages: ``scale_rewards="none"`` (advantages.py).

Optional entropy bonus (``entropy_coef > 0``, verl's ``entropy_coeff``): ``- entropy_coef * H_t`` added per
token, ``H_t`` the entropy of the policy's whole next-token distribution at that position (under the sampling
settings the group used, as the ratio's logprobs), with grad; aggregated like the rest, so a ``token`` loss
subtracts the coefficient times the mean entropy of the trained tokens.

Gradient accumulation: a step is split into micro-batches; pass the step's totals as
``token_normalizer`` / ``sequence_normalizer`` so the summed micro-batch losses equal the loss of the
whole step computed at once (and so do the gradients).

    from bucketrl.trainer.loss import LossBatch, grpo_loss
    out = grpo_loss(LossBatch(logprobs=lp, behaviour_logprobs=blp, advantages=adv, mask=m), LossSpec())
    out.loss.backward()
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bucketrl.wire.runs import LossSpec


@dataclass
class LossBatch:
    """Per-token tensors of a (micro-)batch. B = sequences, T = completion positions (right-padded)."""

    # log pi_theta(token) under the current policy, with grad. [B, T]
    logprobs: torch.Tensor
    # The generators' behaviour logprobs for the same tokens. [B, T]
    behaviour_logprobs: torch.Tensor
    # One advantage per sequence. [B]
    advantages: torch.Tensor
    # 1 for tokens that count, 0 for padding and for anything after the first EOS. [B, T]
    mask: torch.Tensor
    # The trainer's detached logprobs at the start of the step (decoupled objective). [B, T]
    proximal_logprobs: torch.Tensor | None = None
    # Temperature-only logprobs under the base model (adapter disabled), for the KL term. [B, T]
    ref_logprobs: torch.Tensor | None = None
    # Temperature-only logprobs of the current policy, with grad, for the KL term (None: ``logprobs``, right
    # when sampling applies no top-k/top-p). [B, T]
    kl_logprobs: torch.Tensor | None = None
    # Per-token entropy of the current policy's processed next-token distribution: a stat, and with
    # ``entropy_coef > 0`` a term of the loss (then it must carry grad). [B, T]
    entropy: torch.Tensor | None = None


@dataclass
class LossOutput:
    loss: torch.Tensor
    # Sums (not means) so micro-batches add up; divide by ``tokens`` for the step's means.
    sums: dict[str, float] = field(default_factory=dict)
    tokens: float = 0.0


def _trained_entropy(entropy: torch.Tensor | None, lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The entropy bonus's per-token entropy: with grad when the loss has grad, 0 where the mask is."""
    if entropy is None or (lp.requires_grad and not entropy.requires_grad):
        raise ValueError(
            "entropy_coef > 0 needs the policy's per-token entropy with grad (forward_logprobs' entropy_grad)"
        )
    # Masked positions may hold garbage (nan): zeroed here so neither the value nor the gradient sees them.
    return torch.where(mask > 0, entropy.to(lp.dtype), torch.zeros_like(lp))


def _masked_sum(x: torch.Tensor, mask: torch.Tensor) -> float:
    # where(), not x * mask: a masked position may hold inf or nan, and inf * 0 is nan.
    return float(torch.where(mask > 0, x.detach(), torch.zeros_like(x)).sum())


def _anchor_and_weight(
    batch: LossBatch, spec: LossSpec, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The logprobs the ratio is taken against, the per-token weight, and (decoupled) the log weight before its
    cap."""
    lp = batch.logprobs
    behav = batch.behaviour_logprobs.to(lp.dtype)
    if spec.objective in ("ppo_clip", "gspo"):
        return behav, torch.ones_like(lp), None
    if spec.objective == "decoupled":
        if batch.proximal_logprobs is None:
            raise ValueError("the decoupled objective needs proximal_logprobs")
        anchor = batch.proximal_logprobs.to(lp.dtype).detach()
        # Truncated importance weight pi_prox / pi_behav, capped at C; a constant for the gradient.
        log_w = torch.where(mask > 0, anchor - behav, torch.zeros_like(lp))
        return anchor, torch.exp(log_w).clamp(max=spec.is_cap).detach(), log_w
    raise ValueError(f"unknown objective {spec.objective!r}")  # pragma: no cover - LossSpec's Literal forbids it


def grpo_loss(
    batch: LossBatch,
    spec: LossSpec,
    *,
    token_normalizer: float | None = None,
    sequence_normalizer: float | None = None,
) -> LossOutput:
    """The loss of docs/design.md section 5 and the sums behind its stats (see :func:`finalize_stats`).

    ``token_normalizer`` (token aggregation) and ``sequence_normalizer`` (sequence and constant aggregation)
    default to this batch's own unmasked-token and sequence counts.
    """
    mask = batch.mask.to(batch.logprobs.dtype)
    if batch.logprobs.shape != batch.behaviour_logprobs.shape or batch.logprobs.shape != mask.shape:
        raise ValueError(
            f"shape mismatch: logprobs {tuple(batch.logprobs.shape)}, behaviour "
            f"{tuple(batch.behaviour_logprobs.shape)}, mask {tuple(mask.shape)}"
        )
    adv = batch.advantages.to(batch.logprobs.dtype).unsqueeze(-1)  # [B, 1]
    lp = batch.logprobs
    behav = batch.behaviour_logprobs.to(lp.dtype)

    anchor, weight, log_w = _anchor_and_weight(batch, spec, mask)

    # Masked positions may hold arbitrary values (padding): zero the log-ratio there so exp() stays finite.
    log_ratio = torch.where(mask > 0, lp - anchor, torch.zeros_like(lp))
    if spec.objective == "gspo":
        # The length-normalised sequence log-ratio, broadcast to the sequence's tokens (grad flows through
        # every token's logprob, each scaled by s_i / |y_i|: the paper's gradient).
        log_ratio = (log_ratio.sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1).expand_as(lp)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - spec.epsilon_low, 1.0 + spec.epsilon_high)
    per_token = -weight * torch.min(ratio * adv, clipped * adv)

    kl = None
    if spec.kl_coef > 0.0:
        if batch.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        kl_lp = batch.kl_logprobs.to(lp.dtype) if batch.kl_logprobs is not None else lp
        delta = torch.where(mask > 0, batch.ref_logprobs.to(lp.dtype) - kl_lp, torch.zeros_like(lp))
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + spec.kl_coef * kl

    if spec.entropy_coef > 0.0:
        per_token = per_token - spec.entropy_coef * _trained_entropy(batch.entropy, lp, mask)

    n_tokens = float(mask.sum())
    masked = torch.where(mask > 0, per_token, torch.zeros_like(per_token))
    if spec.aggregation == "token":
        denom = token_normalizer if token_normalizer is not None else n_tokens
        loss = masked.sum() / max(denom, 1.0)
    elif spec.aggregation == "constant":
        if spec.constant_normalizer is None:
            raise ValueError("aggregation 'constant' needs loss.constant_normalizer (a RunSpec fills it in)")
        sequences = sequence_normalizer if sequence_normalizer is not None else float(lp.shape[0])
        loss = masked.sum() / (max(sequences, 1.0) * spec.constant_normalizer)
    else:
        seq_len = mask.sum(-1).clamp(min=1.0)
        per_seq = masked.sum(-1) / seq_len
        denom = sequence_normalizer if sequence_normalizer is not None else float(lp.shape[0])
        loss = per_seq.sum() / max(denom, 1.0)

    # TRL's clip accounting: a token is clipped low when r < 1 - eps and A < 0 (the clip removes its
    # gradient), high when r > 1 + eps and A > 0.
    low = ((ratio < 1.0 - spec.epsilon_low) & (adv < 0)).to(lp.dtype)
    high = ((ratio > 1.0 + spec.epsilon_high) & (adv > 0)).to(lp.dtype)
    behaviour_ratio = torch.exp(torch.where(mask > 0, lp - behav, torch.zeros_like(lp)))
    sums = {
        "ratio": _masked_sum(behaviour_ratio, mask),
        "clip_ratio/low_mean": _masked_sum(low, mask),
        "clip_ratio/high_mean": _masked_sum(high, mask),
        "clip_ratio/region_mean": _masked_sum(torch.clamp(low + high, max=1.0), mask),
        "loss_tokens": _masked_sum(per_token, mask),
    }
    if spec.objective == "gspo":
        sums["ratio/sequence"] = _masked_sum(ratio, mask)  # token-weighted mean of s_i
    if spec.objective == "decoupled":
        sums["ratio/proximal"] = _masked_sum(ratio, mask)
        sums["is_weight_mean"] = _masked_sum(weight, mask)
        assert log_w is not None
        sums["is_weight_truncated_frac"] = _masked_sum((torch.exp(log_w) > spec.is_cap).to(lp.dtype), mask)
    if kl is not None:
        sums["kl"] = _masked_sum(kl, mask)
    if batch.entropy is not None:
        sums["entropy"] = _masked_sum(batch.entropy.to(lp.dtype), mask)
    return LossOutput(loss=loss, sums=sums, tokens=n_tokens)


def finalize_stats(outputs: list[LossOutput]) -> dict[str, float]:
    """Token-weighted means over a step's micro-batches (``ratio``, ``clip_ratio/*``, ``kl``, ``entropy``...)."""
    tokens = sum(o.tokens for o in outputs)
    if tokens <= 0:
        return {}
    keys = sorted({k for o in outputs for k in o.sums})
    stats = {k: sum(o.sums.get(k, 0.0) for o in outputs) / tokens for k in keys}
    stats.pop("loss_tokens", None)
    return stats
