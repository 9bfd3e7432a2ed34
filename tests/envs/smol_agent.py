"""An external agent written with a widely used agent library, smolagents (``ToolCallingAgent`` over
``OpenAIServerModel``, i.e. the ``openai`` client), streaming its model calls, in its own process: it takes an
episode (``POST /v1/episodes``), lets the library run it through the endpoint with the episode's model name, and
finishes it with a reward of its own.

    python -m tests.envs.smol_agent URL TOKEN EPISODES   -> one JSON line per episode on stdout

The OpenAI Agents SDK (``openai-agents``) was the first choice: every release on the index pins ``openai`` 3,
``websockets`` < 17 or ``mcp`` 1, each a downgrade or upgrade of what the project's environment holds.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Generator
from typing import Any

import httpx
from smolagents import LogLevel, OpenAIServerModel, ToolCallingAgent, tool
from smolagents.agents import PromptTemplates
from smolagents.models import ChatMessage, ChatMessageStreamDelta

# The library's own prompts run to thousands of words: past the tiny model's 512 positions (the endpoint would
# fail the episode as out of context). Short ones keep the same agent loop.
PROMPTS: Any = {
    "system_prompt": "Call lookup, then answer.",
    "planning": {"initial_plan": "", "update_plan_pre_messages": "", "update_plan_post_messages": ""},
    "managed_agent": {"task": "", "report": ""},
    "final_answer": {"pre_messages": "Answer now.", "post_messages": "{{task}}"},
}


class CountingModel(OpenAIServerModel):
    """The library's OpenAI model, counting which of its calls streamed: the agent's steps do (``stream_outputs``);
    the final answer it asks for after its last step is a plain call in smolagents."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.calls = {"stream": 0, "plain": 0}

    def generate_stream(self, *args: Any, **kw: Any) -> Generator[ChatMessageStreamDelta]:
        self.calls["stream"] += 1
        yield from super().generate_stream(*args, **kw)

    def generate(self, *args: Any, **kw: Any) -> ChatMessage:
        self.calls["plain"] += 1
        return super().generate(*args, **kw)


def episode(url: str, token: str, ep: dict[str, Any]) -> dict[str, Any]:
    answer = str(ep["row"]["answer"])

    @tool
    def lookup() -> str:
        """Look up the answer to the question."""
        return answer

    model = CountingModel(model_id=ep["model"], api_base=f"{url}/v1", api_key=token, client_kwargs={"max_retries": 0})
    prompts: PromptTemplates = PROMPTS
    # One step, then the library's own final-answer call: two model turns at most (the run's max_turns is 3).
    agent = ToolCallingAgent(
        tools=[lookup],
        model=model,
        max_steps=1,
        stream_outputs=True,
        prompt_templates=prompts,
        verbosity_level=LogLevel.OFF,
    )
    with contextlib.redirect_stdout(sys.stderr):  # the library draws its stream on the console even when quiet
        final = agent.run(ep["row"]["prompt"])
    tool_calls = [c.name for s in agent.memory.steps for c in getattr(s, "tool_calls", None) or []]
    return {"final": str(final), "calls": model.calls, "tool_calls": tool_calls}


def run(url: str, token: str, episodes: int) -> None:
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
    for _ in range(episodes):
        ep = http.post("/v1/episodes").raise_for_status().json()
        result = episode(url, token, ep)
        reward = round(0.2 + 0.1 * ep["index_in_group"], 4)
        done = http.post(f"/v1/episodes/{ep['episode_id']}/finish", json={"reward": reward})
        print(json.dumps({"episode": ep, "reward": reward, **result, "finished": done.raise_for_status().json()}))


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], int(sys.argv[3]))
