"""The episodes' side of a generator: an asyncio loop in a thread of its own that serves the OpenAI-compatible
endpoint (uvicorn, loopback) and runs the environments' episodes, while the worker's main thread samples the
turns they ask for (:class:`bucketrl.envs.engine_queue.EngineQueue`).

    svc = EpisodeService(...); svc.start()          # the endpoint is up: svc.url, svc.token
    svc.start_group(group)                          # internal env: its G episodes run concurrently
    svc.queue.serve(engine, ...)                    # main thread, in its loop
    for group in svc.take_finished(): ...           # every episode closed: submit it

Failures never escape an episode: hanging past ``episode.episode_timeout_s``, asking for more than
``episode.max_turns`` turns, another model name or an agent's reported error closes that episode as ``abort``
(reward null, never trained, out of the group's statistics) with the error's kind and message (the group's
``reward_errors`` as ``episode:<kind>``; the metrics' ``episode/failed_<kind>_total``); a bad reward value or an
environment that raised (possibly its own reward) makes it unscorable instead. The group's other episodes carry on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bucketrl.envs.engine_queue import EngineQueue, TurnRequest
from bucketrl.envs.protocol import EpisodeContext, Row, is_async
from bucketrl.envs.templates import tool_syntax
from bucketrl.rollout.detokenize import complete_text
from bucketrl.rollout.engine import SampledCompletion
from bucketrl.rollout.episodes import EndpointError, Episode, EpisodeBook, GroupRun
from bucketrl.rollout.trajectory import Turn
from bucketrl.wire import RunSpec

log = logging.getLogger(__name__)

REAP_EVERY_S = 0.25


def _not_episode_threads(record: logging.LogRecord) -> bool:
    return not (record.threadName or "").startswith(("episodes", "env"))


class EpisodeService:
    def __init__(
        self,
        *,
        tokenizer: Any,
        spec: Callable[[], RunSpec],
        max_model_len: int,
        env: Any | None,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        new_external_group: Callable[[str | None], GroupRun] | None = None,
        on_episode_closed: Callable[[Episode], None] | None = None,
        stale_reason: Callable[[GroupRun], str | None] | None = None,
        env_threads: int = 64,
    ) -> None:
        self.tokenizer = tokenizer
        self.syntax = tool_syntax(tokenizer)
        self.vocab_size = len(tokenizer)
        self._spec = spec
        self.max_model_len = max_model_len
        self.env = env
        self.token = token
        self.queue = EngineQueue()
        self.book = EpisodeBook()
        self._new_external_group = new_external_group
        self._on_closed = on_episode_closed
        self._stale_reason = stale_reason  # why a group would be refused as stale now (None: it would not)
        self._finished: queue.Queue[GroupRun] = queue.Queue()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="episodes", daemon=True)
        self._threads = ThreadPoolExecutor(env_threads, thread_name_prefix="env")  # plain-def environments
        self._leaser = ThreadPoolExecutor(1, thread_name_prefix="agent-lease")
        self._tasks: set[asyncio.Task[Any]] = set()
        self._server: Any = None
        self._aclient: Any = None
        self._sclient: Any = None
        self._open_lock: asyncio.Lock | None = None
        self.stopping = False

    # -- limits (the run spec's, read when used: sampling and limits are mutable) ------------------------

    @property
    def max_turns(self) -> int:
        return self._spec().episode.max_turns

    @property
    def timeout_s(self) -> float:
        return self._spec().episode.episode_timeout_s

    def decode(self, ids: list[int]) -> str:
        return complete_text(self.tokenizer, ids)

    def live_models(self) -> list[str]:
        return [e.model for g in self.book.groups() for e in g.episodes if not e.closed]

    # -- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> None:
        # One INFO line per model turn from the environments' own clients would drown the worker's log.
        logging.getLogger("httpx").addFilter(_not_episode_threads)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._startup(), self.loop).result(timeout=60)
        log.info("OpenAI-compatible endpoint on %s/v1 (tool-call syntax %s)", self.url, self.syntax)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _startup(self) -> None:
        import uvicorn

        from bucketrl.envs.endpoint import make_app  # FastAPI: the generator imports it only for multi-turn runs

        self._open_lock = asyncio.Lock()
        # Keep-alive longer than the clients' (httpx expires idle connections after 5 s): a server that closes an
        # idle connection just as a client reuses it fails that call with a connection error.
        config = uvicorn.Config(
            make_app(self), log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=75
        )
        self._server = uvicorn.Server(config)
        self._spawn(self._server.serve(sockets=[self._sock]))
        self._spawn(self._reap())
        if self.env is not None:
            import openai

            base = f"{self.url}/v1"
            timeout = self.timeout_s + 30.0
            self._aclient = openai.AsyncOpenAI(base_url=base, api_key=self.token, max_retries=0, timeout=timeout)
            self._sclient = openai.OpenAI(base_url=base, api_key=self.token, max_retries=0, timeout=timeout)
        while not self._server.started:
            await asyncio.sleep(0.01)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def close(self) -> None:
        """Stop serving; episodes still open end as aborted (the caller releases their groups' prompts)."""
        self.stopping = True
        if not self.loop.is_running():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(timeout=10)
        self.queue.fail_all(RuntimeError("the generator is stopping"))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._leaser.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(OSError):
            self._sock.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        aclose = getattr(self.env, "aclose", None)  # what the environment holds open (servers, subprocesses)
        if aclose is not None:
            try:
                await asyncio.wait_for(aclose(), 10.0)
            except Exception:
                log.exception("closing the environment")
        for client in (self._aclient,):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.close()

    # -- groups (called from the worker's main thread) --------------------------------------------------

    def start_group(self, group: GroupRun) -> None:
        self.book.add(group)
        if not group.external:
            asyncio.run_coroutine_threadsafe(self._run_group(group), self.loop)

    def take_finished(self) -> list[GroupRun]:
        out = []
        while True:
            try:
                out.append(self._finished.get_nowait())
            except queue.Empty:
                return out

    def abort_open(self, why: str) -> list[GroupRun]:
        """Close every open episode as aborted and take every unfinished group (the caller releases them)."""

        async def _abort() -> list[GroupRun]:
            groups = [g for g in self.book.groups() if not g.handed]
            for g in groups:
                g.handed = True
                self.book.remove(g)
                for e in g.episodes:
                    e.fail("exception", why)
                    e.close()
            return groups

        if not self.loop.is_running():
            return []
        return asyncio.run_coroutine_threadsafe(_abort(), self.loop).result(timeout=10)

    # -- the episodes (on the loop) ---------------------------------------------------------------------

    async def _run_group(self, group: GroupRun) -> None:
        tasks = [self._spawn(self._run_episode(ep)) for ep in group.episodes]
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_episode(self, ep: Episode) -> None:
        assert self.env is not None
        ex = ep.group.example
        async_env = is_async(self.env)
        ctx = EpisodeContext(
            row=Row(index=ex.index, prompt=ex.prompt, answer=ex.answer, messages=ex.chat()),
            client=self._aclient if async_env else self._sclient,
            model=ep.model,
            max_turns=self.max_turns,
            episode=ep,
        )
        ep.assigned = True
        ep.stats.started = time.monotonic()
        timeout = self.timeout_s
        try:
            if async_env:
                result = await asyncio.wait_for(self.env.rollout(ctx), timeout)
            else:
                work = self.loop.run_in_executor(self._threads, self.env.rollout, ctx)
                result = await asyncio.wait_for(work, timeout)
        except TimeoutError:
            ep.fail("timeout", f"the episode ran past episode.episode_timeout_s={timeout:g}s")
        except asyncio.CancelledError:
            ep.fail("exception", "cancelled: the generator is stopping")
            self.close_episode(ep)
            raise
        except Exception as exc:
            ep.fail("exception", f"the environment raised {type(exc).__name__}: {exc}", abort=False)
        else:
            ep.finish(result)
        self.close_episode(ep)

    def close_episode(self, ep: Episode) -> None:
        if ep.close() and self._on_closed is not None:
            try:
                self._on_closed(ep)
            except Exception:
                log.exception("episode metrics")
        group = ep.group
        # A flag on the group, never a set of id()s: a finished group's id is reused by a later one (that bug left
        # 1 group in ~70 unfinished forever, each holding its version and prompt lease).
        if group.done and not group.handed:
            group.handed = True
            self.book.remove(group)
            self._finished.put(group)

    async def _reap(self) -> None:
        """External episodes past their deadline (and slots no agent took in time) end as timed out."""
        while True:
            await asyncio.sleep(REAP_EVERY_S)
            now = time.monotonic()
            for g in self.book.groups():
                if not g.external:
                    continue
                for e in g.episodes:
                    if e.closed:
                        continue
                    if e.assigned and e.deadline is not None and now > e.deadline:
                        e.fail("timeout", f"the agent's episode ran past episode.episode_timeout_s={self.timeout_s:g}s")
                        self.close_episode(e)
                    elif not e.assigned and now > g.created + self.timeout_s:
                        e.fail("timeout", f"no agent took this episode within {self.timeout_s:g}s")
                        self.close_episode(e)

    # -- turns (the endpoint's handlers) ---------------------------------------------------------------

    def _check_open(self, ep: Episode) -> None:
        if ep.closed:
            raise EndpointError(410, "episode_closed", f"episode {ep.id} is finished; start another")
        if ep.error is not None:
            raise EndpointError(410, "episode_failed", f"episode {ep.id} failed: {ep.error[1]}")
        if not ep.assigned:
            raise EndpointError(409, "episode_not_started", f"episode {ep.id} was not handed out")

    async def sample(self, ep: Episode, prompt_ids: list[int], max_tokens: int | None) -> SampledCompletion:
        """One model turn of ``ep`` from ``prompt_ids``, recorded into it."""
        self._check_open(ep)
        if ep.busy:
            raise EndpointError(409, "episode_busy", f"episode {ep.id} has a call in flight: its turns are sequential")
        limit = self.max_turns
        if len(ep.turns) >= limit:
            ep.fail("turn_limit", f"the episode asked for model turn {len(ep.turns) + 1}; episode.max_turns is {limit}")
            raise EndpointError(400, "turn_limit", ep.error[1] if ep.error else "turn limit")
        spec = self._spec()
        room = min(self.max_model_len, spec.episode.max_episode_tokens) - len(prompt_ids)
        budget = min(ep.group.sampling.max_new_tokens, max_tokens or math.inf, room)
        if budget < 1:
            ep.fail(
                "context",
                f"a prompt of {len(prompt_ids)} tokens leaves no room to sample (BUCKETRL_MAX_MODEL_LEN="
                f"{self.max_model_len}, episode.max_episode_tokens={spec.episode.max_episode_tokens})",
            )
            raise EndpointError(400, "context_length_exceeded", ep.error[1] if ep.error else "context")
        ep.busy = True
        t0 = time.monotonic()
        try:
            req = TurnRequest(prompt_ids, ep.group.adapter, int(budget), ep.group.sampling)
            sample = await asyncio.wrap_future(self.queue.put(req))
        except Exception as exc:
            raise EndpointError(500, "engine_error", f"the engine failed on this turn: {exc}") from exc
        finally:
            ep.busy = False
            ep.stats.gen_s += time.monotonic() - t0
        self._check_open(ep)  # closed while sampling (its timeout): the turn is not recorded
        ep.turns.append(Turn(prompt_ids, list(sample.token_ids), list(sample.logprobs), sample.finish_reason))
        ep.stats.turns += 1
        return sample

    # -- external agents ------------------------------------------------------------------------------

    async def open_external(self, agent: str | None = None) -> Episode:
        """An episode for an agent (``agent``: the name it sent): a free slot of an open group of the same agent,
        else the first of a new group, when admission control lets one start (else 429 ``admission``). Not another
        agent's slot: its group counts against that agent's fair share, and a slow agent between its episodes would
        see a fast one fill its group."""
        if self.stopping or self._new_external_group is None:
            raise EndpointError(503, "unavailable", "this generator is not handing out episodes", retry_after=5)
        assert self._open_lock is not None
        async with self._open_lock:  # one prompt lease at a time: a group's G slots fill before the next
            for g in self.book.groups():
                if g.external and g.agent == agent and (ep := g.unassigned()) is not None:
                    return self._assign(ep)
            group = await self.loop.run_in_executor(self._leaser, self._new_external_group, agent)
            group.agent = agent
            self.book.add(group)
            ep = group.unassigned()
            assert ep is not None
            return self._assign(ep)

    def _assign(self, ep: Episode) -> Episode:
        ep.assigned = True
        ep.stats.started = time.monotonic()
        ep.deadline = ep.stats.started + self.timeout_s
        return ep

    def finish_external(self, ep: Episode, reward: Any, error: str | None) -> None:
        if ep.closed:
            raise EndpointError(410, "episode_closed", f"episode {ep.id} is finished already")
        if not ep.assigned:
            raise EndpointError(409, "episode_not_started", f"episode {ep.id} was not handed out")
        if error:
            ep.fail("agent", f"the agent reported: {error}")
        else:
            ep.finish(reward)
        self.close_episode(ep)
        # Recorded either way (the group still goes to the proxy, whose verdict is the one counted), but the agent
        # learns now that this work will not be trained, instead of a 200 for a group about to be refused.
        why = self._stale_reason(ep.group) if self._stale_reason is not None else None
        if why:
            raise EndpointError(409, "stale_group", why)
