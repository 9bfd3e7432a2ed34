"""The generator's OpenAI-compatible endpoint: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, and
the episode routes of external agents (``POST /v1/episodes``, ``POST /v1/episodes/{id}/finish``).

Every call names an episode in ``model`` (``{run}-v{N}:{episode_id}``) and is sampled with that episode's policy
version and the run's sampling settings (the trainer recomputes behaviour logprobs with them, so a request's
``temperature``/``top_p`` other than the run's are refused with a 400 naming both, never silently ignored;
``max_tokens`` only lowers the run's ``sampling.max_new_tokens``). ``stream: true`` on chat calls answers
server-sent events (:mod:`bucketrl.envs.streaming`; the turn is recorded as for a plain call). A chat
call is rendered with the model's chat template (``tools=`` included), its tool calls parsed into OpenAI
``tool_calls`` (:mod:`bucketrl.envs.parsers`), and its exact prompt ids, sampled ids and behaviour logprobs are
recorded into the episode. Refused: ``stream`` on ``/v1/completions``, ``n`` > 1, ``echo``, concurrent calls of
one episode, a model name of another episode or version (that fails the episode), calls past ``episode.max_turns``
(fails it too) or past the context (``BUCKETRL_MAX_MODEL_LEN``, ``episode.max_episode_tokens``). A finish whose
group is already too stale to be trained answers 409 ``stale_group`` with the reason (the episode is recorded all
the same). ``POST /v1/episodes`` (an optional body ``{"agent": name}`` names the caller for fair admission) past the
generator's admission control answers 429 ``admission`` with Retry-After (:mod:`bucketrl.generator.admission`).
Auth: ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import hmac
import time
import uuid
from typing import Any, Literal, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from bucketrl.envs import openai_models as om
from bucketrl.envs.parsers import parse
from bucketrl.envs.streaming import Delta, content_deltas, stream_response
from bucketrl.envs.templates import ToolSyntax, render
from bucketrl.rollout.detokenize import IncrementalDetokenizer, token_bytes, token_label
from bucketrl.rollout.engine import SampledCompletion
from bucketrl.rollout.episodes import EndpointError, Episode, EpisodeBook


class EpisodeHub(Protocol):
    """What the routes use of the episodes' side of a generator (:class:`bucketrl.envs.service.EpisodeService`)."""

    token: str
    book: EpisodeBook
    tokenizer: Any
    syntax: ToolSyntax
    vocab_size: int

    @property
    def max_turns(self) -> int: ...

    @property
    def timeout_s(self) -> float: ...

    def decode(self, ids: list[int]) -> str: ...

    def live_models(self) -> list[str]: ...

    async def sample(self, ep: Episode, prompt_ids: list[int], max_tokens: int | None) -> SampledCompletion: ...

    async def open_external(self, agent: str | None) -> Episode: ...

    def finish_external(self, ep: Episode, reward: Any, error: str | None) -> None: ...


