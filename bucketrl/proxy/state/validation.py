"""The checks a submitted batch must pass that its schema cannot make (422 naming the field), against the run's
spec: group size, prompt ids that were leased, token ids within the vocabulary, completion and episode lengths,
version spans only in a run with ``partial_rollouts``.
``submit.py`` runs them before a batch is written."""

from __future__ import annotations

from typing import Any

import numpy as np

from bucketrl import errors
from bucketrl.proxy.state import prompts
from bucketrl.wire import Completion, RolloutBatch, RolloutGroup, RunSpec


def validate_batch(batch: RolloutBatch, spec: RunSpec, cursor: int, max_new_bound: int | None = None) -> None:
    """Semantic checks the schema cannot make (422 naming the field). ``cursor``: prompts issued so far.
    ``max_new_bound``: the largest ``sampling.max_new_tokens`` the run's spec has ever had (``runs.bound_of``;
    default the spec's current one)."""
    g_size, vocab, size = spec.group_size, spec.vocab_size, spec.dataset.size
    if len(batch.groups) > spec.queue_capacity_groups:
        raise errors.Invalid(
            f"groups: {len(batch.groups)} groups can never fit the queue (queue_capacity_groups "
            f"{spec.queue_capacity_groups}); submit smaller batches"
        )
    seen: set[str] = set()
    # A batch's completions are as long as its sampling allowed, but that sampling is the generator's own claim:
    # it may be what an older spec said (a batch in flight across a change), never more than any spec ever said.
    bound = max(spec.sampling.max_new_tokens, max_new_bound or 0)
    if batch.sampling is not None and batch.sampling.max_new_tokens > bound:
        raise errors.Invalid(
            f"sampling.max_new_tokens: {batch.sampling.max_new_tokens}, more than the run's spec has ever allowed "
            f"({bound})"
        )
    max_new = batch.sampling.max_new_tokens if batch.sampling is not None else bound
    # Token ids against vocab_size: one pass over all of them (numpy arrays when the body was packed), the
    # per-array walk below only to name the offender.
    arrays = [a for g in batch.groups for a in (g.prompt_token_ids, *(c.token_ids for c in g.completions))]
    arrays += [c.prompt_token_ids for g in batch.groups for c in g.completions if c.prompt_token_ids is not None]
    in_vocab = _all_below(arrays, vocab)
    for i, group in enumerate(batch.groups):
        where = f"groups[{i}]"
        _check_group_size(group, where, g_size, spec)
        parsed = prompts.parse_prompt_id(group.prompt_id)
        if parsed is None:
            raise errors.Invalid(f"{where}.prompt_id: {group.prompt_id[:60]!r} is not of the form '<pass>-<index>'")
        pass_, index = parsed
        if index != group.prompt_index:
            raise errors.Invalid(
                f"{where}.prompt_index: {group.prompt_index} != the index {index} of {group.prompt_id!r}"
            )
        if index >= size:
            raise errors.Invalid(f"{where}.prompt_id: index {index} is outside the dataset (size {size})")
        if pass_ * size + index >= cursor:
            raise errors.Invalid(f"{where}.prompt_id: {group.prompt_id!r} was never leased (lease prompts first)")
        if group.prompt_id in seen:
            raise errors.Invalid(f"{where}.prompt_id: {group.prompt_id!r} appears twice in this batch")
        seen.add(group.prompt_id)
        for c, comp in enumerate(group.completions):
            at = f"{where}.completions[{c}]"
            if comp.version_spans is not None and not spec.partial_rollouts:
                raise errors.Invalid(
                    f"{at}.version_spans: the run does not have partial_rollouts (its trainer would train every "
                    "token as the batch's version); send whole-version completions"
                )
            if comp.segments is None:
                if len(comp.token_ids) > max_new:
                    raise errors.Invalid(
                        f"{at}.token_ids: {len(comp.token_ids)} tokens, more than the sampling's max_new_tokens "
                        f"{max_new}"
                    )
            else:
                _check_trajectory(group, comp, at, max_new, spec)
        if in_vocab:  # the one pass above saw every token id below vocab_size
            continue
        _check_vocab(group.prompt_token_ids, vocab, f"{where}.prompt_token_ids")
        for c, comp in enumerate(group.completions):
            at = f"{where}.completions[{c}]"
            _check_vocab(comp.token_ids, vocab, f"{at}.token_ids", comp)
            if comp.prompt_token_ids is not None:
                _check_vocab(comp.prompt_token_ids, vocab, f"{at}.prompt_token_ids")


