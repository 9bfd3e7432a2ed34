""":class:`~bucketrl.client.ProxyClient`'s completion-job calls (``/v1/runs/{run}/completion-jobs``), a mixin
kept apart so ``client.py`` stays one screenful per concern. The asker (a gateway, role trainer) submits and
waits; a generator leases and posts results."""

from __future__ import annotations

from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from bucketrl.wire.completion_jobs import (
    CompletionJobAccepted,
    CompletionJobLease,
    CompletionJobLeaseRequest,
    CompletionJobRequest,
    CompletionJobResult,
)

M = TypeVar("M", bound=BaseModel)


class CompletionJobsClient:
    # Provided by ProxyClient (declared for the type checker).
    def _path(self, suffix: str = "") -> str:
        raise NotImplementedError

    def _request(self, method: str, url: str, **kw: Any) -> httpx.Response:
        raise NotImplementedError

    def _json(self, method: str, url: str, model: type[M], body: BaseModel | None = None, **kw: Any) -> M:
        raise NotImplementedError

    def submit_completion_job(self, req: CompletionJobRequest) -> CompletionJobAccepted:
        """Queue a job; a retry (same ``request_id``, same request) is the same job."""
        return self._json("POST", self._path("/completion-jobs"), CompletionJobAccepted, req)

    def wait_completion_job(self, request_id: str, wait_s: float = 30.0) -> CompletionJobResult | None:
        """Long-poll for the job's result; None when it is still pending after ``wait_s``. ``NotFound``
        (``unknown_job``) when the proxy does not know it (never submitted, expired, or Redis was wiped)."""
        resp = self._request(
            "GET",
            self._path(f"/completion-jobs/{request_id}"),
            params={"wait_s": wait_s},
            extra_timeout_s=wait_s,
        )
        if resp.status_code != 200:
            return None
        return CompletionJobResult.model_validate(resp.json())

    def lease_completion_jobs(
        self,
        worker_id: str,
        *,
        max_jobs: int = 32,
        loaded_versions: list[int] | None = None,
        ttl_s: float = 60.0,
        wait_s: float = 0.0,
        base_model: bool = True,
    ) -> CompletionJobLease:
        req = CompletionJobLeaseRequest(
            worker_id=worker_id,
            max_jobs=max_jobs,
            loaded_versions=loaded_versions or [],
            ttl_s=ttl_s,
            wait_s=wait_s,
            base_model=base_model,
        )
        return self._json("POST", self._path("/completion-jobs/lease"), CompletionJobLease, req, extra_timeout_s=wait_s)

    def post_completion_result(self, result: CompletionJobResult) -> CompletionJobAccepted:
        """Answer a job; a job answered before (by anyone) answers the same and keeps the first result."""
        return self._json(
            "POST", self._path(f"/completion-jobs/{result.request_id}/result"), CompletionJobAccepted, result
        )
