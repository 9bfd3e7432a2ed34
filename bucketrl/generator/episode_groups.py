"""A finished group of episodes as the wire's :class:`~bucketrl.wire.RolloutGroup` (docs/design.md "Multi-turn
trajectories"): each episode's samples become multi-turn completions (``segments``), split episodes are tagged with
``episode``, a sample whose prompt is not the group's carries its own, and every failure is in ``reward_errors``
(an aborted episode's as ``episode:<kind>``, so that the trainer never blames the reward for it).

An episode that ended before its first model turn (its environment raised at once, no agent took it) has nothing
the trainer could learn from, but the group must still hold G episodes: it is sent as a one-token placeholder with
``finish_reason`` ``abort`` and reward null, which the trainer never trains on nor counts in the group's
statistics.
"""

from __future__ import annotations

from bucketrl.rollout.episodes import Episode
from bucketrl.rollout.reward_kinds import Scored
from bucketrl.wire import EPISODE_ERROR_PREFIX, Completion, PromptLeaseItem, RolloutGroup

MAX_REWARD_ERRORS = 8  # RolloutGroup.reward_errors' cap


def needs_score(ep: Episode) -> bool:
    return ep.needs_scoring and ep.error is None and bool(ep.turns)


def episode_group(
    prompt: PromptLeaseItem,
    fallback_prompt_ids: list[int],
    episodes: list[Episode],
    scored: dict[int, Scored],
    placeholder_token: int,
) -> RolloutGroup:
    """``scored[i]``: the run's reward function's verdict on episode i (those :func:`needs_score`)."""
    samples = [ep.samples() for ep in episodes]
    first = next((s[0].prompt_ids for s in samples if s), fallback_prompt_ids)
    split = any(len(s) > 1 for s in samples)
    errors: dict[str, str] = {}
    completions: list[Completion] = []
    for i, (ep, eps_samples) in enumerate(zip(episodes, samples, strict=True)):
        reward, kind, message = ep.reward, None, None
        if ep.error is not None:
            reward, (kind, message) = None, ep.error
            if ep.aborted:  # the episode's failure, not the reward's: the trainer tells them apart by the prefix
                kind = f"{EPISODE_ERROR_PREFIX}{kind}"
        elif i in scored:
            reward, kind, message = scored[i].value, scored[i].kind, scored[i].message
        elif not eps_samples:
            reward, kind, message = (
                None,
                f"{EPISODE_ERROR_PREFIX}no_turn",
                "the episode ended before the model's first turn",
            )
        if kind is not None and kind not in errors and len(errors) < MAX_REWARD_ERRORS:
            errors[kind] = message or kind
        built = _completions(eps_samples, first, reward, ep.finish_reason, i if split else None)
        if built is None:
            built = [
                Completion.from_segments(
                    [("model", [placeholder_token], [0.0])], None, "abort", episode=i if split else None
                )
            ]
        completions += built
    return RolloutGroup(
        prompt_id=prompt.prompt_id,
        prompt_index=prompt.index,
        prompt_token_ids=first,
        completions=completions,
        reward_errors=errors,
        episode_stats=episode_stats(episodes),
    )


def episode_stats(episodes: list[Episode]) -> dict[str, float]:
    """The group's episode sums the trainer reports per step (RolloutGroup.episode_stats)."""
    return {
        "episodes": float(len(episodes)),
        "turns": float(sum(ep.stats.turns for ep in episodes)),
        "tool_calls": float(sum(ep.stats.tool_calls for ep in episodes)),
        "tool_errors": float(sum(ep.stats.tool_errors for ep in episodes)),
        "timeouts": float(sum(int(ep.timed_out) for ep in episodes)),
        "gen_s": sum(ep.stats.gen_s for ep in episodes),
        "env_s": sum(ep.stats.env_s for ep in episodes),
    }


def _completions(
    samples: list, group_prompt: list[int], reward: float | None, finish: str, episode: int | None
) -> list[Completion] | None:
    if not samples:
        return None
    return [
        Completion.from_segments(
            s.segments,
            reward,
            finish,  # type: ignore[arg-type]
            prompt_token_ids=None if s.prompt_ids == group_prompt else s.prompt_ids,
            episode=episode,
        )
        for s in samples
    ]
