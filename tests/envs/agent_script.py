"""An external agent: a plain ``openai`` client in its own process, driving episodes through a generator's exposed
endpoint (``POST /v1/episodes``, chat calls with the episode's model name, ``POST /v1/episodes/{id}/finish``).

    python -m tests.envs.agent_script URL TOKEN EPISODES [fail]   -> one JSON line per episode on stdout

``fail``: the agent reports an error on every episode but the first of each group (3 of 4 with G = 4).
"""

from __future__ import annotations

import json
import sys

import httpx
import openai

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


def run(url: str, token: str, episodes: int, fail: bool = False) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0)
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
    for _ in range(episodes):
        ep = http.post("/v1/episodes").raise_for_status().json()
        messages = [{"role": "user", "content": ep["row"]["prompt"]}]
        calls = []
        for _turn in range(2):
            resp = client.chat.completions.create(model=ep["model"], messages=messages, tools=TOOLS, logprobs=True)
            msg = resp.choices[0].message
            calls.append(
                {
                    "content": msg.content,
                    "tool_calls": [c.function.name for c in msg.tool_calls or []],
                    "logprobs": [t.logprob for t in resp.choices[0].logprobs.content],
                    "finish_reason": resp.choices[0].finish_reason,
                    "usage": [resp.usage.prompt_tokens, resp.usage.completion_tokens],
                }
            )
            messages.append(msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
            for c in msg.tool_calls or []:
                messages.append({"role": "tool", "tool_call_id": c.id, "content": ep["row"]["answer"]})
            if not msg.tool_calls:
                messages.append({"role": "user", "content": "again"})
        result = {"reward": 0.25 * ep["index_in_group"]}
        if fail and ep["index_in_group"] > 0:
            result = {"error": f"the agent's tool crashed (episode {ep['index_in_group']})"}
        done = http.post(f"/v1/episodes/{ep['episode_id']}/finish", json=result)
        print(json.dumps({"episode": ep, "calls": calls, "finished": done.raise_for_status().json()}), flush=True)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], int(sys.argv[3]), fail=sys.argv[4:] == ["fail"])
