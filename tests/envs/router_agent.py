"""An agent in front of the agent router (a plain ``openai`` client in its own process): it opens all its episodes
first (so that one generator's admission control fills up and the router has to send the rest elsewhere, until
both are full and one more is refused), then
runs each with a streamed turn and a plain one, finishes it, and makes one call for an episode nobody holds.

    python -m tests.envs.router_agent URL TOKEN EPISODES
    -> {"refused": the answer to one more episode}, one JSON line per episode, then {"unknown": the answer}
"""

from __future__ import annotations

import json
import sys

import httpx
import openai


def run(url: str, token: str, episodes: int) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0)
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
    opened = [http.post("/v1/episodes").raise_for_status().json() for _ in range(episodes)]
    full = http.post("/v1/episodes")  # every generator holds all it admits now
    refused = {"status": full.status_code, "retry_after": full.headers.get("retry-after"), "body": full.json()}
    print(json.dumps({"refused": refused}), flush=True)
    for ep in opened:
        messages = [{"role": "user", "content": ep["row"]["prompt"]}]
        stream = client.chat.completions.create(model=ep["model"], messages=messages, stream=True)
        chunks = list(stream)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        messages += [{"role": "assistant", "content": streamed}, {"role": "user", "content": "again"}]
        plain = client.chat.completions.create(model=ep["model"], messages=messages)
        reward = 0.25 * ep["index_in_group"]
        done = http.post(f"/v1/episodes/{ep['episode_id']}/finish", json={"reward": reward}).raise_for_status()
        record = {
            "episode": ep,
            "chunks": len(chunks),
            "streamed": streamed,
            "finish_reasons": [
                next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason),
                plain.choices[0].finish_reason,
            ],
            "finished": done.json(),
        }
        print(json.dumps(record), flush=True)
    try:
        client.chat.completions.create(
            model=f"{opened[0]['model'].rpartition(':')[0]}:nosuchepisode", messages=[{"role": "user", "content": "hi"}]
        )
        unknown: object = 200
    except openai.APIStatusError as exc:
        unknown = {"status": exc.status_code, "body": exc.body}
    print(json.dumps({"unknown": unknown}), flush=True)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], int(sys.argv[3]))
