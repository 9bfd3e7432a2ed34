"""A worker's drain watcher (issue 25): a daemon thread long-polling ``GET .../workers/{id}/drain?wait_s=N``.

A drain reaches a worker on the answer to its heartbeat too, but only at the next one (``metrics_interval_s``, 5 s
by default): on a 30 s notice that is a sixth of it gone before anything is handed back. The long-poll is woken by
the proxy's pub/sub the moment the drain is requested, so the worker hears of it within milliseconds. Generators
and the trainer run one each; the heartbeat stays the fallback (an older proxy without the route, an outage).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from bucketrl import errors
from bucketrl.client import ProxyClient

log = logging.getLogger("bucketrl.drain_watch")

# Each long-poll waits this long (the proxy caps it at its max_wait_s); short enough to notice a stop.
WAIT_S = 20.0
# After a failed poll (an outage: the client retried within its budget), wait this long before the next.
RETRY_S = 2.0


class DrainWatch:
    """Calls ``on_drain(notice_s)`` once when a drain of ``worker_id`` is requested; ends with ``stop``.

    ``client`` is the watcher's own (its long-poll holds a connection) and is closed when the thread ends."""

    def __init__(
        self,
        client: ProxyClient,
        worker_id: str,
        on_drain: Callable[[float], None],
        stop: threading.Event,
        *,
        wait_s: float = WAIT_S,
    ) -> None:
        self.client, self.worker_id, self.on_drain, self.stop, self.wait_s = client, worker_id, on_drain, stop, wait_s
        self.unsupported = False  # the proxy has no such route: the heartbeat alone carries drains

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="drain-watch", daemon=True)
        thread.start()
        return thread

    def run(self) -> None:
        try:
            while not (self.stop.is_set() or self.unsupported):
                got = self._poll()
                if got is not None:
                    self.on_drain(got)
                    return
        finally:
            self.client.close()

    def _poll(self) -> float | None:
        try:
            notice = self.client.wait_drain(self.worker_id, self.wait_s)
        except errors.BucketRLError as exc:
            if self.stop.is_set():
                return None
            if exc.status == 405 or (exc.status == 404 and exc.code != "unknown_run"):  # an older proxy
                log.info("the proxy has no drain long-poll (%s): drains reach this worker by its heartbeat", exc)
                self.unsupported = True
                return None
            log.warning("drain long-poll failed (%s); again in %.0fs", exc.message, RETRY_S)
            self.stop.wait(RETRY_S)
            return None
        except Exception as exc:  # the client closed under a stopping worker, a socket torn down
            if not self.stop.is_set():
                log.warning("drain long-poll failed (%r); again in %.0fs", exc, RETRY_S)
                self.stop.wait(RETRY_S)
            return None
        return None if notice is None else notice.notice_s
