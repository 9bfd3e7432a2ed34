"""The submitter thread: score each generated batch, then hand it to the proxy exactly once.

The engine thread puts :class:`GeneratedBatch` objects on a bounded queue (so a proxy that pushes back
also pauses sampling); this thread, per batch:

1. decodes the completions and scores them in the :class:`bucketrl.rewards.RewardPool` (a reward that
   raises or hangs gives ``None``: unscorable, counted);
2. submits ``RolloutBatch`` with ONE idempotency key for all its attempts:
   - 202: the prompts are complete;
   - 429: waits ``Retry-After`` (accounted as ``rollout/backpressure_s``) and sends the same batch again;
   - network errors / 503: retries with backoff, same batch, same key (a lost 202 comes back as a duplicate);
   - 409 stale: dropped and counted (``rollout/dropped_stale_total``), its prompts released for reissue;
   - any other refusal (422...): logged, counted (``rollout/rejected_groups_total``), prompts released;
3. settles the batch (:meth:`Submitter.settle`, the one place a batch ends, whichever way): gives back the adapter
   versions it holds (:class:`HeldVersions`; their leases and weights may then be retired) and leaves the in-flight
   count.

The engine thread's next prompt lease rides on a submit when one is about to go out (:meth:`Submitter.
lease_with_next`): one request per engine call instead of two. The batch keeps that lease request (and its
request_id) for all its attempts, so a replayed submit answers the same prompts.

``abandon`` (set by a shutdown that ran out of time) makes it release instead of waiting any longer.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from bucketrl import errors
from bucketrl.client import ProxyClient
from bucketrl.generator.adapters import VersionBook, VersionSlot
from bucketrl.generator.episode_groups import episode_group, needs_score
from bucketrl.generator.metrics import GeneratorMetrics
from bucketrl.rewards import RewardItem, RewardPool
from bucketrl.rollout.engine import SampledCompletion
from bucketrl.rollout.episodes import Episode
from bucketrl.rollout.example import Example
from bucketrl.wire import (
    Completion,
    PromptLease,
    PromptLeaseItem,
    PromptLeaseRequest,
    RolloutBatch,
    RolloutGroup,
    SamplingSpec,
    VersionSpan,
)

log = logging.getLogger(__name__)

_STOP = object()


class HeldVersions:
    """The adapter versions a batch samples with, held on the version book (not retired, leases renewed) from the
    batch's first token until it is settled. A batch continued under a newer version (partial rollouts) holds
    each version it sampled with; it is submitted as of the newest. Given back once, whichever way the batch ends."""

    def __init__(self, book: VersionBook) -> None:
        self._book = book
        self._slots: list[VersionSlot] = []
        self._lock = threading.Lock()
        self._given_back = False

    def hold(self, version: int) -> VersionSlot:
        """Hold ``version`` (on the book) for this batch; returns its slot."""
        with self._lock:
            assert not self._given_back, "a settled batch holds no versions"
            slot = self._book.begin(version)
            self._slots.append(slot)
            return slot

    @property
    def newest(self) -> VersionSlot:
        with self._lock:
            return max(self._slots, key=lambda s: s.version)

    def versions(self) -> list[int]:
        with self._lock:
            return sorted({s.version for s in self._slots})

    def give_back(self) -> bool:
        """Give every held version back to the book; True the first time (later calls change nothing)."""
        with self._lock:
            if self._given_back:
                return False
            self._given_back = True
            slots, self._slots = self._slots, []
        for s in slots:
            self._book.end(s.version)
        return True


@dataclass
class GeneratedBatch:
    held: HeldVersions
    prompts: list[PromptLeaseItem]
    examples: list[Example]
    prompt_token_ids: list[list[int]]
    samples: list[list[SampledCompletion]]
    sampling: SamplingSpec | None = None  # what the engine sampled with (the batch records it for the trainer)
    # Multi-turn runs: each prompt's G closed episodes (``samples`` is then empty; bucketrl.envs).
    episodes: list[list[Episode]] | None = None
    # Partial rollouts: spans[i][j], the versions that sampled prompt i's completion j; None: all by ``version``.
    spans: list[list[list[VersionSpan]]] | None = None
    idempotency_key: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def version(self) -> int:
        """The batch's version on the wire: the newest it sampled with."""
        return self.held.newest.version

    @property
    def lease_id(self) -> str:
        """The lease on :attr:`version` (read at submit: the keeper may have replaced an expired one)."""
        return self.held.newest.lease_id