def openai_error(status: int, code: str, message: str, retry_after: float | None = None) -> JSONResponse:
    """An error in OpenAI's shape (the agent router answers in it too), with ``Retry-After`` when given."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = om.OpenAIError(error=om.OpenAIErrorDetail(message=message, type=kind, code=code))
    headers = {"Retry-After": f"{max(0.0, retry_after):.0f}"} if retry_after is not None else None
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def make_app(hub: EpisodeHub) -> FastAPI:
    app = FastAPI(title="bucketrl generator endpoint (OpenAI-compatible)", docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Any:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {hub.token}".encode()):
            return openai_error(401, "invalid_api_key", "missing or wrong bearer token (see endpoint.json)")
        return await call_next(request)

    @app.exception_handler(EndpointError)
    async def _refused(_: Request, exc: EndpointError) -> JSONResponse:
        return openai_error(exc.status, exc.code, exc.message, exc.retry_after)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid body"}
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        return openai_error(400, "invalid_request", f"{where}: {first['msg']}")

    @app.get("/v1/models", response_model=om.ModelList)
    async def models() -> om.ModelList:
        return om.ModelList(data=[om.ModelCard(id=m) for m in hub.live_models()[:1000]])

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: om.ChatRequest) -> om.ChatCompletion | StreamingResponse:
        done, deltas = await _chat_completion(hub, req)
        if req.stream:
            return stream_response(done, bool(req.stream_options and req.stream_options.include_usage), deltas)
        return done

    @app.post("/v1/completions", response_model=om.TextCompletion)
    async def completions(req: om.CompletionRequest) -> om.TextCompletion:
        return await _text_completion(hub, req)

    @app.post("/v1/episodes", response_model=om.EpisodeOpen)
    async def open_episode(ask: om.EpisodeAsk | None = None) -> om.EpisodeOpen:
        ep = await hub.open_external(ask.agent if ask is not None else None)
        return _opened(hub, ep)

    @app.post("/v1/episodes/{episode_id}/finish", response_model=om.EpisodeFinished)
    async def finish_episode(episode_id: str, body: om.EpisodeFinish) -> om.EpisodeFinished:
        ep = hub.book.get(episode_id)
        if ep is None or not ep.group.external:
            raise EndpointError(404, "episode_not_found", f"no live external episode {episode_id!r}")
        hub.finish_external(ep, body.reward, body.error)
        return om.EpisodeFinished(episode_id=ep.id, turns=len(ep.turns), group_complete=ep.group.done)

    return app


async def _chat_completion(hub: EpisodeHub, req: om.ChatRequest) -> tuple[om.ChatCompletion, list[Delta] | None]:
    """One model turn of the episode ``req.model`` names, from chat messages (tool calls parsed out), and for a
    stream the content token by token (None when tool calls were taken out of the text)."""
    _plain(req.n, False)
    ep = hub.book.episode_for(req.model)
    _run_sampling(ep, req.temperature, req.top_p)
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    try:
        prompt_ids = render(hub.tokenizer, messages, tools)
    except Exception as exc:  # jinja errors: the template refused these messages
        raise EndpointError(400, "chat_template", f"the chat template cannot render these messages: {exc}") from exc
    sample = await hub.sample(ep, prompt_ids, req.max_completion_tokens or req.max_tokens)
    text = hub.decode(sample.token_ids)
    parsed = parse(text, hub.syntax, [t.function.name for t in req.tools or []])
    ep.stats.tool_calls += len(parsed.calls)
    ep.stats.malformed_calls += parsed.malformed
    ep.stats.tool_errors += parsed.malformed
    ep.final_text = parsed.content or ""
    calls = [
        om.ToolCallModel(id=c.id, function=om.FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed.calls
    ] or None
    finish: Literal["stop", "length", "tool_calls"]
    finish = "tool_calls" if calls else ("length" if sample.finish_reason == "length" else "stop")
    logprobs = _chat_logprobs(hub, sample.token_ids, sample.logprobs) if req.logprobs else None
    deltas = None
    if req.stream and not calls and (parsed.content or "") == text:
        deltas = content_deltas(hub.tokenizer, sample.token_ids, logprobs)
    done = om.ChatCompletion(
        id=f"chatcmpl-{uuid.uuid4().hex[:24]}",
        created=int(time.time()),
        model=ep.model,
        choices=[
            om.ChatChoice(
                message=om.AssistantMessage(content=parsed.content, tool_calls=calls),
                finish_reason=finish,
                logprobs=logprobs,
            )
        ],
        usage=_usage(prompt_ids, sample.token_ids),
    )
    return done, deltas


async def _text_completion(hub: EpisodeHub, req: om.CompletionRequest) -> om.TextCompletion:
    """One model turn of the episode ``req.model`` names, from a text or token-id prompt."""
    _plain(req.n, req.stream)
    if req.echo:
        raise EndpointError(400, "unsupported", "echo is not supported")
    ep = hub.book.episode_for(req.model)
    _run_sampling(ep, req.temperature, req.top_p)
    prompt_ids = _completion_prompt_ids(hub, req)
    sample = await hub.sample(ep, prompt_ids, req.max_tokens)
    text = hub.decode(sample.token_ids)
    ep.final_text = text
    logprobs = _text_logprobs(hub, sample.token_ids, sample.logprobs) if req.logprobs is not None else None
    return om.TextCompletion(
        id=f"cmpl-{uuid.uuid4().hex[:24]}",
        created=int(time.time()),
        model=ep.model,
        choices=[
            om.CompletionChoice(
                text=text, finish_reason="length" if sample.finish_reason == "length" else "stop", logprobs=logprobs
            )
        ],
        usage=_usage(prompt_ids, sample.token_ids),
    )


def _completion_prompt_ids(hub: EpisodeHub, req: om.CompletionRequest) -> list[int]:
    """A completion request's prompt as token ids (a text prompt tokenized without special tokens)."""
    if isinstance(req.prompt, str):
        prompt_ids = [int(t) for t in hub.tokenizer.encode(req.prompt, add_special_tokens=False)]
    else:
        prompt_ids = list(req.prompt)
        bad = [t for t in prompt_ids if not 0 <= t < hub.vocab_size]
        if bad:
            raise EndpointError(400, "invalid_prompt", f"prompt token id {bad[0]} is outside [0, {hub.vocab_size})")
    if not prompt_ids:
        raise EndpointError(400, "invalid_prompt", "the prompt has no tokens")
    return prompt_ids


