"""Claimed rollout groups -> right-padded tensors, split into micro-batches that fit a token budget.

One :class:`TrainingSample` per trainable completion (``prompt + completion``). A multi-turn completion (docs/design.md
"Multi-turn trajectories") is one sample too: its "completion" is every segment after the prompt, model and
environment tokens alike, so the forward sees the whole conversation; its ``loss_mask`` keeps only the model
tokens in the loss (and in each model turn only the tokens up to its first EOS). A split episode's samples each
have their own prompt. A :class:`MicroBatch` holds

    input_ids      [B, L]  prompt + completion, right-padded with ``pad_id``
    attention_mask [B, L]  1 on real tokens
    completion_ids [B, T]  the sampled tokens, T = longest completion in the micro-batch
    logit_index    [B, T]  which of the last K logits predicts completion token t (see ``logits_to_keep``)
    mask           [B, T]  1 on tokens the loss counts: model tokens, not padding, not after the (turn's) first EOS,
                           not sampled by a version older than the step's staleness floor (partial rollouts)
    behaviour      [B, T]  the generators' behaviour logprobs
    advantages     [B]
    token_versions [B, T]  the adapter version that sampled each token (a partial rollout's spans; else the row's)
    samplings      per row: the sampling settings it was generated with (None: the run's)

Right padding keeps position ids equal to ``arange`` for every real token (the generators never saw any
padding), and causal attention means padding cannot influence them. ``logits_to_keep = K`` asks the model
for the last K positions only, enough to cover every completion (K = L - shortest prompt + 1), so the
vocabulary projection is never computed over prompts.

A partial rollout (issue 35) carries ``version_spans``: its early tokens were sampled by older versions than its
batch's. Given the step's floor (``min_version`` = the policy version trained minus ``max_staleness``), a token
sampled below it is masked out of the loss (counted in ``TrainingSample.stale_masked``); continuing a completion
never makes its early tokens younger. Whole-version completions are left to the group-level staleness checks.

Micro-batches are filled greedily from the longest sample down, keeping ``B * L <= token_budget``; a sample
longer than the budget gets a micro-batch of its own. The order is deterministic (length, then position).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from bucketrl.wire.rollouts import Completion, RolloutGroup
from bucketrl.wire.runs import SamplingSpec


@dataclass(frozen=True)
class TrainingSample:
    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]
    advantage: float
    # The policy version that generated it and the generator that did.
    version: int
    worker_id: str
    # Completion tokens the loss counts: up to and including the first EOS.
    n_valid: int
    # The sampling settings it was generated with (None: the run's); its logprobs are recomputed with them.
    sampling: SamplingSpec | None = None
    # Per completion token, 1 = trained, 0 = context only (a multi-turn completion's env tokens and what follows
    # the first EOS of a model turn). None: every token up to n_valid is trained (single-turn).
    loss_mask: tuple[int, ...] | None = None
    # Model turns in this sample (model segments; 1 for a single-turn completion).
    turns: int = 1
    # Per completion token, the version that sampled it (a partial rollout's spans); None: ``version`` sampled all.
    token_versions: tuple[int, ...] | None = None
    # Tokens up to n_valid masked out because their version is older than the step's floor (partial rollouts).
    stale_masked: int = 0

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def trained_tokens(self) -> int:
        return self.n_valid if self.loss_mask is None else sum(self.loss_mask[: self.n_valid])


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_ids: torch.Tensor
    logit_index: torch.Tensor
    logits_to_keep: int
    mask: torch.Tensor
    behaviour: torch.Tensor
    advantages: torch.Tensor
    versions: list[int]
    worker_ids: list[str]
    samplings: list[SamplingSpec | None]
    # [B, T] the version that sampled each token (padding: the row's version).
    token_versions: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> MicroBatch:
        tensors = ("input_ids", "attention_mask", "completion_ids", "logit_index", "mask", "behaviour", "advantages")
        for name in tensors:
            setattr(self, name, getattr(self, name).to(device))
        if self.token_versions is not None:
            self.token_versions = self.token_versions.to(device)
        return self


def valid_length(token_ids: list[int], eos_token_ids: Collection[int]) -> int:
    """Tokens up to and including the first EOS (all of them when there is none)."""
    for i, tok in enumerate(token_ids):
        if tok in eos_token_ids:
            return i + 1
    return len(token_ids)


def trained_mask(completion: Completion, eos_token_ids: Collection[int]) -> tuple[int, ...]:
    """A multi-turn completion's loss mask: its model tokens, each model turn up to and including its first EOS
    (what a single-turn completion trains, per turn); env tokens 0."""
    mask: list[int] = []
    for seg in completion.segments or ():
        n = len(seg.token_ids)
        if seg.kind == "env":
            mask += [0] * n
        else:
            valid = valid_length(seg.token_ids, eos_token_ids)
            mask += [1] * valid + [0] * (n - valid)
    return tuple(mask)


def group_samples(
    group: RolloutGroup,
    advantages: list[float],
    trainable: list[bool],
    *,
    version: int,
    worker_id: str,
    eos_token_ids: Collection[int],
    sampling: SamplingSpec | None = None,
    min_version: int | None = None,
) -> list[TrainingSample]:
    """The trainable completions of one group as samples (unscorable / filtered ones are left out); one advantage
    and one trainable flag per completion (a split episode's samples repeat their episode's). ``min_version``: the
    oldest version whose tokens a partial rollout trains (None: no token is masked for its version). A completion
    wholly masked so is still a sample here, with nothing trained (``trained_tokens`` 0, ``stale_masked`` > 0)."""
    if len(advantages) != len(group.completions) or len(trainable) != len(group.completions):
        raise ValueError("one advantage and one trainable flag per completion")
    out: list[TrainingSample] = []
    for comp, adv, keep in zip(group.completions, advantages, trainable, strict=True):
        if not keep:
            continue
        multi = comp.segments is not None
        n_valid = len(comp.token_ids) if multi else valid_length(comp.token_ids, eos_token_ids)
        loss_mask = trained_mask(comp, eos_token_ids) if multi else None
        token_versions = tuple(comp.token_versions(version)) if comp.version_spans is not None else None
        stale = 0
        if token_versions is not None and min_version is not None:  # single-turn: spans refuse segments
            loss_mask = tuple(int(v >= min_version) for v in token_versions)
            stale = n_valid - sum(loss_mask[:n_valid])
        out.append(
            TrainingSample(
                prompt_ids=list(group.prompt_of(comp)),
                completion_ids=list(comp.token_ids),
                behaviour_logprobs=list(comp.logprobs),
                advantage=float(adv),
                version=version,
                worker_id=worker_id,
                n_valid=n_valid,
                sampling=sampling,
                loss_mask=loss_mask,
                turns=comp.turns(),
                token_versions=token_versions,
                stale_masked=stale,
            )
        )
    return out


def collate(samples: list[TrainingSample], pad_id: int) -> MicroBatch:
    """Right-pad a list of samples into one micro-batch."""
    if not samples:
        raise ValueError("cannot collate an empty micro-batch")
    b = len(samples)
    seq_len = max(s.length for s in samples)
    comp_len = max(len(s.completion_ids) for s in samples)
    keep = seq_len - min(len(s.prompt_ids) for s in samples) + 1
    input_ids = torch.full((b, seq_len), pad_id, dtype=torch.long)
    attention = torch.zeros((b, seq_len), dtype=torch.long)
    completion = torch.full((b, comp_len), pad_id, dtype=torch.long)
    logit_index = torch.zeros((b, comp_len), dtype=torch.long)
    mask = torch.zeros((b, comp_len), dtype=torch.float32)
    behaviour = torch.zeros((b, comp_len), dtype=torch.float32)
    token_versions = torch.tensor([s.version for s in samples], dtype=torch.long).unsqueeze(-1).repeat(1, comp_len)
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[i, : p + c] = torch.tensor(s.prompt_ids + s.completion_ids)
        attention[i, : p + c] = 1
        completion[i, :c] = torch.tensor(s.completion_ids)
        # Token t of the completion sits at position p + t and is predicted by position p + t - 1, which is
        # row (p + t - 1) - (seq_len - keep) of the kept logits. Padded columns point at row 0 (masked).
        logit_index[i, :c] = torch.arange(c) + (p - 1 - (seq_len - keep))
        mask[i, : s.n_valid] = 1.0
        if s.loss_mask is not None:
            mask[i, :c] *= torch.tensor(s.loss_mask, dtype=torch.float32)
        behaviour[i, :c] = torch.tensor(s.behaviour_logprobs)
        if s.token_versions is not None:
            token_versions[i, :c] = torch.tensor(s.token_versions, dtype=torch.long)
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention,
        completion_ids=completion,
        logit_index=logit_index,
        logits_to_keep=keep,
        mask=mask,
        behaviour=behaviour,
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        versions=[s.version for s in samples],
        worker_ids=[s.worker_id for s in samples],
        samplings=[s.sampling for s in samples],
        token_versions=token_versions,
    )


def plan_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Indices of samples per micro-batch so that ``len(batch) * max_length <= token_budget``."""
    if token_budget < 1:
        raise ValueError("token_budget must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plans: list[list[int]] = []
    current: list[int] = []
    for i in order:
        # Sorted longest first: the first sample of a micro-batch sets its padded length.
        if current and (len(current) + 1) * lengths[current[0]] > token_budget:
            plans.append(current)
            current = []
        current.append(i)
    if current:
        plans.append(current)
    return plans


def make_micro_batches(samples: list[TrainingSample], token_budget: int, pad_id: int) -> list[MicroBatch]:
    return [
        collate([samples[i] for i in plan], pad_id)
        for plan in plan_micro_batches([s.length for s in samples], token_budget)
    ]