class PromptLedger:
    """Prompt ids this worker holds a lease on (renewed by the keeper, released at shutdown)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, PromptLeaseItem] = {}

    def add(self, items: list[PromptLeaseItem]) -> None:
        with self._lock:
            self._held.update({p.prompt_id: p for p in items})

    def remove(self, ids: list[str]) -> None:
        with self._lock:
            for i in ids:
                self._held.pop(i, None)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._held)


def well_formed(samples: list[SampledCompletion]) -> bool:
    """Every completion non-empty with one finite logprob per token (what the proxy will insist on)."""
    return all(
        s.token_ids and len(s.logprobs) == len(s.token_ids) and all(math.isfinite(lp) for lp in s.logprobs)
        for s in samples
    )


class Submitter:
    def __init__(
        self,
        *,
        client: ProxyClient,
        worker_id: str,
        pool: RewardPool,
        decode: Callable[[list[int]], str],
        ledger: PromptLedger,
        metrics: GeneratorMetrics,
        use_msgpack: bool,
        max_batches: int,
        placeholder_token: int = 0,
    ) -> None:
        self.client = client
        self.worker_id = worker_id
        self.pool = pool
        self.decode = decode
        self.ledger = ledger
        self.metrics = metrics
        self.use_msgpack = use_msgpack
        self.placeholder_token = placeholder_token  # an episode with no model turn (bucketrl.generator.episode_groups)
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=max_batches)
        self.abandon = threading.Event()
        self.groups_submitted = 0
        self.last_accepted_at: float | None = None  # perf_counter() of the latest 202 (benchmarks)
        # The proxy's counts with the latest 202: the run's trained groups and this worker's (admission control).
        self.trained_counts: tuple[int, int] | None = None
        self._unscorable_seen = 0
        # The engine thread's next lease, waiting for a submit to carry it (lease_with_next), and how many
        # batches are queued or in hand: a lease is only parked while one of them will still be submitted.
        self._lock = threading.Lock()
        self._next: tuple[PromptLeaseRequest, Future[PromptLease | None]] | None = None
        self._unsent = 0
        self._thread = threading.Thread(target=self._run, name="submitter", daemon=True)

    # -- called from the engine thread -----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def lease_with_next(self, req: PromptLeaseRequest) -> Future[PromptLease | None] | None:
        """Have the next submit lease ``req``'s prompts (``RolloutBatch.next_prompts``). None when no batch is
        waiting to be submitted (the caller leases on its own). The future's lease is None when no submit
        leased (refused, an older proxy, a failure): then the caller leases on its own too. Prompts leased
        this way are in the ledger before the future is set."""
        with self._lock:
            if self._unsent == 0 or self._next is not None or self.abandon.is_set():
                return None
            fut: Future[PromptLease | None] = Future()
            self._next = (req, fut)
            return fut

    def _take_next(self) -> tuple[PromptLeaseRequest, Future[PromptLease | None]] | None:
        with self._lock:
            nxt, self._next = self._next, None
            return nxt

    def _sent(self) -> None:
        """A batch is done with (submitted, refused or released): a parked lease no batch will carry is answered."""
        with self._lock:
            self._unsent = max(0, self._unsent - 1)
            orphan = self._next if self._unsent == 0 or self.abandon.is_set() else None
            if orphan is not None:
                self._next = None
        if orphan is not None:
            orphan[1].set_result(None)

    def put(
        self, batch: GeneratedBatch, stop: threading.Event, grace_s: float, idle: Callable[[], None] | None = None
    ) -> bool:
        """Queue a batch, waiting while the queue is full (calling ``idle`` every few tens of ms meanwhile).
        Once ``stop`` is set the wait is bounded by ``grace_s``; a batch that still does not fit is released
        (False)."""
        stopped_at: float | None = None
        while not self.abandon.is_set():
            try:
                with self._lock:
                    self._unsent += 1
                try:
                    self.queue.put(batch, timeout=0.2 if idle is None else 0.02)
                except queue.Full:
                    with self._lock:
                        self._unsent -= 1
                    raise
                return True
            except queue.Full:
                if idle is not None:
                    idle()
                if stop.is_set():
                    stopped_at = stopped_at or time.monotonic()
                    if time.monotonic() - stopped_at > grace_s:
                        break
        self.release(batch, "shutdown")
        return False

    def close(self, timeout_s: float) -> bool:
        """Finish the queued batches within ``timeout_s``; then abandon the rest (released). True if all finished."""
        deadline = time.monotonic() + timeout_s
        # A reward that is running past its deadlines with no answer would only use up the time: abandon at once
        # (a run stopped because nothing scores used to wait out the whole timeout here).
        hopeless = lambda: self.pool.hanging  # noqa: E731
        while not hopeless():
            try:
                self.queue.put(_STOP, timeout=min(0.5, max(0.05, deadline - time.monotonic())))
                break
            except queue.Full:
                if time.monotonic() >= deadline:
                    break
        while self._thread.is_alive() and not hopeless() and time.monotonic() < deadline:
            self._thread.join(min(0.5, max(0.0, deadline - time.monotonic())))
        finished = not self._thread.is_alive()
        if not finished and hopeless():
            log.warning("shutdown: the reward %s is hanging; not waiting for it", self.pool.spec.name)
        if not finished:
            self.abandon.set()
            self._thread.join(self.pool.timeout_s + 30.0)
        # Anything still queued (abandoned before it was picked up) goes back to the proxy.
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                self.release(item, "shutdown")
                self._sent()
        with self._lock:
            self._unsent = 0
        nxt = self._take_next()
        if nxt is not None:
            nxt[1].set_result(None)
        return finished

    # -- the thread ------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                item = self.queue.get(timeout=0.2)
            except queue.Empty:
                if self.abandon.is_set():
                    return  # close() gave up waiting; it releases whatever is still queued
                continue
            if item is _STOP:
                return
            try:
                if self.abandon.is_set():
                    self.release(item, "shutdown")
                else:
                    self._handle(item)
            except Exception:  # never let one batch kill the thread: release it and carry on
                log.exception("submitting a batch failed; releasing its prompts")
                self.release(item, "error")
            finally:
                self.settle(item)
                self._sent()

    def _handle(self, b: GeneratedBatch) -> None:
        if b.episodes is not None:
            self._handle_episodes(b)
            return
        items = [
            RewardItem(self.decode(s.token_ids), ex.answer, ex.prompt)
            for ex, group in zip(b.examples, b.samples, strict=True)
            for s in group
        ]
        scored = self.pool.score_detailed(items, cancel=self.abandon)
        if self.abandon.is_set():
            self.release(b, "shutdown")
            return
        self.metrics.unscorable(scored)
        rewards = iter(scored)
        groups: list[RolloutGroup] = []
        bad: list[PromptLeaseItem] = []
        spans: list[list[list[VersionSpan] | None]] = (
            [list(g) for g in b.spans] if b.spans is not None else [[None] * len(group) for group in b.samples]
        )
        for p, ids, group, group_spans in zip(b.prompts, b.prompt_token_ids, b.samples, spans, strict=True):
            group_scored = [next(rewards) for _ in group]
            if not well_formed(group):
                bad.append(p)
                continue
            completions = [
                Completion(
                    token_ids=s.token_ids,
                    logprobs=[min(lp, 0.0) for lp in s.logprobs],  # fp rounding can give +1e-8
                    reward=r.value,
                    finish_reason=s.finish_reason,
                    version_spans=sp,
                )
                for s, r, sp in zip(group, group_scored, group_spans, strict=True)
            ]
            reward_errors: dict[str, str] = {}
            for r in group_scored:
                if r.kind is not None and r.kind not in reward_errors:
                    reward_errors[r.kind] = r.message or r.kind
            groups.append(
                RolloutGroup(
                    prompt_id=p.prompt_id,
                    prompt_index=p.index,
                    prompt_token_ids=ids,
                    completions=completions,
                    reward_errors=reward_errors,
                )
            )
        if bad:
            log.error("%d group(s) had malformed samples; releasing their prompts", len(bad))
            self.metrics.add("rollout/rejected_groups_total", len(bad))
            self.release_prompts([p.prompt_id for p in bad])
        self._submit_groups(b, groups, b.examples[0].prompt, items[0].completion, scored[0].value)

    def _handle_episodes(self, b: GeneratedBatch) -> None:
        """Score the episodes left to the run's reward function (their last answer), build the groups, submit."""
        assert b.episodes is not None
        need = [(g, i) for g, eps in enumerate(b.episodes) for i, ep in enumerate(eps) if needs_score(ep)]
        items = [RewardItem(b.episodes[g][i].final_text, b.examples[g].answer, b.examples[g].prompt) for g, i in need]
        scored = self.pool.score_detailed(items, cancel=self.abandon)
        if self.abandon.is_set():
            self.release(b, "shutdown")
            return
        self.metrics.unscorable(scored)
        verdicts = dict(zip(need, scored, strict=True))
        groups: list[RolloutGroup] = []
        for g, (p, ids, eps) in enumerate(zip(b.prompts, b.prompt_token_ids, b.episodes, strict=True)):
            mine = {i: v for (gg, i), v in verdicts.items() if gg == g}
            try:
                groups.append(episode_group(p, ids, eps, mine, self.placeholder_token))
            except ValueError as exc:  # a trajectory the wire refuses: a bug to report, not a crash
                log.error("episodes of %s do not make a valid group (%s); releasing the prompt", p.prompt_id, exc)
                self.metrics.add("rollout/rejected_groups_total")
                self.release_prompts([p.prompt_id])
        ep0 = b.episodes[0][0]
        reward0 = verdicts[(0, 0)].value if (0, 0) in verdicts else ep0.reward
        self._submit_groups(b, groups, b.examples[0].prompt, ep0.final_text, reward0)

    def _submit_groups(
        self, b: GeneratedBatch, groups: list[RolloutGroup], prompt: str, completion: str, reward: float | None
    ) -> None:
        if not groups:
            return
        nxt = self._take_next()
        batch = RolloutBatch(
            worker_id=self.worker_id,
            lease_id=b.lease_id,
            version=b.version,
            groups=groups,
            sampling=b.sampling,
            next_prompts=None if nxt is None else nxt[0],
        )
        ids = [g.prompt_id for g in groups]
        outcome, leased = self._submit(batch, b.idempotency_key)
        if nxt is not None:
            if leased is not None:
                self.ledger.add(leased.prompts)
            nxt[1].set_result(leased)
        if outcome == "accepted":
            self.last_accepted_at = time.perf_counter()
            self.ledger.remove(ids)
            self.groups_submitted += len(groups)
            self.metrics.add("rollout/groups_submitted_total", len(groups))
            # One reward per episode (a split episode's samples repeat it).
            self.metrics.rewards([g.completions[idx[0]].reward for g in groups for idx in g.episodes()])
            # One completion of the batch as text, for people watching the run (the dashboard's samples).
            self.metrics.sample(b.version, prompt, completion, reward)
        else:
            self.release_prompts(ids)

    def _submit(self, batch: RolloutBatch, key: str) -> tuple[str, PromptLease | None]:
        """Submit until accepted or refused; the same key on every attempt. Returns the outcome, and the prompts
        leased with it (``batch.next_prompts``; None when none were asked for or leased)."""
        backoff = 0.5
        n = len(batch.groups)
        while True:
            try:
                answer = self.client.submit_rollouts(batch, key, use_msgpack=self.use_msgpack)
                if answer.trained_total is not None and answer.worker_trained_total is not None:
                    self.trained_counts = (answer.trained_total, answer.worker_trained_total)
                return "accepted", answer.prompts
            except errors.Backpressure as exc:
                wait = min(max(exc.retry_after or 1.0, 0.05), 30.0)
                t0 = time.monotonic()
                self.abandon.wait(wait)
                self.metrics.backpressure(time.monotonic() - t0)
            except errors.Stale as exc:
                log.info("batch of v%d is stale (%s): dropped", batch.version, exc.message)
                self.metrics.add("rollout/dropped_stale_total", n)
                return "stale", None
            except errors.Repeated as exc:  # another batch completed these prompts (leases lost): work wasted
                log.info("batch of v%d repeats completed prompts (%s): dropped", batch.version, exc.message)
                self.metrics.add("rollout/dropped_repeated_total", n)
                return "repeated", None
            except errors.Unavailable as exc:
                log.warning("proxy unavailable while submitting (%s); retrying with the same key", exc.message)
                self.abandon.wait(backoff)
                backoff = min(backoff * 2, 10.0)
            except errors.BucketRLError as exc:
                log.error("batch of v%d refused (%s %s): %s", batch.version, exc.status, exc.code, exc.message)
                self.metrics.add("rollout/rejected_groups_total", n)
                return "rejected", None
            if self.abandon.is_set():
                return "abandoned", None

    def release(self, b: GeneratedBatch, why: str) -> None:
        log.info("releasing %d prompt(s) of a v%d batch (%s)", len(b.prompts), b.version, why)
        self.release_prompts([p.prompt_id for p in b.prompts])
        self.settle(b)

    def settle(self, b: GeneratedBatch) -> None:
        """The one place a batch ends (submitted, refused, released): its versions go back to the book and its
        prompts leave the in-flight count. Once per batch, whichever paths reach it."""
        if b.held.give_back():
            self.metrics.inflight(-len(b.prompts))

    def release_prompts(self, ids: list[str]) -> None:
        if not ids:
            return
        self.ledger.remove(ids)  # stop renewing them either way
        try:
            self.client.release_prompts(self.worker_id, ids)
            self.metrics.add("rollout/released_prompts_total", len(ids))
        except errors.BucketRLError as exc:
            # Not fatal: the lease simply expires and the proxy issues the prompts again.
            log.warning("could not release %d prompt(s): %s", len(ids), exc)
