"""The environment protocol: what a run's ``env.name`` names and what it is given.

    class MyEnv:                                   # env.name "my_envs:MyEnv", env.kwargs -> MyEnv(**kwargs)
        async def rollout(self, ctx: EpisodeContext) -> float | None:
            r = await ctx.client.chat.completions.create(model=ctx.model, messages=[...], tools=[...])
            ...                                    # any number of model turns, tool calls, env messages
            return 1.0                             # or None: the run's reward function scores the last answer

One instance per generator serves every episode (G of them at once per prompt, concurrently): keep per-episode
state in ``rollout``'s locals or on ``ctx``. ``rollout`` may also be a plain ``def``: it then runs in a thread of
its own with a synchronous ``openai.OpenAI`` client (do this when the environment blocks: a blocking call in an
``async def`` holds up every episode of the generator). :class:`bucketrl.envs.tools.ToolEnv` is the loop most
tool-using environments need. An environment that holds something open (a server, a subprocess) may define
``async def aclose(self)``: the generator awaits it when it stops.

Names: ``toy:tools`` (built in, :mod:`bucketrl.envs.toy_tools`), ``module:Class`` (imported like a reward
function, under the same allow-list, ``BUCKETRL_ALLOWED_REWARD_MODULES``), ``verifiers:<taskset id>`` (a
``verifiers`` environment, :mod:`bucketrl.envs.verifiers_env`), or ``external`` (no environment on
the generator: agents outside it take episodes through the exposed endpoint); :mod:`bucketrl.envs.loader` turns a
name into an instance.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Protocol

from bucketrl.rollout.episodes import Episode

EXTERNAL = "external"


@dataclass(frozen=True)
class Row:
    """The dataset row an episode is about."""

    index: int
    prompt: str  # the row's prompt (a chat row's last user message)
    answer: str | None
    messages: list[dict[str, str]] | None  # a chat row's conversation (before the policy's turn)

    def chat(self) -> list[dict[str, Any]]:
        """The conversation to start from: the row's messages, or its prompt as one user message."""
        return [dict(m) for m in self.messages] if self.messages else [{"role": "user", "content": self.prompt}]


@dataclass
class EpisodeContext:
    row: Row
    # An openai.AsyncOpenAI (openai.OpenAI for a plain-def rollout) on this generator's endpoint.
    client: Any
    # Send it as ``model`` on every call: it pins the episode's policy version.
    model: str
    max_turns: int
    episode: Episode = field(repr=False)
    # Free for the environment (per-episode state).
    state: dict[str, Any] = field(default_factory=dict)

    def tool_error(self) -> None:
        """Count a failed tool call (unknown tool, malformed arguments, the tool raised)."""
        self.episode.stats.tool_errors += 1


class Environment(Protocol):
    def rollout(self, ctx: EpisodeContext) -> Any: ...


def is_async(env: Any) -> bool:
    return inspect.iscoroutinefunction(env.rollout)
