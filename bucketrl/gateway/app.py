"""The gateway's FastAPI app: vLLM's routes, as TRL's ``AsyncGRPOTrainer`` calls them (contract: ``__init__``)."""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from bucketrl import errors
from bucketrl.client import ProxyClient
from bucketrl.gateway import publish as publishing
from bucketrl.gateway.holds import VersionHolds
from bucketrl.gateway.jobs_http import CompletionJobs
from bucketrl.gateway.names import NameBook, NameEntry
from bucketrl.gateway.settings import GatewaySettings
from bucketrl.gateway.vllm_shapes import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    LoadLoraRequest,
    UnloadLoraRequest,
    Usage,
    error_body,
    model_card,
)
from bucketrl.wire import RunSpec
from bucketrl.wire.completion_jobs import CompletionJobRequest, CompletionJobResult

log = logging.getLogger("bucketrl.gateway")


def vllm_error(message: str, err_type: str, code: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, err_type, code, param), status_code=code)


class Gateway:
    """One run: publishes through a trainer-role ``ProxyClient``; completion jobs through ``CompletionJobs``."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.client = ProxyClient(settings.proxy_url, settings.run, settings.token)
        self.spec: RunSpec = self._run_spec()
        # The gateway is the run's trainer: publishing is epoch-fenced, so it takes the epoch (a bucketrl trainer
        # still running on this run is fenced from here on, and the other way round).
        self.worker_id = f"gateway-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        self.client.register_trainer(self.worker_id)
        self.names = NameBook(settings.state_path(), settings.run)
        self.holds: VersionHolds | None = None
        if settings.lease_token:
            leaser = ProxyClient(settings.proxy_url, settings.run, settings.lease_token)
            self.holds = VersionHolds(leaser, self.worker_id)
        self.base_names = {self.spec.base_model, *settings.served_model_names}
        self.jobs = CompletionJobs(
            settings.proxy_url, settings.run, settings.token, max_connections=settings.max_connections
        )
        self._load_lock = asyncio.Lock()

    def _run_spec(self) -> RunSpec:
        """The run's spec: created or confirmed from BUCKETRL_RUN_SPEC when given (an immutable field changed: the
        proxy's 409), else read (the run must exist)."""
        path = self.settings.run_spec
        if path is None:
            return self.client.get_run().spec
        try:
            spec = RunSpec.model_validate_json(path.read_text())
        except OSError as exc:
            raise ValueError(f"BUCKETRL_RUN_SPEC {path}: cannot read it ({exc.strerror})") from None
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "the file"
            raise ValueError(f"BUCKETRL_RUN_SPEC {path}: {where}: {first['msg']}") from None
        return self.client.put_run(spec).spec

    @property
    def max_model_len(self) -> int:
        return self.settings.max_model_len or self.spec.episode.max_episode_tokens

    def resolve(self, model: str) -> tuple[bool, int | None]:
        """(known, version): the base model is version None."""
        if model in self.base_names:
            return True, None
        entry = self.names.loaded().get(model)
        return (True, entry.version) if entry is not None else (False, None)

    def server_info(self) -> dict[str, Any]:
        """The part of vLLM's resolved config TRL reads (``select_adapter_sync``), and the dtype ``get_dtype`` would."""
        # TRL requires max_loras >= max_staleness + 2. Versions are not slots here (a generator keeps what its
        # staleness window needs, evicting the oldest), so the gateway reports the most the wire allows.
        return {
            "vllm_config": {
                "model_config": {"model": self.spec.base_model, "dtype": "torch.bfloat16"},
                "lora_config": {
                    "max_lora_rank": self.settings.max_lora_rank or self.spec.lora.r,
                    "max_loras": 256,
                    "max_cpu_loras": 256,
                },
                "parallel_config": {"data_parallel_size": 1, "tensor_parallel_size": 1, "pipeline_parallel_size": 1},
            }
        }

    async def load(self, req: LoadLoraRequest) -> Response:
        if not req.lora_name or not req.lora_path:
            return vllm_error("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)
        if req.lora_name in self.base_names:
            return vllm_error(
                f"The lora adapter '{req.lora_name}' conflicts with a served base model.", "InvalidUserInput", 400
            )
        async with self._load_lock:  # one publish at a time: versions are latest+1
            try:
                tar = await asyncio.to_thread(publishing.pack_adapter, req.lora_path)
            except (errors.NotFound, errors.Invalid) as exc:
                # vLLM answers a missing directory 404, but TRL reads any 404 here as "runtime LoRA updating is
                # off" and prints that instead: a 400 carries the real reason to the user.
                return vllm_error(exc.message, "InvalidUserInput", 400)
            sha = publishing.sha256_of(tar)
            have = self.names.get(req.lora_name)
            if have is not None and not have.unloaded and have.sha256 != sha:
                return vllm_error(
                    f"The lora adapter '{req.lora_name}' has already been loaded (as version {have.version}).",
                    "InvalidUserInput",
                    400,
                )
            if have is not None and have.sha256 == sha:
                version = have.version  # a retried load: the version is committed and the name is known
            else:
                try:
                    done = await asyncio.to_thread(publishing.publish, self.client, tar)
                except errors.BucketRLError as exc:  # fenced (another trainer took the run), proxy gone...
                    return vllm_error(f"publishing failed: {exc.message}", "InternalServerError", 500)
                version = done.version
                log.info("%s -> version %d (%s)", req.lora_name, version, "adopted" if done.adopted else "published")
            self.names.put(req.lora_name, NameEntry(version=version, sha256=sha))
            if self.holds is not None:
                await asyncio.to_thread(self.holds.hold, version)
        return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", status_code=200)

    async def unload(self, req: UnloadLoraRequest) -> Response:
        if not req.lora_name:
            return vllm_error("'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput", 400)
        entry = self.names.get(req.lora_name)
        if entry is None or not self.names.unload(req.lora_name):
            return vllm_error(f"The lora adapter '{req.lora_name}' cannot be found.", "NotFoundError", 404)
        still_named = any(e.version == entry.version for e in self.names.loaded().values())
        if self.holds is not None and not still_named:
            await asyncio.to_thread(self.holds.release, entry.version)
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", status_code=200)

    async def complete(self, req: CompletionRequest) -> Response:
        known, version = self.resolve(req.model)
        if not known:
            return vllm_error(f"The model `{req.model}` does not exist.", "NotFoundError", 404, "model")
        if problem := req.unsupported():
            return vllm_error(problem, "BadRequestError", 400)
        prompts = req.prompts()
        jobs = [
            CompletionJobRequest(
                request_id=uuid.uuid4().hex,
                version=version,
                prompt_token_ids=p,
                max_tokens=req.max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                n=req.n,
                ttl_s=self.settings.completion_timeout_s,
            )
            for p in prompts
        ]
        s = self.settings
        try:
            results = await asyncio.gather(*(self.jobs.complete(j, s.completion_timeout_s, s.job_wait_s) for j in jobs))
        except TimeoutError as exc:
            return vllm_error(str(exc), "TimeoutError", 504)
        except errors.BucketRLError as exc:
            return vllm_error(exc.message, "BadRequestError" if exc.status < 500 else "InternalServerError", exc.status)
        return JSONResponse(completion_response(req, prompts, results).model_dump())


def completion_response(
    req: CompletionRequest, prompts: list[list[int]], results: list[CompletionJobResult]
) -> CompletionResponse:
    """vLLM's order: prompt i's n choices at indexes i*n .. i*n+n-1. ``tokens`` are vLLM's spelling of a token
    it cannot detokenize (``token_id:N``): the gateway holds no tokenizer."""
    choices: list[CompletionChoice] = []
    completion_tokens = 0
    for prompt, result in zip(prompts, results, strict=True):
        for c in result.choices:
            completion_tokens += len(c.token_ids)
            logprobs = CompletionLogProbs(
                token_logprobs=list(c.logprobs),
                text_offset=[0] * len(c.token_ids),
                tokens=[f"token_id:{t}" for t in c.token_ids],
                top_logprobs=[None] * len(c.token_ids),
            )
            choices.append(
                CompletionChoice(
                    index=len(choices),
                    finish_reason=c.finish_reason,
                    token_ids=list(c.token_ids) if req.return_token_ids else None,
                    prompt_token_ids=prompt if req.return_token_ids else None,
                    logprobs=logprobs if req.logprobs is not None else None,
                )
            )
    prompt_tokens = sum(len(p) for p in prompts)
    usage = Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )
    return CompletionResponse(model=req.model, choices=choices, usage=usage)


