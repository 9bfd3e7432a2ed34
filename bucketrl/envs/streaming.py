"""``stream: true`` on ``/v1/chat/completions``: the turn is sampled whole (it is recorded exactly as a plain call's:
prompt ids, sampled ids, behaviour logprobs), then sent as server-sent events in OpenAI's chunk format, so that
agent frameworks that stream by default (the OpenAI Agents SDK, LangGraph, smolagents) work unchanged.

The events: the role, the content with its tokens' logprobs (when asked), the tool calls (each whole, with its
``index``), the finish reason, the usage (with ``stream_options.include_usage``), then ``data: [DONE]``. A call
the endpoint refuses is refused before the stream starts, as a plain JSON error with its status.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from fastapi.responses import StreamingResponse

from bucketrl.envs import openai_models as om

FinishReason = Literal["stop", "length", "tool_calls"]


def _event(chunk: om.ChatCompletionChunk) -> str:
    return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"


def chunks(done: om.ChatCompletion, include_usage: bool) -> Iterator[str]:
    """The events of a sampled turn ``done``."""
    choice = done.choices[0]

    def chunk(
        delta: om.ChunkDelta, finish: FinishReason | None = None, logprobs: om.ChoiceLogprobs | None = None
    ) -> om.ChatCompletionChunk:
        one = om.ChunkChoice(delta=delta, finish_reason=finish, logprobs=logprobs)
        return om.ChatCompletionChunk(id=done.id, created=done.created, model=done.model, choices=[one])

    yield _event(chunk(om.ChunkDelta(role="assistant", content="")))
    if choice.message.content or choice.logprobs is not None:
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


def stream_response(done: om.ChatCompletion, include_usage: bool) -> StreamingResponse:
    return StreamingResponse(chunks(done, include_usage), media_type="text/event-stream")
