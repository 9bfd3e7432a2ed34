"""The trainer's proxy writes, run in order on one background thread while the next step computes.

Jobs run strictly in submission order, so the protocol's orderings hold: version N is committed before
the checkpoint that names it as its policy version, and a checkpoint is stored before the acks of the
deliveries it lists (TEAM.md ack protocol). The first job that fails stops the queue: later jobs are
dropped, never run out of order, and the error is raised on the training thread at its next
:meth:`check`, :meth:`submit` or :meth:`drain` (a ``Fenced`` error thus ends the trainer at once).

The queue is bounded (``max_pending``): when uploads fall behind, ``submit`` blocks the training loop
instead of buffering adapters and checkpoints without limit.

    up = Uploader()
    up.submit("publish v3", lambda: client.publish_adapter(3, snap.tar()))
    up.drain()   # wait for everything, raise the first error
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("bucketrl.trainer")

_STOP = object()


class Uploader:
    def __init__(self, max_pending: int = 4) -> None:
        self._jobs: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="bucketrl-uploader", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is _STOP:
                    return
                name, fn = job
                if self._error is None:
                    try:
                        fn()
                    except BaseException as exc:  # handed to the training thread, which decides
                        log.debug("upload job %r failed: %r", name, exc)
                        self._error = exc
            finally:
                self._jobs.task_done()

    def check(self) -> None:
        """Raise the first error of a background job, if any."""
        if self._error is not None:
            raise self._error

    def submit(self, name: str, fn: Callable[[], object]) -> None:
        self.check()
        self._jobs.put((name, fn))

    def drain(self) -> None:
        """Wait until every submitted job ran (or was dropped after an error); raise the first error."""
        self._jobs.join()
        self.check()

    def close(self) -> None:
        self._jobs.put(_STOP)
        self._thread.join(timeout=60)
