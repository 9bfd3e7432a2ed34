"""The trainer's logprobs of a group's completions, through the very path a training step takes (samples ->
right-padded micro-batches -> ``logits_to_keep`` -> gather), for checks of invariant 6 on multi-turn
trajectories: the generator's behaviour logprob of every MODEL token must equal what the trainer recomputes over
the whole sequence (prompt + every segment) within 1e-3 at identical weights.

    policy = PolicyModel(spec, device="cpu", dtype="float32")    # or learner.policy
    policy.load_adapter(adapter_dir)                               # the weights the generator served
    gaps = model_token_gaps(policy, group, sampling)               # per completion: max |trainer - behaviour|
    assert max(gaps) < 1e-3

Runs without gradients in eval mode (no dropout), and puts the model's training mode back.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from bucketrl.trainer.batching import collate, group_samples, plan_micro_batches
from bucketrl.trainer.model import PolicyModel
from bucketrl.wire.rollouts import RolloutGroup
from bucketrl.wire.runs import SamplingSpec


def recompute_logprobs(
    policy: PolicyModel, group: RolloutGroup, sampling: SamplingSpec | None = None, *, token_budget: int = 4096
) -> list[list[float]]:
    """Per completion of ``group``, the trainer's logprob of each of its ``token_ids`` under the policy's current
    weights, processed with ``sampling`` (None: the run's): model and environment tokens alike (only the model
    tokens, ``Completion.loss_mask()``, are trained and compared with behaviour logprobs)."""
    n = len(group.completions)
    samples = group_samples(group, [0.0] * n, [True] * n, version=0, worker_id="", eos_token_ids=(), sampling=sampling)
    # Every position computed (the mask would zero env tokens and anything after an EOS).
    samples = [replace(s, loss_mask=None, n_valid=len(s.completion_ids)) for s in samples]
    out: list[list[float]] = [[] for _ in samples]
    was_training = policy.model.training
    policy.model.eval()
    try:
        with torch.no_grad():
            for plan in plan_micro_batches([s.length for s in samples], token_budget):
                mb = collate([samples[i] for i in plan], policy.pad_id).to(policy.device)
                lp, _ = policy.token_logprobs(mb)
                for row, i in enumerate(plan):
                    out[i] = lp[row, : len(samples[i].completion_ids)].float().cpu().tolist()
    finally:
        policy.model.train(was_training)
    return out


def model_token_gaps(
    policy: PolicyModel, group: RolloutGroup, sampling: SamplingSpec | None = None, *, token_budget: int = 4096
) -> list[float]:
    """Per completion, the largest |trainer - behaviour| logprob over its model tokens (0.0 if it has none)."""
    gaps: list[float] = []
    recomputed = recompute_logprobs(policy, group, sampling, token_budget=token_budget)
    for comp, lps in zip(group.completions, recomputed, strict=True):
        diffs = [abs(a - b) for a, b, m in zip(lps, comp.logprobs, comp.loss_mask(), strict=True) if m]
        gaps.append(max(diffs, default=0.0))
    return gaps