def _text_logprobs(hub: EpisodeHub, token_ids: list[int], logprobs: list[float]) -> om.CompletionLogprobs:
    """Each token as its bytes spell it (``bytes:\\xd8`` for part of a character, never U+FFFD), at the offset of
    the text before it (a token inside a character is at the offset where that character starts)."""
    detok = IncrementalDetokenizer(hub.tokenizer)
    offsets = []
    for t in token_ids:
        offsets.append(len(detok.text))
        detok.step(t)
    pieces = [token_label(token_bytes(hub.tokenizer, t)) for t in token_ids]
    return om.CompletionLogprobs(tokens=pieces, token_logprobs=list(logprobs), text_offset=offsets)


def _plain(n: int, stream: bool) -> None:
    if n != 1:
        raise EndpointError(400, "unsupported", "n must be 1: an episode is one trajectory (start G episodes instead)")
    if stream:
        raise EndpointError(400, "unsupported", "stream is supported on /v1/chat/completions only; send stream=false")


def _run_sampling(ep: Episode, temperature: float | None, top_p: float | None) -> None:
    """A request's sampling settings must be the run's: the trainer recomputes behaviour logprobs with those."""
    run = ep.group.sampling
    for name, asked, used in (("temperature", temperature, run.temperature), ("top_p", top_p, run.top_p)):
        if asked is not None and abs(asked - used) > 1e-6:
            raise EndpointError(
                400,
                "unsupported_sampling",
                f"{name}={asked:g} differs from the run's sampling.{name}={used:g}: every turn is sampled with the "
                f"run's settings (the trainer recomputes behaviour logprobs with them); omit {name} or send {used:g}",
            )


def _usage(prompt_ids: list[int], completion_ids: list[int]) -> om.Usage:
    return om.Usage(
        prompt_tokens=len(prompt_ids),
        completion_tokens=len(completion_ids),
        total_tokens=len(prompt_ids) + len(completion_ids),
    )


def _chat_logprobs(hub: EpisodeHub, ids: list[int], logprobs: list[float]) -> om.ChoiceLogprobs:
    out = []
    for t, lp in zip(ids, logprobs, strict=True):
        raw = token_bytes(hub.tokenizer, t)  # OpenAI's bytes: exact even where a token ends inside a character
        out.append(om.TokenLogprob(token=token_label(raw), logprob=lp, bytes=list(raw)))
    return om.ChoiceLogprobs(content=out)


def _opened(hub: EpisodeHub, ep: Episode) -> om.EpisodeOpen:
    ex = ep.group.example
    return om.EpisodeOpen(
        episode_id=ep.id,
        model=ep.model,
        version=ep.group.version,
        row=om.EpisodeRow(index=ex.index, prompt=ex.prompt, answer=ex.answer, messages=ex.chat()),
        max_turns=hub.max_turns,
        timeout_s=hub.timeout_s,
        prompt_id=ep.group.prompt.prompt_id,
        index_in_group=ep.index,
        group_size=len(ep.group.episodes),
        slots_left=sum(1 for e in ep.group.episodes if not e.assigned and not e.closed),
    )
