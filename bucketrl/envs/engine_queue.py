"""Model turns from many concurrent episodes, sampled in batches by the one thread that owns the engine.

The endpoint (asyncio, the episodes' thread) puts one :class:`TurnRequest` per chat call; the engine thread
(the worker's main thread: engines are not thread-safe) takes whatever is waiting, samples it in one engine call
per (adapter, token budget, sampling) with ``n=1`` each, and resolves the requests' futures. Requests arriving
while a call runs go into the next call, so G episodes of a group that take their turns together share one batch.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from bucketrl.rollout.engine import Engine, SampledCompletion
from bucketrl.wire import SamplingSpec


@dataclass
class TurnRequest:
    prompt_ids: list[int]
    adapter: str
    max_tokens: int
    sampling: SamplingSpec  # the group's (one setting per group: the trainer recomputes with it)
    future: Future[SampledCompletion] = field(default_factory=Future)
    queued_at: float = field(default_factory=time.monotonic)


class EngineQueue:
    def __init__(self) -> None:
        self._q: queue.Queue[TurnRequest] = queue.Queue()
        self.calls = 0
        self.busy_s = 0.0

    def put(self, req: TurnRequest) -> Future[SampledCompletion]:
        self._q.put(req)
        return req.future

    def pending(self) -> int:
        return self._q.qsize()

    def _take(self, wait_s: float) -> list[TurnRequest]:
        try:
            first = self._q.get(timeout=wait_s) if wait_s > 0 else self._q.get_nowait()
        except queue.Empty:
            return []
        out = [first]
        while True:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                return out

    def serve(
        self,
        engine: Engine,
        *,
        wait_s: float = 0.02,
        while_running: Callable[[], None] | None = None,
    ) -> int:
        """Sample everything waiting (waiting up to ``wait_s`` for the first request); returns the turns served.
        An engine error fails the requests of that call (their episodes end with it), never this thread."""
        reqs = self._take(wait_s)
        if not reqs:
            return 0
        batches: dict[tuple[str, int, str], list[TurnRequest]] = {}
        for r in reqs:
            if r.future.set_running_or_notify_cancel():
                batches.setdefault((r.adapter, r.max_tokens, r.sampling.model_dump_json()), []).append(r)
        for (adapter, max_tokens, _), batch in batches.items():
            sampling = batch[0].sampling
            t0 = time.monotonic()
            try:
                out = engine.generate(
                    [r.prompt_ids for r in batch],
                    adapter=adapter,
                    n=1,
                    sampling=sampling.model_copy(update={"max_new_tokens": max_tokens}),
                    while_running=while_running,
                )
            except Exception as exc:
                for r in batch:
                    r.future.set_exception(exc)
                continue
            finally:
                self.calls += 1
                self.busy_s += time.monotonic() - t0
            for r, samples in zip(batch, out, strict=True):
                r.future.set_result(samples[0])
        return len(reqs)

    def fail_all(self, exc: BaseException) -> None:
        """At shutdown: nothing waiting is sampled any more."""
        for r in self._take(0):
            if r.future.set_running_or_notify_cancel():
                r.future.set_exception(exc)
