"""The staleness guard (issue 25, mixed GPU classes): a generator whose engine calls outlast the staleness window
starts no call that cannot be submitted in time, and stops sampling one that already cannot.

A group sampled at version v is accepted only while ``v >= latest - max_staleness``. On a slow GPU class a call
can span more versions than that: its group is refused stale at submit (the GPU time wasted) and its prompts sat
leased to the slow worker all along, unavailable to faster ones. The worker knows how long its own calls take (an
EWMA of their wall time) and sees how fast the run publishes versions (the announcements its version long-poll
hears), so:

- **before leasing training prompts**: when a call is expected to span more versions than the window holds
  (``call_s / version_interval_s > max(max_staleness, 1)``), the worker leases nothing (the loop evaluates
  instead, if the run asks) and warns once, naming the numbers and what to change. The interval is at least the
  time since the last version, so when the trainer slows (a fleet of slow workers alone: the trainer waits for
  their groups) the worker leases again: it never starves the run.
- **during a call** (the engine's ``while_running`` hook): once the newest version heard is past
  ``v + max_staleness`` the call's groups are certain to be refused (the latest version only grows), so the call is
  abandoned at the engine's next step and its prompts are released at once: the proxy issues them again first in
  line (its reissue list), to a faster generator, instead of after a submit the proxy would refuse. Releasing is the
  ordinary release path: the prompts were never submitted, so nothing is lost or trained twice.

A run with ``partial_rollouts`` on an engine that can continue a call (``continues_calls``) neither declines nor
abandons: its calls go on under newer versions instead (:mod:`bucketrl.generator.partial_rollouts`).

``BUCKETRL_STALENESS_GUARD=false`` turns both off (the worker then only measures: the metrics below still count).
Metrics (cumulative): ``rollout/stale_abandoned_total`` (groups whose call was abandoned),
``rollout/stale_held_prompt_s_total`` (prompt-seconds a call held prompts after their version left the window,
to the call's end or abandon); gauges ``rollout/stale_guard_declining`` (1 while leasing nothing) and
``rollout/call_s_max`` (the longest training call that ran to its end, continuations included, in seconds).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from bucketrl.generator.admission import Ewma
from bucketrl.generator.partial_rollouts import PartialResult, overtaken, sample_partial
from bucketrl.rollout.engine import StopAtStep
from bucketrl.wire.runs import versions_left

if TYPE_CHECKING:
    from bucketrl.generator.adapters import VersionBook, VersionSlot
    from bucketrl.generator.metrics import GeneratorMetrics
    from bucketrl.generator.submit import HeldVersions
    from bucketrl.rollout.engine import Engine, SampledCompletion
    from bucketrl.wire import RunSpec

log = logging.getLogger(__name__)

# How long one declined lease waits (on the leaser thread) before the guard looks again (s).
HOLD_S = 0.5
# Version arrivals the interval is averaged over, and the weight of the newest call in the call-time EWMA.
ARRIVALS = 8
CALL_EWMA = 0.3
ABANDONED_FACTOR = 2.0


class StaleCall(Exception):
    """Raised from the engine's hook: the call's version left the staleness window; its groups would be refused."""


class StalenessGuard:
    """The call-time EWMA, the version arrivals and the two decisions (thread-safe: the leaser and main threads)."""

    def __init__(
        self,
        book: VersionBook,
        spec: Callable[[], RunSpec | None],
        metrics: GeneratorMetrics,
        *,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
        switch_lag: int = 1,
    ) -> None:
        self.book, self.spec, self.metrics, self.enabled, self.clock = book, spec, metrics, enabled, clock
        self.switch_lag = switch_lag
        self.continues = False  # the engine can continue a call (set by the worker): with partial_rollouts, no guard
        self._lock = threading.Lock()
        self._call = Ewma(CALL_EWMA)  # seconds per engine call
        self._arrivals: deque[tuple[float, int]] = deque(maxlen=ARRIVALS)  # (when seen, version), after the first
        self._seen = 0
        self._closed: deque[tuple[float, int]] = deque(maxlen=64)  # the same, kept longer: when windows closed
        self.declining = False
        self._longest_s = 0.0

    @property
    def call_s(self) -> float | None:
        """The worker's seconds per engine call (EWMA; None before its first call)."""
        return self._call.value

    @call_s.setter
    def call_s(self, value: float | None) -> None:
        self._call.value = value

    # -- what the worker observes ---------------------------------------------------------------------

    def observe(self) -> None:
        """Record a version arrival (a newer one heard since the last look); cheap, called often."""
        v, now = self.heard(), self.clock()
        with self._lock:
            if v <= self._seen:
                return
            if self._seen:  # the first version seen arrived at an unknown time: no interval from it
                self._arrivals.append((now, v))
            self._closed.append((now, v))
            self._seen = v

    def heard(self) -> int:
        """The newest version this worker knows exists: announced by the proxy (its download may still run)."""
        return max(self.book.newest_known, self.book.announced)

    def interval_s(self) -> float | None:
        """Seconds per version recently, at least the time since the last one (None: fewer than two seen)."""
        now = self.clock()
        with self._lock:
            if len(self._arrivals) < 2:
                return None
            (t0, v0), (t1, v1) = self._arrivals[0], self._arrivals[-1]
            return max((t1 - t0) / max(1, v1 - v0), now - t1)

    def _window_closed_at(self, version: int, staleness: int) -> float | None:
        """When this worker first saw a version that put ``version`` out of the window (None: not yet)."""
        with self._lock:
            return next((t for t, v in self._closed if versions_left(version, v, staleness) < 0), None)

    # -- before leasing ---------------------------------------------------------------------------------

    def admits(self) -> bool:
        """False when a call started now is expected to end past the staleness window (warned once per spell)."""
        self.observe()
        spec, interval, call_s = self.spec(), self.interval_s(), self.call_s
        if not self.enabled or spec is None or interval is None or call_s is None or self.partial(spec):
            return True
        spans = call_s / max(interval, 1e-6)
        # At least 1: a strictly on-policy run's calls (max_staleness 0) end before the trainer, waiting for their
        # groups, publishes the next version; they span less than one version, which is fine.
        declining = spans > max(spec.max_staleness, 1)
        if declining and not self.declining:
            log.warning(
                "staleness guard: a call here takes %.1fs and the run publishes a version every %.1fs, so a group "
                "started now would be %.1f versions old at submit, past max_staleness=%d: leasing no training "
                "prompts (evaluating, if the run asks) until versions come slower. To sample anyway, raise the "
                "run's max_staleness, shorten calls (sampling.max_new_tokens, BUCKETRL_PROMPTS_PER_REQUEST) or set "
                "BUCKETRL_STALENESS_GUARD=false",
                call_s,
                interval,
                spans,
                spec.max_staleness,
            )
        elif self.declining and not declining:
            log.info("staleness guard: a call (%.1fs) fits the window again (a version every %.1fs)", call_s, interval)
        self.declining = declining
        self.metrics.set("rollout/stale_guard_declining", float(declining))
        return not declining

    def hold_back(self, stop_event: threading.Event) -> bool:
        """The lease's gate (on the leaser thread): True after waiting ``HOLD_S`` when the guard declines."""
        if self.admits():
            return False
        stop_event.wait(HOLD_S)
        return True

    # -- during a call ----------------------------------------------------------------------------------

    def partial(self, spec: RunSpec) -> bool:
        """Calls of this run go on under newer versions (partial rollouts) rather than being guarded."""
        return spec.partial_rollouts and self.continues

    def rollout(
        self,
        engine: Engine,
        held: HeldVersions,
        ids: list[list[int]],
        spec: RunSpec,
        hook: Callable[[], None],
        *,
        names: Sequence[str] = (),
    ) -> PartialResult:
        """A training call: :meth:`generate` under the batch's version, or, with partial rollouts, sampled across
        the versions that come meanwhile (``held`` then holds each; ``names``, the prompt ids, are logged at a cut)."""
        if not self.partial(spec):
            return PartialResult(self.generate(engine, held.newest, ids, spec, hook), None, 0)
        t0 = self.clock()

        def while_running(slot: VersionSlot) -> None:
            hook()
            self.observe()
            if overtaken(self.book, slot.version, self.heard(), spec, self.switch_lag):
                raise StopAtStep(f"v{slot.version} overtaken by v{self.heard()}: going on under the newest")

        out = sample_partial(engine, held, self.book, ids, spec, while_running, names=names)
        took = self.clock() - t0
        with self._lock:
            self._call.add(took)
        self._longest(took)
        self.metrics.add("rollout/continuations_total", out.continuations)
        return out

    def generate(
        self, engine: Engine, slot: VersionSlot, ids: list[list[int]], spec: RunSpec, hook: Callable[[], None]
    ) -> list[list[SampledCompletion]]:
        """``engine.generate`` timed, abandoned (:class:`StaleCall`) once its groups can only be refused stale."""
        t0, staleness = self.clock(), spec.max_staleness
        if not self.admits():  # leased before the guard declined (the prefetch): back at once, unsampled
            self.metrics.add("rollout/stale_abandoned_total", len(ids))
            raise StaleCall(f"a call here ({self.call_s:.1f}s) would outlast the staleness window: not started")

        def while_running() -> None:
            hook()
            self.observe()
            if self.enabled and versions_left(slot.version, newest := self.heard(), staleness) < 0:
                raise StaleCall(
                    f"v{slot.version} left the staleness window (newest v{newest}, max_staleness "
                    f"{staleness}) mid-call: its groups would be refused"
                )

        try:
            out = engine.generate(
                ids, adapter=slot.name, n=spec.group_size, sampling=spec.sampling, while_running=while_running
            )
        except StaleCall:
            self._ended(slot.version, staleness, len(ids), t0, abandoned=True)
            raise
        self._ended(slot.version, staleness, len(ids), t0, abandoned=False)
        return out

    def _longest(self, took: float) -> None:
        """The longest training call that ran to its end (continuations included): what the window must hold."""
        with self._lock:
            self._longest_s = max(self._longest_s, took)
            longest = self._longest_s
        self.metrics.set("rollout/call_s_max", longest)

    def _ended(self, version: int, staleness: int, n: int, t0: float, *, abandoned: bool) -> None:
        now = self.clock()
        took = now - t0
        with self._lock:
            # An abandoned call's time so far is a lower bound of what it would have taken: counted twice (it
            # was not done), or a call that only just missed would be tried again at once at the same rate.
            if abandoned:
                self._call.value = max(self._call.value or 0.0, ABANDONED_FACTOR * took)
            else:
                self._call.add(took)
        if not abandoned:
            self._longest(took)
        closed = self._window_closed_at(version, staleness)
        if closed is not None:
            self.metrics.add("rollout/stale_held_prompt_s_total", n * max(0.0, now - max(closed, t0)))
        if abandoned:
            self.metrics.add("rollout/stale_abandoned_total", n)
