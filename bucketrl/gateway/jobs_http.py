"""Completion jobs over the proxy, asynchronously: the gateway keeps one waiting request per job in flight.

``ProxyClient`` is synchronous (one thread per call); TRL keeps up to 128 completion requests in flight (its
``max_inflight_tasks``), each a long-poll on the proxy, so the gateway speaks the two routes it needs over one
``httpx.AsyncClient`` on its event loop instead:

- ``POST /v1/runs/{run}/completion-jobs`` (``CompletionJobRequest`` -> ``CompletionJobAccepted``): idempotent by
  ``request_id``, so a retried submit is the same job;
- ``GET /v1/runs/{run}/completion-jobs/{request_id}/result?wait_s=`` -> 200 ``CompletionJobResult``, 202 while pending,
  404 ``unknown_job`` if the proxy lost it (expired, or Redis was wiped): it is submitted again, same id.

Transient failures (transport errors, 5xx) are retried with backoff until the caller's deadline: a proxy restart
shows up as latency. Other errors are raised as :mod:`bucketrl.errors` classes, as ``ProxyClient`` does.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx

from bucketrl import errors
from bucketrl.tls import TransportSecurity
from bucketrl.wire.completion_jobs import CompletionJobAccepted, CompletionJobRequest, CompletionJobResult

MAX_BACKOFF_S = 5.0


class CompletionJobs:
    def __init__(self, proxy_url: str, run: str, token: str, *, max_connections: int = 1024) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.run = run
        security = TransportSecurity.from_env()  # the workers' rules: no plain HTTP off loopback, verified HTTPS
        security.check(proxy_url)
        self._http = httpx.AsyncClient(
            base_url=proxy_url.rstrip("/"), headers=headers, limits=limits, timeout=30.0, verify=security.verify()
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    def _path(self, suffix: str = "") -> str:
        return f"/v1/runs/{self.run}/completion-jobs{suffix}"

    async def _request(self, method: str, url: str, deadline: float, **kw: Any) -> httpx.Response:
        attempt = 0
        while True:
            try:
                resp = await self._http.request(method, url, **kw)
            except httpx.TransportError as exc:
                err: errors.BucketRLError = errors.Unavailable(f"proxy unreachable: {exc!r}")
            else:
                if resp.status_code < 400:
                    return resp
                try:
                    body: Any = resp.json()
                except ValueError:
                    body = resp.text
                err = errors.from_wire(resp.status_code, body)
            if not (err.retryable or err.status >= 500) or time.monotonic() >= deadline:
                raise err
            backoff = min(MAX_BACKOFF_S, 0.1 * 2 ** min(attempt, 10)) * (0.5 + random.random())
            await asyncio.sleep(max(0.0, min(backoff, deadline - time.monotonic())))
            attempt += 1

    async def submit(self, job: CompletionJobRequest, deadline: float) -> CompletionJobAccepted:
        resp = await self._request(
            "POST",
            self._path(),
            deadline,
            content=job.model_dump_json(),
            headers={"Content-Type": "application/json"},
        )
        return CompletionJobAccepted.model_validate(resp.json())

    async def wait(self, request_id: str, wait_s: float, deadline: float) -> CompletionJobResult | None:
        resp = await self._request(
            "GET",
            self._path(f"/{request_id}/result"),
            deadline,
            params={"wait_s": wait_s},
            timeout=httpx.Timeout(30.0, read=wait_s + 30.0),
        )
        if resp.status_code != 200:  # 202: still pending
            return None
        return CompletionJobResult.model_validate(resp.json())

    async def complete(self, job: CompletionJobRequest, timeout_s: float, wait_s: float) -> CompletionJobResult:
        """Submit and long-poll until answered; ``TimeoutError`` past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        await self.submit(job, deadline)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"completion job {job.request_id} unanswered after {timeout_s:.0f}s")
            try:
                result = await self.wait(job.request_id, min(wait_s, max(left, 0.1)), deadline)
            except errors.NotFound:
                await self.submit(job, deadline)  # the queue forgot it: the same job again
                continue
            if result is not None:
                return result
