"""The OpenAI-compatible endpoint answers Arabic exactly (issue 34): a turn cut inside a character by ``max_tokens``
keeps its ids (what the trainer trains on) and its text, plain or streamed, holds the incomplete bytes back (no
U+FFFD); the stream sends whole characters only, and its deltas join into the plain call's text."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from bucketrl.rollout.engine import SampledCompletion
from bucketrl.rollout.episodes import GroupRun
from bucketrl.rollout.example import Example
from bucketrl.tasks import tiny_tokenizer
from bucketrl.wire import SamplingSpec
from tests.envs.support import TOKEN, Harness, episode_spec, harness

ANSWER = "ما ناتج ٣ + ٤؟ الجواب \\boxed{٧}"
IDS = tiny_tokenizer.encode(ANSWER)
# Seven tokens end inside "ج" (its first byte, 0xd8): the text the caller gets stops before it.
CUT = 7
CUT_TEXT = "ما نات"


class ArabicWriter:
    """An engine that writes what a model trained on Arabic would: ``ANSWER``'s ids, cut by ``max_new_tokens``.
    No tiny model writes Arabic on purpose (a random one writes random bytes), so the model is emulated here; the
    endpoint, its HTTP, the tokenizer and the episode records are the real ones."""

    name = "arabic-writer"
    max_model_len = 512

    def __init__(self) -> None:
        self._adapters: list[str] = []

    def load_adapter(self, name: str, version: int, path: str | Path) -> None:
        self._adapters.append(name)

    def unload_adapter(self, name: str) -> None:
        self._adapters.remove(name)

    def loaded_adapters(self) -> list[str]:
        return list(self._adapters)

    def generate(
        self,
        prompts: list[list[int]],
        *,
        adapter: str,
        n: int,
        sampling: SamplingSpec,
        while_running: Callable[[], None] | None = None,
    ) -> list[list[SampledCompletion]]:
        ids = IDS[: sampling.max_new_tokens]
        reason = "length" if len(ids) < len(IDS) else "stop"
        one = SampledCompletion(ids, [-0.5 - i / 100 for i in range(len(ids))], reason)  # type: ignore[arg-type]
        return [[one] * n for _ in prompts]

    def close(self) -> None:
        pass


@pytest.fixture()
def h(tiny_model_dir: Path, adapter_dir: Path) -> Iterator[Harness]:
    holder: list[Harness] = []

    def new_group(_agent: str | None) -> GroupRun:
        return holder[0].group(Example(index=0, prompt="ما ناتج ٣ + ٤؟", answer="٧"), external=True)

    spec = episode_spec(tiny_model_dir)
    spec = spec.model_copy(update={"sampling": SamplingSpec(temperature=1.0, max_new_tokens=64)})
    with harness(tiny_model_dir, adapter_dir, spec, engine=ArabicWriter(), new_external_group=new_group) as hh:
        holder.append(hh)
        yield hh


def test_an_arabic_turn_cut_inside_a_character_streams_and_returns_whole_characters(h: Harness) -> None:
    assert "\ufffd" in h.svc.tokenizer.decode(IDS[:CUT])  # the cut does fall inside a character
    http = httpx.Client(base_url=h.svc.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    client = openai.OpenAI(base_url=f"{h.svc.url}/v1", api_key=TOKEN, max_retries=0)
    ep = http.post("/v1/episodes").raise_for_status().json()
    msgs = [{"role": "user", "content": "ما ناتج ٣ + ٤؟"}]
    events = list(
        client.chat.completions.create(
            model=ep["model"],
            messages=msgs,  # type: ignore[arg-type]
            max_tokens=CUT,
            logprobs=True,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta.content for c in events if c.choices and c.choices[0].delta.content]
    # Token by token, and only whole characters: no delta holds a U+FFFD, and they join into the cut text.
    assert len(deltas) > 2 and all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == CUT_TEXT
    sent = [t for c in events if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or []]
    # Every sampled token's logprob went out with its exact bytes (the last one half of "ج"), never a U+FFFD label.
    assert b"".join(bytes(t.bytes or []) for t in sent) == CUT_TEXT.encode() + b"\xd8" == ANSWER.encode()[:12]
    assert len(sent) == CUT and all("\ufffd" not in t.token for t in sent)
    record = h.svc.book.get(ep["episode_id"])
    assert record is not None and record.turns[0].completion_ids == IDS[:CUT]  # the ids the trainer trains on
    assert record.final_text == CUT_TEXT

    # The plain call and the text completion: the same text for the same ids.
    plain = client.chat.completions.create(model=ep["model"], messages=msgs, max_tokens=CUT)  # type: ignore[arg-type]
    assert plain.choices[0].message.content == CUT_TEXT and plain.choices[0].finish_reason == "length"
    text = client.completions.create(model=ep["model"], prompt="ما ناتج", max_tokens=CUT, logprobs=1)
    assert text.choices[0].text == CUT_TEXT
    logprobs = text.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.text_offset is not None
    assert all("\ufffd" not in t for t in logprobs.tokens)
    assert logprobs.text_offset[-1] <= len(CUT_TEXT)
