"""An episode's model turns as training samples (docs/design.md "Multi-turn trajectories").

Each call the endpoint serves records the exact prompt token ids it rendered, the token ids it sampled and their
behaviour logprobs (:class:`Turn`). A turn whose prompt starts with the previous turn's prompt + completion
continues the same sample: the tokens in between (the template's end-of-turn and role headers, tool results,
user messages) are an ``env`` segment (in context, never trained), the new completion a ``model`` segment. A turn
whose prompt does not extend the previous sequence (a template that re-renders history, e.g. drops earlier
reasoning or re-serialises tool-call JSON differently from what the model wrote) starts a new sample with its
own prompt: tokens are never re-tokenised or guessed, so every trained token is exactly what was sampled from
exactly the context the policy saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bucketrl.rollout.engine import FinishReason

Segments = list[tuple[str, list[int], list[float] | None]]


@dataclass
class Turn:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason


@dataclass
class TrajectorySample:
    """One trainable sequence cut from an episode's turns: a prompt, then model and env segments."""

    prompt_ids: list[int]
    segments: Segments = field(default_factory=list)
    seq_len: int = 0  # prompt + segments


def build_samples(turns: list[Turn]) -> list[TrajectorySample]:
    """The turns (in call order) as samples; empty completions add nothing."""
    samples: list[TrajectorySample] = []
    seq: list[int] = []
    for t in turns:
        if not t.completion_ids:
            continue
        cur = samples[-1] if samples else None
        if cur is not None and len(t.prompt_ids) >= len(seq) and t.prompt_ids[: len(seq)] == seq:
            gap = t.prompt_ids[len(seq) :]
            if gap:
                cur.segments.append(("env", list(gap), None))
        else:
            cur = TrajectorySample(list(t.prompt_ids))
            samples.append(cur)
        cur.segments.append(("model", list(t.completion_ids), [min(lp, 0.0) for lp in t.logprobs]))
        seq = [*t.prompt_ids, *t.completion_ids]
        cur.seq_len = len(seq)
    return samples
