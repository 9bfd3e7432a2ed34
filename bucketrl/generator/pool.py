"""Pool mode (docs/pool.md, issue 23): one engine serving several runs of one base model.

    BUCKETRL_RUNS=lr-1e4,lr-3e4 bucketrl generator        # or: bucketrl generator --runs lr-1e4,lr-3e4

Each run gets a *lane*: a :class:`~bucketrl.generator.worker.GeneratorWorker` set up for that run (its spec,
dataset, reward pool, adapter-sync thread, submitter, keeper), on the one shared engine, whose loop is not run.
The pool's own loop (the main thread, the only one touching the engine) asks ``POST /v1/pool/lease`` for the
runs whose lane has a version to sample with, and hands the prompts to the lane of the run the proxy picked.

LoRA slots: each lane sees the engine through a :class:`LaneEngine`, which counts only its run's adapters and
gives it ``max_staleness + 2`` slots (its window plus one to load the next version), so a lane never evicts
another run's adapter and never loads one it cannot keep. When the runs' windows need more slots than the
engine has (``BUCKETRL_MAX_LORAS``), :func:`plan_slots` serves the runs that fit, in the order given, and
leaves the rest to other generators (logged): a run gets fewer generators rather than every run thrashing.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from bucketrl import errors, preflight
from bucketrl.generator import startup
from bucketrl.generator.engines.factory import make_engine
from bucketrl.generator.settings import GeneratorSettings
from bucketrl.generator.worker import PROMPT_WAIT_S, GeneratorWorker
from bucketrl.rollout.engine import Engine, SampledCompletion
from bucketrl.wire import PromptLease, RunSpec
from bucketrl.wire.pool import PoolLease, PoolLeaseRequest, lora_slots_needed

log = logging.getLogger(__name__)


def slots_needed(spec: RunSpec) -> int:
    """A run's LoRA slots: its staleness window plus one to load the next version (the one-run default)."""
    return lora_slots_needed(spec.max_staleness)


def plan_slots(specs: dict[str, RunSpec], capacity: int | None) -> tuple[dict[str, int], list[str]]:
    """(slots of each run served, runs left out): runs in order while their slots fit ``capacity`` (None: all)."""
    served: dict[str, int] = {}
    left: list[str] = []
    for run, spec in specs.items():
        need = slots_needed(spec)
        if capacity is not None and sum(served.values()) + need > capacity:
            left.append(run)
        else:
            served[run] = need
    return served, left


class LaneEngine:
    """The shared engine as one run's lane sees it: its own adapters only, and its own share of the slots."""

    def __init__(self, engine: Engine, run: str, max_loras: int) -> None:
        self.engine, self.run, self.max_loras = engine, run, max_loras
        self.name = engine.name
        self.max_model_len = engine.max_model_len

    def load_adapter(self, name: str, version: int, path: str | Path) -> None:
        self.engine.load_adapter(name, version, path)

    def unload_adapter(self, name: str) -> None:
        self.engine.unload_adapter(name)

    def loaded_adapters(self) -> list[str]:
        # adapter_name is "{run}-v{N}": the run is what precedes the last "-v" (run ids may contain "-v" too).
        return [n for n in self.engine.loaded_adapters() if n.rsplit("-v", 1)[0] == self.run]

    def generate(self, prompts: list[list[int]], **kw: Any) -> list[list[SampledCompletion]]:
        return self.engine.generate(prompts, **kw)

    def close(self) -> None:
        pass  # the pool's engine, closed by the pool


