""":class:`~bucketrl.client.ProxyClient`'s generator-pool calls (docs/pool.md): a pool lease names no run in
its path (the proxy picks it by fair share), pause and resume are a run's. A mixin kept apart so ``client.py``
stays under the size rule."""

from __future__ import annotations

from bucketrl.client_jobs import CompletionJobsClient
from bucketrl.wire.pool import PoolLease, PoolLeaseRequest, PoolStatus, RunPoolStatus


class PoolClient(CompletionJobsClient):
    def pool_lease(self, req: PoolLeaseRequest) -> PoolLease:
        """Prompts of the run fair share picks; ``Backpressure`` (429) when no run of the pool grants."""
        return self._json("POST", "/v1/pool/lease", PoolLease, req, extra_timeout_s=req.wait_s)

    def pool_status(self) -> PoolStatus:
        return self._json("GET", "/v1/pool", PoolStatus)

    def pause_generation(self) -> RunPoolStatus:
        return self._json("POST", self._path("/generation/pause"), RunPoolStatus)

    def finish_generation(self) -> RunPoolStatus:
        """The run's trainer is done: its pool share goes to the other runs until a trainer registers again."""
        return self._json("POST", self._path("/generation/finish"), RunPoolStatus)

    def resume_generation(self) -> RunPoolStatus:
        return self._json("POST", self._path("/generation/resume"), RunPoolStatus)
