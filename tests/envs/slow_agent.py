"""An external agent that takes its time: a plain ``openai`` client in its own process that pauses between its two
model calls (a tool, a web request, a sandbox), obeys ``429`` + ``Retry-After`` on ``POST /v1/episodes`` and
reports a reward of its own per episode.

    python -m tests.envs.slow_agent URL TOKEN --episodes N [--pause S] [--reward-base R] [--max-wait S]
                                                  [--stop-file PATH] [--reward-step S] [--give-up S]
                                                  [--agent NAME]

One JSON line per episode on stdout: the episode's id, version, prompt and index, the reward sent, the finish's
status code (409 ``stale_group`` when the group was too stale to be trained), the seconds spent waiting for
admission before it got the episode and how many 429s it took. ``--stop-file``: stop early once that file exists
and the group of the episode just finished is complete (so no group is left with a slot nobody takes).
``--reward-step``: the agent's k-th episode (from 0) adds ``k x S`` to its reward, so that every episode's reward
is its own (tests/e2e/test_up_agent_rewards.py finds each episode in the trained books by it). ``--give-up``: an
agent refused for that long on one episode prints ``{"starved": ...}`` with the last refusal and exits 3.
``--agent``: the name it sends with ``POST /v1/episodes`` (its own source for fair admission). Each line also has
``asked``, ``opened`` and ``finished``: wall-clock times (time.time()) of its first ask, its admission and its finish.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import httpx
import openai

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


class Starved(Exception):
    pass


def open_episode(
    http: httpx.Client, max_wait_s: float, give_up_s: float = math.inf, agent: str | None = None
) -> tuple[dict, float, int]:
    """An episode, after as many 429s as admission control answers (each waited out as its Retry-After says)."""
    t0, refusals = time.monotonic(), 0
    while True:
        r = http.post("/v1/episodes", json={"agent": agent}) if agent else http.post("/v1/episodes")
        if r.status_code != 429:
            return r.raise_for_status().json(), time.monotonic() - t0, refusals
        refusals += 1
        if time.monotonic() - t0 > give_up_s:
            raise Starved(
                json.dumps({"starved": round(time.monotonic() - t0, 1), "refusals": refusals, "last": r.text})
            )
        time.sleep(min(max_wait_s, float(r.headers.get("retry-after") or 1)))


def episode(client: openai.OpenAI, ep: dict, pause_s: float) -> None:
    messages = [{"role": "user", "content": ep["row"]["prompt"]}]
    for turn in range(2):
        if turn:
            time.sleep(pause_s)  # the agent's own work between the model's turns
        resp = client.chat.completions.create(model=ep["model"], messages=messages, tools=TOOLS)
        msg = resp.choices[0].message
        messages.append(msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        for c in msg.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": c.id, "content": ep["row"]["answer"]})
        if not msg.tool_calls:
            messages.append({"role": "user", "content": "again"})


def run(
    url: str,
    token: str,
    episodes: int,
    pause_s: float,
    reward_base: float,
    max_wait_s: float,
    stop: Path | None,
    reward_step: float = 0.0,
    give_up_s: float = math.inf,
    agent: str | None = None,
) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0, timeout=120)
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
    complete = True
    for k in range(episodes):
        if stop is not None and stop.exists() and complete:
            return
        asked = time.time()
        ep, waited, refusals = open_episode(http, max_wait_s, give_up_s, agent)
        t0, opened = time.monotonic(), time.time()
        episode(client, ep, pause_s)
        reward = round(reward_base + 0.01 * ep["index_in_group"] + reward_step * k, 4)
        done = http.post(f"/v1/episodes/{ep['episode_id']}/finish", json={"reward": reward})
        complete = done.status_code != 200 or bool(done.json()["group_complete"])
        line = {
            "episode_id": ep["episode_id"],
            "version": ep["version"],
            "prompt_id": ep["prompt_id"],
            "index_in_group": ep["index_in_group"],
            "reward": reward,
            "finish_status": done.status_code,
            "finish_code": done.json().get("error", {}).get("code") if done.status_code != 200 else None,
            "waited_s": round(waited, 3),
            "refusals": refusals,
            "episode_s": round(time.monotonic() - t0, 3),
            "group_complete": complete,
            "agent": agent,
            "asked": asked,
            "opened": opened,
            "finished": time.time(),
        }
        print(json.dumps(line), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("url")
    p.add_argument("token")
    p.add_argument("--episodes", type=int, required=True)
    p.add_argument("--pause", type=float, default=0.0, help="seconds between the episode's two model calls")
    p.add_argument("--reward-base", type=float, default=0.5)
    p.add_argument("--max-wait", type=float, default=5.0, help="cap on one Retry-After wait")
    p.add_argument("--stop-file", type=Path, default=None)
    p.add_argument("--reward-step", type=float, default=0.0, help="added to the reward per episode of this agent")
    p.add_argument("--give-up", type=float, default=math.inf, help="exit 3 after this long refused for one episode")
    p.add_argument("--agent", default=None, help="the agent name sent with POST /v1/episodes")
    a = p.parse_args()
    try:
        run(
            a.url,
            a.token,
            a.episodes,
            a.pause,
            a.reward_base,
            a.max_wait,
            a.stop_file,
            a.reward_step,
            a.give_up,
            a.agent,
        )
    except Starved as exc:
        print(exc, flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
