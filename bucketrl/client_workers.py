""":class:`~bucketrl.client.ProxyClient`'s calls about a worker rather than a run's data: a preemption drain
(``/v1/runs/{run}/workers/{id}/drain``) and its long-poll, a mixin kept apart so ``client.py`` stays under the
size rule."""

from __future__ import annotations

from bucketrl.client_pool import PoolClient
from bucketrl.wire.metrics import DrainNotice, DrainRequest


class WorkerOpsClient(PoolClient):
    def drain_worker(self, worker_id: str, notice_s: float) -> DrainNotice:
        """Tell a worker it will be reclaimed in ``notice_s`` (a spot-notice watcher's call; docs/faults.md)."""
        return self._json(
            "POST", self._path(f"/workers/{worker_id}/drain"), DrainNotice, DrainRequest(notice_s=notice_s)
        )

    def wait_drain(self, worker_id: str, wait_s: float = 20.0) -> DrainNotice | None:
        """Long-poll for a drain of ``worker_id``: the notice at once if one is pending, else None after ``wait_s``
        (a drain requested meanwhile answers within milliseconds)."""
        resp = self._request(
            "GET", self._path(f"/workers/{worker_id}/drain"), params={"wait_s": wait_s}, extra_timeout_s=wait_s
        )
        return None if resp.status_code == 204 else DrainNotice.model_validate(resp.json())