async def keep_holds(gw: Gateway) -> None:
    """Hold the versions of the names a restarted gateway still answers, then renew every lease each ttl/3."""
    assert gw.holds is not None
    for version in sorted({e.version for e in gw.names.loaded().values()}):
        await asyncio.to_thread(gw.holds.hold, version)
    while True:
        await asyncio.sleep(gw.holds.ttl_s / 3)
        await asyncio.to_thread(gw.holds.renew_all)


def create_app(settings: GatewaySettings) -> FastAPI:
    gw = Gateway(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        keeper = asyncio.create_task(keep_holds(gw)) if gw.holds is not None else None
        yield
        if keeper is not None:
            # The leases are not released: a restarted gateway holds them again, and until then they run out
            # their ttl, so a restart does not open a window in which GC takes a version TRL still names.
            keeper.cancel()
        await gw.jobs.aclose()
        gw.client.close()

    app = FastAPI(title="bucketrl gateway (vLLM-compatible, for TRL)", lifespan=lifespan)
    app.state.gateway = gw
    _routes(app, gw)
    return app


def _routes(app: FastAPI, gw: Gateway) -> None:
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        base = model_card(gw.spec.base_model, gw.max_model_len)
        loras = [
            model_card(n, None, root=f"v{e.version}", parent=gw.spec.base_model) for n, e in gw.names.loaded().items()
        ]
        return {"object": "list", "data": [base, *loras]}

    @app.get("/server_info")
    async def server_info(config_format: str = "text") -> dict[str, Any]:
        return gw.server_info()

    @app.get("/get_world_size")
    async def world_size() -> dict[str, int]:
        return {"world_size": 1}

    @app.post("/pause")
    async def pause(mode: str = "abort") -> Response:
        # Nothing to stop: versions are immutable and every request is pinned to one (docs/trl.md).
        return Response(status_code=200)

    @app.post("/resume")
    async def resume() -> Response:
        return Response(status_code=200)

    @app.post("/v1/load_lora_adapter")
    async def load(req: LoadLoraRequest) -> Response:
        return await gw.load(req)

    @app.post("/v1/unload_lora_adapter")
    async def unload(req: UnloadLoraRequest) -> Response:
        return await gw.unload(req)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, _: Request) -> Response:
        return await gw.complete(req)