def _check_group_size(group: RolloutGroup, where: str, g_size: int, spec: RunSpec) -> None:
    """G completions, or G episodes of at most ``episode.max_turns`` model turns each when episodes are split."""
    if group.completions[0].episode is None:
        if len(group.completions) != g_size:
            raise errors.Invalid(
                f"{where}.completions: {len(group.completions)} completions, the run's group_size is {g_size}"
            )
        return
    episodes = group.episodes()
    if len(episodes) != g_size:
        raise errors.Invalid(f"{where}.completions: {len(episodes)} episodes, the run's group_size is {g_size}")
    max_turns = spec.episode.max_turns
    for e, members in enumerate(episodes):
        turns = sum(group.completions[i].turns() for i in members)
        if turns > max_turns:
            raise errors.Invalid(
                f"{where}.completions[{members[0]}].segments: episode {e} has {turns} model turns over its "
                f"{len(members)} samples, more than episode.max_turns {max_turns}"
            )


def _check_trajectory(group: RolloutGroup, comp: Completion, at: str, max_new: int, spec: RunSpec) -> None:
    """A multi-turn completion against the run's limits: each model turn is one generation (max_new_tokens), the
    whole sample is one training sequence (episode.max_episode_tokens), the turns are bounded (max_turns)."""
    assert comp.segments is not None
    limits = spec.episode
    turns = comp.turns()
    if turns > limits.max_turns:
        raise errors.Invalid(f"{at}.segments: {turns} model turns, more than episode.max_turns {limits.max_turns}")
    for s, seg in enumerate(comp.segments):
        if seg.kind == "model" and len(seg.token_ids) > max_new:
            raise errors.Invalid(
                f"{at}.segments[{s}].token_ids: {len(seg.token_ids)} tokens in one model turn, more than the "
                f"sampling's max_new_tokens {max_new}"
            )
    total = len(group.prompt_of(comp)) + len(comp.token_ids)
    if total > limits.max_episode_tokens:
        raise errors.Invalid(
            f"{at}.segments: {total} tokens with the prompt, more than episode.max_episode_tokens "
            f"{limits.max_episode_tokens}"
        )


def _check_vocab(ids: list[int], vocab: int, where: str, comp: Completion | None = None) -> None:
    if _max(ids) < vocab:
        return
    j = next(j for j, t in enumerate(ids) if t >= vocab)
    token = ids[j]
    if comp is not None and comp.segments is not None:  # name the segment the token came from
        start = 0
        for s, seg in enumerate(comp.segments):
            if j < start + len(seg.token_ids):
                where, j = f"{where.rsplit('.', 1)[0]}.segments[{s}].token_ids", j - start
                break
            start += len(seg.token_ids)
    raise errors.Invalid(f"{where}[{j}]: token id {token} >= vocab_size {vocab}")


def _all_below(arrays: list[Any], bound: int) -> bool:
    """Every item of every list or numpy array (a packed field kept as one) is below ``bound``."""
    if all(hasattr(a, "max") for a in arrays):
        return int(np.concatenate(arrays).max()) < bound
    return max(_max(a) for a in arrays) < bound


def _max(values: Any) -> int:
    """The largest of a list or of a numpy array: each at C speed."""
    return int(values.max()) if hasattr(values, "max") else max(values)
