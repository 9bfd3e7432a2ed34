"""The agent router: one OpenAI-compatible URL in front of every generator's exposed endpoint (docs/multi-turn.md
"Many generators").

- ``POST /v1/episodes`` goes to a generator whose last handed-out group of the same agent (the ``agent`` name in
  the body, if any: a generator fills a group only with its own agent's episodes) still has free slots
  (``slots_left`` in its answer), so that groups fill one by one as with one generator (a group is trained once all
  G episodes finished: spreading a group's episodes thin would only make every group wait longer, and an agent
  would hold groups on several generators, more than its fair share), else round-robin over the generators. One
  that refuses (429 ``admission``, 503, or not reachable) is skipped for the next. When all refuse, the agent gets
  the 429 with the smallest Retry-After (a 503 when none answered 429), so it waits no longer than the first
  generator with room needs.
- Every later call of an episode (its chat and completion calls, which name it in ``model``
  ``{run}-v{N}:{episode_id}``, and ``/v1/episodes/{id}/...``) goes to the generator that handed it out: that one
  holds the episode's version, its turns and its group. The router keeps a map episode id -> generator, filled
  from the answer of ``POST /v1/episodes``, rather than rewriting episode ids: a rewritten id would have to be
  rewritten back in every answer, streamed ones included, and the agent's ids would differ from the ones in the
  generators' logs and the stored batches. The map is a cache: an episode it does not know (the router restarted,
  or the entry was evicted) is asked of each generator in turn; a generator that does not hold an episode answers
  404 before anything else happens, so asking it changes nothing, and when every generator answers 404 the agent
  gets that 404.
- Answers pass through as the generator sent them, streamed unbuffered (server-sent events of ``stream: true``).
  The router checks no token: the generators check the bearer token the router forwards (``up`` gives all of them
  one token).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from bucketrl.client import retry_after_of
from bucketrl.envs.endpoint import openai_error

log = logging.getLogger(__name__)

DNS_EVERY_S = 5.0  # generators scaled up or replaced are found within this
MAX_EPISODES = 200_000  # map entries of episodes never finished (timed out, abandoned) are evicted oldest first
REFUSED = (429, 503)  # a generator with no room now (admission control, stopping): the next one is tried
HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade"})
# An answer's headers not passed on: httpx's raw stream is still encoded, and the length is the server's to set.
ANSWER_DROPPED = HOP_HEADERS | {"content-encoding"}
# Long reads: a call waits for the generator's engine (a queue of turns) and a stream stays open while it is sent.
TIMEOUT = httpx.Timeout(connect=5.0, read=600.0, write=60.0, pool=60.0)


@dataclass
class Refused:
    status: int
    body: bytes
    retry_after: float | None


def _agent_of(body: bytes) -> str | None:
    """The agent name ``POST /v1/episodes`` sends (None: none, or a body the generator will refuse itself)."""
    try:
        agent = json.loads(body).get("agent") if body else None
    except (ValueError, AttributeError):
        return None
    return agent if isinstance(agent, str) else None


def _episode_of_model(body: bytes) -> str | None:
    """The episode id a chat or completion call names in ``model`` (``{run}-v{N}:{episode_id}``)."""
    try:
        model = json.loads(body).get("model")
    except (ValueError, AttributeError):
        return None
    return model.rpartition(":")[2] or None if isinstance(model, str) else None


class Router:
    def __init__(
        self, backends: list[str], client: httpx.AsyncClient | None = None, dns: list[str] | None = None
    ) -> None:
        if not backends and not dns:
            raise ValueError("the agent router needs generator endpoints: --backend URL or --backend-dns HOST:PORT")
        for b in backends:
            url = httpx.URL(b)
            if url.scheme not in ("http", "https") or not url.host:
                raise ValueError(f"--backend {b!r}: a generator endpoint's URL, e.g. http://gen-0:8100")
        for d in dns or []:
            host, _, port = d.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--backend-dns {d!r}: HOST:PORT, e.g. generator:8100")
        self.static = [b.rstrip("/") for b in backends]
        self.dns = dns or []  # HOST:PORT names whose addresses are the generators (Compose, a headless Service)
        self.client = client or httpx.AsyncClient(timeout=TIMEOUT)
        self.episodes: OrderedDict[str, str] = OrderedDict()
        self._round = 0
        self.backends: list[str] = []
        # Free slots of each generator's open group of each agent (by the name it sends), from its answers.
        self.slots: dict[tuple[str, str | None], int] = {}
        self.opened: dict[str, int] = {}  # episodes handed out through each generator (healthz)
        self.looked_up = 0  # calls of an episode the map did not know, asked of each generator in turn
        self.set_backends(self.static)

    def set_backends(self, backends: list[str]) -> None:
        """The generators new episodes go to (an episode already handed out stays where it is)."""
        self.backends = list(dict.fromkeys(backends))
        for b in self.backends:
            self.opened.setdefault(b, 0)

    async def resolve(self) -> None:
        """The static generators and every address the DNS names resolve to now (a name that fails keeps none)."""
        loop = asyncio.get_running_loop()
        found: list[str] = []
        for name in self.dns:
            host, _, port = name.rpartition(":")
            try:
                infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            except OSError as exc:
                log.warning("generators %s: not resolved (%s)", name, exc)
                continue
            for family, *_, addr in infos:
                ip = f"[{addr[0]}]" if family == socket.AF_INET6 else addr[0]
                found.append(f"http://{ip}:{port}")
        if set(found) - set(self.backends) or set(self.backends) - set(self.static) - set(found):
            log.info("generators: %s", ", ".join(self.static + sorted(set(found))) or "none")
        self.set_backends(self.static + sorted(set(found)))

    async def _send(self, backend: str, request: Request, body: bytes) -> httpx.Response:
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_HEADERS]
        out = self.client.build_request(
            request.method, f"{backend}{request.url.path}", params=request.query_params, headers=headers, content=body
        )
        return await self.client.send(out, stream=True)

    @staticmethod
    def _passed(resp: httpx.Response) -> StreamingResponse:
        """The generator's answer, sent on as it arrives (an SSE stream chunk by chunk)."""
        headers = {k: v for k, v in resp.headers.items() if k.lower() not in ANSWER_DROPPED}
        return StreamingResponse(
            resp.aiter_raw(), status_code=resp.status_code, headers=headers, background=BackgroundTask(resp.aclose)
        )

    def remember(self, episode_id: str, backend: str) -> None:
        self.episodes[episode_id] = backend
        self.episodes.move_to_end(episode_id)
        while len(self.episodes) > MAX_EPISODES:
            self.episodes.popitem(last=False)

    async def open_episode(self, request: Request) -> Response:
        body = await request.body()
        agent = _agent_of(body)
        refusals: list[Refused] = []
        for backend in self._open_order(agent):
            try:
                resp = await self._send(backend, request, body)
            except httpx.TransportError as exc:
                log.warning("generator %s not reachable: %s", backend, exc)
                refusals.append(Refused(503, b"", None))
                continue
            if resp.status_code in REFUSED:
                self.slots.pop((backend, agent), None)
                refusals.append(Refused(resp.status_code, await resp.aread(), retry_after_of(resp)))
                await resp.aclose()
                continue
            if resp.status_code != 200:
                return self._passed(resp)  # 401 and the like: the same at every generator
            data = await resp.aread()
            await resp.aclose()
            opened = json.loads(data)
            self.remember(opened["episode_id"], backend)
            if left := int(opened.get("slots_left", 0)):
                self.slots[(backend, agent)] = left
            else:  # only groups with room are kept: the names are the callers' to choose
                self.slots.pop((backend, agent), None)
            self.opened[backend] += 1
            return Response(data, status_code=200, media_type="application/json")
        return self._all_refused(refusals)

    def _open_order(self, agent: str | None) -> list[str]:
        """Generators with a group of ``agent`` to fill first, then all from the next in the round."""
        filling = [b for b in self.backends if self.slots.get((b, agent), 0) > 0]
        start = 0
        if not filling:  # the round moves on with each new group only
            start, self._round = self._round % max(1, len(self.backends)), self._round + 1
        rest = [self.backends[(start + i) % len(self.backends)] for i in range(len(self.backends))]
        return filling + [b for b in rest if b not in filling]

    @staticmethod
    def _all_refused(refusals: list[Refused]) -> Response:
        """The refusal that lets the agent back soonest: a 429 over a 503, the smallest Retry-After first."""
        answered = [r for r in refusals if r.status == 429] or [r for r in refusals if r.body]
        if not answered:
            return openai_error(503, "unavailable", "no generator endpoint is reachable now: try again", retry_after=5)
        best = min(answered, key=lambda r: r.retry_after if r.retry_after is not None else float("inf"))
        headers = {"Retry-After": f"{best.retry_after:.0f}"} if best.retry_after is not None else None
        return Response(best.body, status_code=best.status, headers=headers, media_type="application/json")

    async def episode_call(self, request: Request) -> Response:
        """A call of one episode: to the generator that holds it, else to each in turn until one knows it."""
        body = await request.body()
        episode_id = request.path_params.get("episode_id") or _episode_of_model(body)
        known = self.episodes.get(episode_id) if episode_id else None
        order = [known] if known else []
        self.looked_up += known is None
        order += [b for b in self.backends if b != known]
        last: httpx.Response | None = None
        for backend in order:
            try:
                resp = await self._send(backend, request, body)
            except httpx.TransportError as exc:
                if backend == known:  # its generator is gone, and with it the episode
                    return openai_error(
                        503, "generator_unavailable", f"the generator of episode {episode_id} is gone: {exc}"
                    )
                continue
            if resp.status_code != 404 or backend == order[-1]:
                if last is not None:
                    await last.aclose()
                return self._settled(episode_id, backend, request, resp)
            if last is not None:
                await last.aclose()
            last = resp
        if last is not None:
            return self._passed(last)
        return openai_error(404, "episode_not_found", f"no generator holds episode {episode_id!r}")

    def _settled(self, episode_id: str | None, backend: str, request: Request, resp: httpx.Response) -> Response:
        if episode_id:
            if request.url.path.endswith("/finish") and resp.status_code in (200, 409, 410):
                self.episodes.pop(episode_id, None)  # the episode is closed: nothing more goes to it
            elif resp.status_code != 404:
                self.remember(episode_id, backend)
        return self._passed(resp)

    async def models(self, request: Request) -> Response:
        """Every generator's live models, one list."""
        data: list[object] = []
        answered = 0
        for backend in self.backends:
            try:
                resp = await self._send(backend, request, b"")
                got = await resp.aread()
                await resp.aclose()
            except httpx.TransportError:
                continue
            if resp.status_code != 200:
                return Response(got, status_code=resp.status_code, media_type="application/json")
            data += json.loads(got).get("data", [])
            answered += 1
        if not answered:
            return openai_error(503, "unavailable", "no generator endpoint is reachable now: try again", retry_after=5)
        return JSONResponse({"object": "list", "data": data})

    async def healthz(self, _: Request) -> Response:
        return JSONResponse(
            {
                "generators": self.backends,
                "episodes_opened": self.opened,
                "episodes_known": len(self.episodes),
                "looked_up": self.looked_up,
            }
        )

    async def aclose(self) -> None:
        await self.client.aclose()


def create_app(router: Router) -> Starlette:
    async def rediscover() -> None:
        while True:
            await router.resolve()
            await asyncio.sleep(DNS_EVERY_S)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(rediscover()) if router.dns else None
        yield
        if task is not None:
            task.cancel()
        await router.aclose()

    return Starlette(
        routes=[
            Route("/v1/episodes", router.open_episode, methods=["POST"]),
            Route("/v1/episodes/{episode_id}/{action:path}", router.episode_call, methods=["GET", "POST"]),
            Route("/v1/chat/completions", router.episode_call, methods=["POST"]),
            Route("/v1/completions", router.episode_call, methods=["POST"]),
            Route("/v1/models", router.models, methods=["GET"]),
            Route("/healthz", router.healthz, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
