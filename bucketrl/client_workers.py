""":class:`~bucketrl.client.ProxyClient`'s calls about a worker rather than a run's data: a preemption drain
(``/v1/runs/{run}/workers/{id}/drain``) and its long-poll, a mixin kept apart so ``client.py`` stays under the
size rule."""

from __future__ import annotations

from typing import IO

from bucketrl.client_download import Sink
from bucketrl.client_pool import PoolClient
from bucketrl.wire.adapters import StagingList
from bucketrl.wire.metrics import DrainNotice, DrainRequest


class WorkerOpsClient(PoolClient):
    run: str  # provided by ProxyClient (declared for the type checker)

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

    def staged_uploads(self, after: int, instance: str, wait_s: float) -> StagingList:
        """Long-poll for this run's adapter uploads staged after ``after`` (counted in ``instance``); not retried."""
        params = {"after": after, "instance": instance, "wait_s": wait_s, "run": self.run}
        resp = self._request("GET", "/v1/staging", params=params, extra_timeout_s=wait_s, retry=False)
        return StagingList.model_validate(resp.json())

    def read_staged(self, upload_id: str, out: IO[bytes]) -> tuple[int, str]:
        """A staged upload's bytes into ``out`` as they arrive: (bytes, sha256). Complete only once its version is
        committed; ``Unavailable`` when the stream ends short (the publish failed) or the link drops. Not retried."""
        sink = Sink(out)
        self._request("GET", f"/v1/staging/{upload_id}", sink=sink, retry=False)
        return out.tell() - sink.start, sink.sha.hexdigest()
