"""The generator's OpenAI-compatible endpoint, spoken to over real HTTP: a plain ``openai`` client in another
process runs external episodes; wrong model names, turn limits, closed episodes and unsupported options are
refused with clear errors that end up in the episode's record."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from bucketrl.rollout.episodes import GroupRun
from bucketrl.rollout.example import Example
from bucketrl.tasks.tiny_model import VOCAB_SIZE
from tests.envs.support import TOKEN, Harness, episode_spec, harness

EXAMPLE = Example(index=3, prompt="q?", answer="odd")


@pytest.fixture()
def h(tiny_model_dir: Path, adapter_dir: Path) -> Iterator[Harness]:
    holder: list[Harness] = []

    def new_group(agent: str | None) -> GroupRun:
        ASKED.append(agent)
        return holder[0].group(EXAMPLE, external=True)

    def stale(_group: GroupRun) -> str | None:
        return STALE[0] if STALE else None

    with harness(
        tiny_model_dir, adapter_dir, episode_spec(tiny_model_dir), new_external_group=new_group, stale_reason=stale
    ) as hh:
        holder.append(hh)
        yield hh
    STALE.clear()


STALE: list[str] = []  # what the generator says about staleness (set by a test: the group is now too old)
ASKED: list[str | None] = []  # the agent names new groups were asked for


def _http(h: Harness) -> httpx.Client:
    return httpx.Client(base_url=h.svc.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)


def _finished(h: Harness, timeout_s: float = 10.0) -> GroupRun:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = h.svc.take_finished()
        if done:
            return done[0]
        time.sleep(0.02)
    raise AssertionError("no group finished")


def test_an_openai_client_in_another_process_runs_a_group_of_episodes(h: Harness) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tests.envs.agent_script", h.svc.url, TOKEN, "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["episode"]["index_in_group"] for r in records] == [0, 1, 2, 3]
    assert len({r["episode"]["prompt_id"] for r in records}) == 1  # one group: the G episodes of one prompt
    assert records[-1]["finished"]["group_complete"] and not records[0]["finished"]["group_complete"]
    group = _finished(h)
    for rec, ep in zip(records, group.episodes, strict=True):
        assert rec["episode"]["model"] == ep.model == f"run-v1:{ep.id}"
        assert rec["episode"]["row"] == {"index": 3, "prompt": "q?", "answer": "odd", "messages": None}
        assert ep.reward == 0.25 * ep.index and ep.error is None
        # What the client was told is exactly what was recorded: tokens, behaviour logprobs, prompt sizes.
        assert [t.logprobs for t in ep.turns] == [c["logprobs"] for c in rec["calls"]]
        assert [[len(t.prompt_ids), len(t.completion_ids)] for t in ep.turns] == [c["usage"] for c in rec["calls"]]
        for call, turn in zip(rec["calls"], ep.turns, strict=True):
            assert call["content"] == h.svc.decode(turn.completion_ids)  # bang syntax: the whole text
            assert (call["finish_reason"] == "tool_calls") == ("!" in call["content"]) == bool(call["tool_calls"])
        assert ep.stats.tool_calls == sum(len(c["tool_calls"]) for c in rec["calls"])
        # The second turn's prompt holds the first turn (the template renders the assistant's text verbatim).
        samples = ep.samples()
        first = ep.turns[0]
        if len(samples) == 1:
            kinds = [k for k, _, _ in samples[0].segments]
            assert kinds == ["model", "env", "model"]
            assert samples[0].prompt_ids == first.prompt_ids
            assert ep.turns[1].prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == (
                first.prompt_ids + first.completion_ids
            )
        else:  # the model wrote a token its text does not re-encode to (whitespace): split, never re-tokenised
            assert [s.prompt_ids for s in samples] == [t.prompt_ids for t in ep.turns]


def test_model_names_pin_the_episode_and_its_version(h: Harness) -> None:
    http = _http(h)
    client = openai.OpenAI(base_url=f"{h.svc.url}/v1", api_key=TOKEN, max_retries=0)
    ep = http.post("/v1/episodes").raise_for_status().json()
    msgs = [{"role": "user", "content": "q?"}]
    with pytest.raises(openai.NotFoundError, match="names no live episode"):
        client.chat.completions.create(model="run-v1", messages=msgs)
    with pytest.raises(openai.NotFoundError, match="names no live episode"):
        client.chat.completions.create(model="run-v1:nosuchepisode", messages=msgs)
    assert client.models.list().data[0].id == ep["model"]
    client.chat.completions.create(model=ep["model"], messages=msgs)
    # Another version of the same episode: refused, and the episode is failed (it never switches versions).
    other = ep["model"].replace("run-v1:", "run-v2:")
    with pytest.raises(openai.ConflictError, match="pinned to"):
        client.chat.completions.create(model=other, messages=msgs)
    with pytest.raises(openai.APIStatusError, match="failed") as gone:
        client.chat.completions.create(model=ep["model"], messages=msgs)
    assert gone.value.status_code == 410
    record = h.svc.book.get(ep["episode_id"])
    assert record is not None and record.error is not None and record.error[0] == "model"
    assert len(record.turns) == 1  # nothing sampled for the refused calls


def test_turn_limit_unsupported_options_auth_and_finish(h: Harness) -> None:
    http = _http(h)
    client = openai.OpenAI(base_url=f"{h.svc.url}/v1", api_key=TOKEN, max_retries=0)
    ep = http.post("/v1/episodes").raise_for_status().json()
    msgs = [{"role": "user", "content": "q?"}]
    for bad, match in (
        ({"n": 2}, "n must be 1"),
        ({"temperature": 0.2}, "temperature=0.2 differs from the run's sampling.temperature=1"),
        ({"top_p": 0.9}, "top_p=0.9 differs from the run's sampling.top_p=1"),
    ):
        r = http.post("/v1/chat/completions", json={"model": ep["model"], "messages": msgs, **bad})
        assert r.status_code == 400 and match in r.json()["error"]["message"], r.text
    r = http.post("/v1/completions", json={"model": ep["model"], "prompt": "q?", "stream": True})
    assert r.status_code == 400 and "stream is supported on /v1/chat/completions only" in r.text
    # The run's own values are accepted (agents that always send them).
    http.post("/v1/chat/completions", json={"model": ep["model"], "messages": msgs, "temperature": 1.0, "top_p": 1})
    r = http.post("/v1/chat/completions", json={"model": ep["model"], "messages": [{"role": "wizard"}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages.0.role")
    unauth = httpx.post(f"{h.svc.url}/v1/chat/completions", json={"model": ep["model"], "messages": msgs})
    assert unauth.status_code == 401
    # /v1/completions with token ids (an agent rendering its own prompts); max_tokens lowers the run's budget.
    got = client.completions.create(model=ep["model"], prompt=[5, 6, 7], max_tokens=3, logprobs=0)
    assert got.usage.completion_tokens <= 3 and len(got.choices[0].logprobs.token_logprobs) <= 3
    r = http.post("/v1/completions", json={"model": ep["model"], "prompt": [5, VOCAB_SIZE]})
    assert r.status_code == 400 and f"outside [0, {VOCAB_SIZE})" in r.json()["error"]["message"]
    for _ in range(1):  # max_turns is 3: the chat call with the run's settings and the completions call were 1, 2
        client.chat.completions.create(model=ep["model"], messages=msgs)
    with pytest.raises(openai.BadRequestError, match="max_turns is 3"):
        client.chat.completions.create(model=ep["model"], messages=msgs)
    record = h.svc.book.get(ep["episode_id"])
    assert record is not None and record.error is not None and record.error[0] == "turn_limit"
    assert len(record.turns) == 3
    # The agent's finish is recorded but the failure wins: reward null, with the turn-limit message.
    r = http.post(f"/v1/episodes/{ep['episode_id']}/finish", json={"reward": 1.0})
    assert r.status_code == 200 and record.closed and record.reward is None
    r = http.post(f"/v1/episodes/{ep['episode_id']}/finish", json={"reward": 1.0})
    assert r.status_code == 410 and "finished already" in r.json()["error"]["message"]


def test_an_agent_may_name_itself_for_fair_admission_and_a_bad_name_changes_nothing(h: Harness) -> None:
    http = _http(h)
    ASKED.clear()
    bad = http.post("/v1/episodes", json={"agent": "two words"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request" and "agent" in bad.text
    assert ASKED == [] and len(h.svc.book) == 0  # refused before a group was asked for
    http.post("/v1/episodes", json={"agent": "crawler-1"}).raise_for_status()  # a group of 4
    http.post("/v1/episodes").raise_for_status()  # another agent: not crawler-1's slot (its share), a group of its own
    for _ in range(3):
        http.post("/v1/episodes", json={"agent": "crawler-1"}).raise_for_status()
    assert ASKED == ["crawler-1", None]  # crawler-1's other slots were its own: no new group asked for
    assert sorted(sum(e.assigned for e in g.episodes) for g in h.svc.book.groups()) == [1, 4]


def test_a_non_numeric_reward_from_an_agent_is_refused_and_changes_nothing(h: Harness) -> None:
    http = _http(h)
    ep = http.post("/v1/episodes").raise_for_status().json()
    for bad in ({"reward": "1.0"}, {"reward": [1]}):
        r = http.post(f"/v1/episodes/{ep['episode_id']}/finish", json=bad)
        assert r.status_code == 400, r.text
    record = h.svc.book.get(ep["episode_id"])
    assert record is not None and not record.closed


def test_a_finish_for_a_group_that_will_be_refused_as_stale_is_answered_409_with_the_reason(h: Harness) -> None:
    http = _http(h)
    eps = [http.post("/v1/episodes").raise_for_status().json() for _ in range(2)]
    r = http.post(f"/v1/episodes/{eps[0]['episode_id']}/finish", json={"reward": 1.0})
    assert r.status_code == 200 and not r.json()["group_complete"]
    STALE.append("its policy version 1 is older than the latest 9 - max_staleness 4")
    record = h.svc.book.get(eps[1]["episode_id"])
    r = http.post(f"/v1/episodes/{eps[1]['episode_id']}/finish", json={"reward": 0.5})
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "stale_group" and "max_staleness 4" in r.json()["error"]["message"]
    # Recorded all the same (the proxy's verdict on the group is what status counts).
    assert record is not None and record.closed and record.reward == 0.5


def test_the_openai_clients_streaming_call_is_served_and_recorded_like_a_plain_one(h: Harness) -> None:
    client = openai.OpenAI(base_url=f"{h.svc.url}/v1", api_key=TOKEN, max_retries=0)
    ep = _http(h).post("/v1/episodes").raise_for_status().json()
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    stream = client.chat.completions.create(
        model=ep["model"],
        messages=[{"role": "user", "content": "q?"}],
        tools=tools,  # type: ignore[list-item]
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    events = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in events if c.choices)
    logprobs = [t.logprob for c in events if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    calls = [t for c in events if c.choices for t in c.choices[0].delta.tool_calls or []]
    finish = [c.choices[0].finish_reason for c in events if c.choices and c.choices[0].finish_reason]
    usage = events[-1].usage
    record = h.svc.book.get(ep["episode_id"])
    assert record is not None and len(record.turns) == 1
    turn = record.turns[0]
    # What the stream carried is what was recorded: the sampled tokens' behaviour logprobs, their count, the text.
    assert logprobs == turn.logprobs and usage is not None and usage.completion_tokens == len(turn.completion_ids)
    assert usage.prompt_tokens == len(turn.prompt_ids)
    assert finish == ["tool_calls" if calls else ("length" if turn.finish_reason == "length" else "stop")]
    assert content == (record.final_text or "")
    assert all(c.function.name == "lookup" for c in calls)
