"""``stream: true`` on ``/v1/chat/completions``: the turn is sampled whole (it is recorded exactly as a plain call's:
prompt ids, sampled ids, behaviour logprobs), then sent as server-sent events in OpenAI's chunk format, so that
agent frameworks that stream by default (the OpenAI Agents SDK, LangGraph, smolagents) work unchanged.

The events: the role, the content, the tool calls (each whole, with its ``index``), the finish reason, the usage
(with ``stream_options.include_usage``), then ``data: [DONE]``. A call the endpoint refuses is refused before the
stream starts, as a plain JSON error with its status.

The content goes out token by token as vLLM streams it (:func:`content_deltas`): each event carries the characters
its tokens completed and those tokens' logprobs (when asked), never part of a character (a token that ends inside
one waits for the next), so the deltas joined are the plain call's text. A turn whose text held tool calls is sent
as one content event (its content is the text with the calls taken out, which no token boundary maps to).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from fastapi.responses import StreamingResponse

from bucketrl.envs import openai_models as om
from bucketrl.rollout.detokenize import IncrementalDetokenizer

FinishReason = Literal["stop", "length", "tool_calls"]


def _event(chunk: om.ChatCompletionChunk) -> str:
    return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"


# A content event: the text some tokens completed and those tokens' logprobs (None when not asked).
Delta = tuple[str, list[om.TokenLogprob] | None]


def content_deltas(tokenizer: Any, token_ids: list[int], logprobs: om.ChoiceLogprobs | None) -> list[Delta]:
    """The content events of a turn's tokens: one per token that completes text, carrying the logprobs of the tokens
    since the previous event; tokens after the last text (an incomplete character, the end-of-turn token) in a last
    event with no text, when logprobs are asked (else nothing is left to say)."""
    detok = IncrementalDetokenizer(tokenizer)
    out: list[Delta] = []
    waiting: list[om.TokenLogprob] = []
    entries = logprobs.content if logprobs is not None else [None] * len(token_ids)
    for tid, entry in zip(token_ids, entries, strict=True):
        if entry is not None:
            waiting.append(entry)
        text = detok.step(tid)
        if text:
            out.append((text, waiting if logprobs is not None else None))
            waiting = []
    if waiting:
        out.append(("", waiting))
    return out


def chunks(done: om.ChatCompletion, include_usage: bool, deltas: list[Delta] | None = None) -> Iterator[str]:
    """The events of a sampled turn ``done``; its content as ``deltas`` when given (else as one event)."""
    choice = done.choices[0]

    def chunk(
        delta: om.ChunkDelta, finish: FinishReason | None = None, logprobs: om.ChoiceLogprobs | None = None
    ) -> om.ChatCompletionChunk:
        one = om.ChunkChoice(delta=delta, finish_reason=finish, logprobs=logprobs)
        return om.ChatCompletionChunk(id=done.id, created=done.created, model=done.model, choices=[one])

    yield _event(chunk(om.ChunkDelta(role="assistant", content="")))
    if deltas is not None:
        for text, entries in deltas:
            logprobs = om.ChoiceLogprobs(content=entries) if entries is not None else None
            yield _event(chunk(om.ChunkDelta(content=text), logprobs=logprobs))
    elif choice.message.content or choice.logprobs is not None:
        yield _event(chunk(om.ChunkDelta(content=choice.message.content or ""), logprobs=choice.logprobs))
    if choice.message.tool_calls:
        calls = [
            om.ToolCallDelta(index=i, id=c.id, function=c.function) for i, c in enumerate(choice.message.tool_calls)
        ]
        yield _event(chunk(om.ChunkDelta(tool_calls=calls)))
    yield _event(chunk(om.ChunkDelta(), finish=choice.finish_reason))
    if include_usage:
        yield _event(
            om.ChatCompletionChunk(id=done.id, created=done.created, model=done.model, choices=[], usage=done.usage)
        )
    yield "data: [DONE]\n\n"


def stream_response(
    done: om.ChatCompletion, include_usage: bool, deltas: list[Delta] | None = None
) -> StreamingResponse:
    return StreamingResponse(chunks(done, include_usage, deltas), media_type="text/event-stream")