class PoolGenerator:
    """One generator process serving several runs. ``run()`` blocks until stopped and returns 0."""

    def __init__(self, settings: GeneratorSettings, *, engine: Engine | None = None) -> None:
        self.settings = settings
        self.worker_id = settings.resolved_worker_id("generator")
        self.engine = engine
        self._own_engine = engine is None
        self.stop_event = threading.Event()
        self.runs = settings.pool_runs()
        self.client = settings.model_copy(update={"run": self.runs[0]}).proxy_client(settings.outage(self.worker_id))
        self.lanes: dict[str, GeneratorWorker] = {}
        self.left_out: list[str] = []

    def request_stop(self, *_: object) -> None:
        self.stop_event.set()
        for lane in self.lanes.values():
            lane.request_stop()

    def announce(self, phase: str, notes: dict[str, str] | None = None) -> None:
        """Tell each run's status what this worker is doing (a configuration error, at exit); best effort."""
        for run in self.runs:
            self.settings.model_copy(update={"run": run}).push_phase(self.worker_id, phase, notes)

    def notice_given(self, notice_s: float, why: str) -> None:
        """A preemption notice: every lane hands back its never-sampled prompts and stops within the notice."""
        self.stop_event.set()
        for lane in self.lanes.values():
            lane.notice_given(notice_s, why)

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.notice_given(self.settings.preemption_notice_s, "SIGTERM"))
        signal.signal(signal.SIGINT, self.request_stop)

    def run(self) -> int:
        spot = self.settings.spot_watch(self.notice_given, self.stop_event)  # the cloud's own notice (issue 33)
        try:
            if self._setup():
                self._loop()
        finally:
            self._shutdown()
            if spot is not None:
                spot.done()
        return 0

    def _setup(self) -> bool:
        specs: dict[str, RunSpec] = {}
        for run in self.runs:
            spec = startup.wait_for_run(self._lane_client(run), self.stop_event, run, self.settings.proxy_url)
            if spec is None:
                return False
            specs[run] = spec
        first = specs[self.runs[0]]
        if self.settings.serve_completion_jobs or any(s.env is not None for s in specs.values()):
            raise preflight.ConfigError(
                "BUCKETRL_RUNS (pool mode) serves single-turn runs' prompts only: not multi-turn runs (env) nor "
                "completion jobs yet; start those generators for one run (BUCKETRL_RUN)"
            )
        other = sorted({s.base_model for s in specs.values()} - {first.base_model})
        if other and self.settings.model_path is None:
            raise preflight.ConfigError(
                f"BUCKETRL_RUNS: one pool generator serves runs of one base model; {first.base_model!r} and {other}"
            )
        wanted = sum(slots_needed(s) for s in specs.values())
        settings = self.settings.model_copy(
            update={
                "max_loras": self.settings.max_loras or wanted,
                "max_lora_rank": self.settings.max_lora_rank or max(s.lora.r for s in specs.values()),
            }
        )
        if self.engine is None:
            self.engine = make_engine(settings, first)
        capacity = getattr(self.engine, "max_loras", None)
        slots, self.left_out = plan_slots(specs, capacity)
        if self.left_out:
            log.warning(
                "pool: %d LoRA slots hold the windows of %s only; not serving %s here (other generators do)",
                capacity,
                sorted(slots),
                self.left_out,
            )
        for run, n in slots.items():
            lane = GeneratorWorker(
                self.settings.model_copy(update={"run": run, "runs": None, "worker_id": self.worker_id}),
                client=self._lane_client(run),
                engine=LaneEngine(self.engine, run, n),
            )
            self.lanes[run] = lane
            if not lane._setup():
                return False
        log.info("pool generator %s: serving %s", self.worker_id, sorted(self.lanes))
        return True

    def _lane_client(self, run: str) -> Any:
        return self.settings.model_copy(update={"run": run}).proxy_client(self.settings.outage(self.worker_id))

    def _ready(self) -> dict[str, GeneratorWorker]:
        """The lanes with a version to sample with, within their staleness window (fetched versions loaded)."""
        ready = {}
        for run, lane in self.lanes.items():
            lane.sync_versions()
            slot = lane.book.current()
            spec = lane.spec
            fits = slot is not None and spec is not None and slot.version >= lane.book.newest_known - spec.max_staleness
            # Nor a lane whose calls outlast its run's window (staleness_guard.py): the lease goes to the other runs.
            if fits and lane.guard.admits():
                ready[run] = lane
        return ready

    def _loop(self) -> None:
        while not self.stop_event.is_set():
            ready = self._ready()
            if not ready:
                self.stop_event.wait(0.2)
                continue
            lease = self._lease(ready)
            if lease is None or lease.run not in ready:
                continue
            lane = ready[lease.run]
            prompts = lane.took(PromptLease(prompts=lease.prompts, expires_at=lease.expires_at))
            if not prompts:
                continue
            lane.sync_versions()
            slot = lane.book.current()
            if slot is None:  # cannot happen (the version sampled stays), but never sample without one
                lane.submitter.release_prompts([p.prompt_id for p in prompts])  # type: ignore[union-attr]
                continue
            lane.sample_and_hand_over(slot, prompts)

    def _lease(self, ready: dict[str, GeneratorWorker]) -> PoolLease | None:
        s = self.settings
        req = PoolLeaseRequest(
            worker_id=self.worker_id,
            runs=list(ready),
            versions={run: lane.book.newest_known for run, lane in ready.items() if lane.book.newest_known},
            n=s.prompts_per_request,
            ttl_s=s.prompt_lease_ttl_s,
            wait_s=PROMPT_WAIT_S,
            request_id=uuid.uuid4().hex,
        )
        t0 = time.monotonic()
        try:
            return self.client.pool_lease(req)
        except errors.Backpressure as exc:
            self.stop_event.wait(min(max(1.0 if exc.retry_after is None else exc.retry_after, 0.05), 30.0))
            for lane in ready.values():
                lane.metrics.backpressure((time.monotonic() - t0) / len(ready))
        except (errors.Unavailable, errors.NotFound) as exc:
            log.warning("cannot lease prompts from the pool: %s", exc.message)
            self.stop_event.wait(1.0)
        return None

    def _shutdown(self) -> None:
        self.stop_event.set()
        for lane in self.lanes.values():
            try:
                lane._shutdown()
            except Exception:
                log.exception("pool: lane %s did not shut down cleanly", lane.settings.run)
        if self.engine is not None and self._own_engine:
            self.engine.close()
        self.client.close()
