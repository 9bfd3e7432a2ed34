"""The OpenAI-compatible wire shapes the generator's endpoint speaks (the subset agents use), plus the episode
routes of external agents. Unknown request fields are accepted and ignored (agents send many: ``user``,
``metadata``, ``parallel_tool_calls``...); the ones that would change what is trained are refused or documented
in :mod:`bucketrl.envs.endpoint`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionCall(_Loose):
    name: str = Field(..., min_length=1, max_length=200)
    arguments: str | dict[str, Any] = "{}"


class ToolCallModel(_Loose):
    id: str = Field("", max_length=200)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Loose):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = Field(None, max_length=200)
    tool_calls: list[ToolCallModel] | None = Field(None, max_length=256)
    tool_call_id: str | None = Field(None, max_length=200)


class FunctionDef(_Loose):
    name: str = Field(..., min_length=1, max_length=200)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(_Loose):
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(_Loose):
    include_usage: bool = False


class ChatRequest(_Loose):
    model: str = Field(..., min_length=1, max_length=300)
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=10_000)
    tools: list[ToolDef] | None = Field(None, max_length=256)
    tool_choice: Any = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    # Sampling settings are the run's (the trainer recomputes behaviour logprobs with them): the run's values are
    # accepted, any other is refused (never silently ignored).
    temperature: float | None = None
    top_p: float | None = None


class CompletionRequest(_Loose):
    model: str = Field(..., min_length=1, max_length=300)
    # Text, or token ids (an agent that renders its own prompts).
    prompt: str | list[int] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1)
    stream: bool = False
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    temperature: float | None = None
    top_p: float | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallModel] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDelta(BaseModel):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChunkDelta
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a ``stream: true`` chat call (OpenAI's chunk format)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: CompletionLogprobs | None = None


class TextCompletion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "bucketrl"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    code: str
    param: str | None = None


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail


# -- external agents ---------------------------------------------------------------------------------


class EpisodeRow(BaseModel):
    """What an episode is about: the dataset row (its prompt, reference answer and chat messages)."""

    index: int
    prompt: str
    answer: str | None
    messages: list[dict[str, str]] | None = None


class EpisodeAsk(_Loose):
    """``POST /v1/episodes``'s optional body. ``agent``: the caller's name, so that agents sharing the endpoint's
    token are told apart by the generator's fair admission (docs/multi-turn.md "Slow agents"); without it every
    caller of the token is one agent."""

    agent: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,32}$")


class EpisodeOpen(BaseModel):
    episode_id: str
    # The name to send as ``model`` on every call of this episode: it pins the policy version.
    model: str
    version: int
    row: EpisodeRow
    max_turns: int
    timeout_s: float
    # The episode's group: the G episodes of one prompt, trained together.
    prompt_id: str
    index_in_group: int
    group_size: int = 1
    # Episodes of this group not yet handed out: a router in front of many generators sends the next new episode
    # where a group has room, so that groups fill (and are trained) one by one instead of all at once.
    slots_left: int = 0


class EpisodeFinish(_Loose):
    # None: the run's reward function scores the last assistant message. Strict: "1.0" is an error, not 1.0.
    reward: float | None = Field(None, strict=True, allow_inf_nan=False)
    # The agent's own failure, recorded as the episode's error (reward null).
    error: str | None = Field(None, max_length=2000)


class EpisodeFinished(BaseModel):
    episode_id: str
    turns: int
    group_complete: bool
