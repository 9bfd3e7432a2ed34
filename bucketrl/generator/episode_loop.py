"""The generator's loop for multi-turn runs (run spec ``env``): episodes instead of single completions.

The worker's main thread keeps owning the engine. Each pass it loads fetched versions, starts groups (the G
episodes of a leased prompt, pinned to the newest loaded version, run concurrently by the environment on the
episodes' thread, :mod:`bucketrl.envs.service`) while fewer than ``BUCKETRL_EPISODE_GROUPS`` are in flight, samples
every turn the episodes asked for in one batched engine call, and hands finished groups to the submitter. Each
group holds ``book.begin`` on its version from start to submit, so that version's lease is renewed and its weights
stay loaded for the whole episode; its prompt lease is renewed by the keeper as before.

With ``BUCKETRL_OPENAI_PORT`` the endpoint is exposed and agents outside the generator take episodes (``POST
/v1/episodes``): each prompt leased for them is one group of G episodes, handed out one by one and submitted when
all G finished (or timed out). Its URL and token go to ``BUCKETRL_ENDPOINT_FILE``.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from bucketrl import errors
from bucketrl.client import ProxyClient
from bucketrl.envs.files import merge_json_file
from bucketrl.envs.loader import make_env
from bucketrl.envs.protocol import EXTERNAL
from bucketrl.envs.service import EpisodeService
from bucketrl.generator.adapters import VersionBook
from bucketrl.generator.admission import ENV, Admission, Limits, OpenGroup, agent_source
from bucketrl.generator.metrics import GeneratorMetrics
from bucketrl.generator.settings import GeneratorSettings
from bucketrl.generator.submit import GeneratedBatch, HeldVersions, PromptLedger, Submitter
from bucketrl.rollout.engine import Engine
from bucketrl.rollout.episodes import EndpointError, GroupRun
from bucketrl.rollout.example import Example
from bucketrl.wire import PromptLeaseItem, RunSpec
from bucketrl.wire.runs import versions_left

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.02
AGENT_LEASE_WAIT_S = 2.0
STALE_WARN_EVERY_S = 30.0


class EpisodeHost(Protocol):
    """What the driver uses of the generator worker that runs it
    (:class:`~bucketrl.generator.worker.GeneratorWorker` is one): its run, engine and books, and the four steps
    it shares with the single-turn loop."""

    settings: GeneratorSettings
    worker_id: str
    client: ProxyClient
    spec: RunSpec | None
    engine: Engine | None
    tokenizer: Any
    examples: list[Example]
    metrics: GeneratorMetrics
    book: VersionBook
    ledger: PromptLedger
    submitter: Submitter | None
    stop_event: threading.Event
    leaser: ThreadPoolExecutor  # runs lease_prompts off the main thread

    def sync_versions(self) -> None:
        """Load fetched versions, retire unused ones (between engine steps and during waits)."""

    def budget(self) -> int | None:
        """Groups still allowed under ``max_groups`` (None = unlimited)."""

    def lease_prompts(self, n: int) -> list[PromptLeaseItem]:
        """Lease up to ``n`` training prompts (in flight from now on); [] when the proxy had none."""

    def prompt_ids(self, index: int) -> list[int]:
        """The token ids of the dataset's prompt ``index``."""


class EpisodeDriver:
    def __init__(self, worker: EpisodeHost) -> None:
        w = self.w = worker
        s, spec = w.settings, w.spec
        assert spec is not None and spec.env is not None and w.engine is not None
        env = None if spec.env.name == EXTERNAL else make_env(spec.env.name, spec.env.kwargs)
        self.exposed = s.openai_port is not None
        self.svc = EpisodeService(
            tokenizer=w.tokenizer,
            spec=lambda: w.spec,  # type: ignore[arg-type,return-value]
            max_model_len=w.engine.max_model_len,
            env=env,
            token=s.openai_token or secrets.token_urlsafe(24),
            host=s.openai_host if self.exposed else "127.0.0.1",
            port=s.openai_port or 0,
            new_external_group=self._external_group if self.exposed else None,
            on_episode_closed=w.metrics.episode,
            stale_reason=self._stale_reason,
        )
        self.target = s.episode_groups or s.prompts_per_request
        self._lease: tuple[Future[list[PromptLeaseItem]], int] | None = None
        self._stale_warned = -math.inf
        self.admission = Admission(s.max_open_episodes)
        # The main loop (the environment's groups, hand-overs) and the agent-lease thread (agents' asks) share it.
        self._admission_lock = threading.Lock()
        # Each open group's versions, by prompt id (the two threads pin; single dict operations, atomic).
        self._held: dict[str, HeldVersions] = {}

    def start(self) -> None:
        self.svc.start()
        if self.svc.env is None and not self.exposed:
            log.warning("env is 'external' but this generator exposes no endpoint (BUCKETRL_OPENAI_PORT): idle")
        if self.exposed and self.w.settings.endpoint_file:
            self._write_endpoint_file(Path(self.w.settings.endpoint_file))

    def _write_endpoint_file(self, path: Path) -> None:
        """Merge ``{"openai": {...}}`` into the JSON file (``bucketrl up``'s <dir>/endpoint.json also holds the
        proxy's address, written by ``up``)."""
        info = {
            "base_url": f"{self.svc.url}/v1",
            "token": self.svc.token,
            "episodes_url": f"{self.svc.url}/v1/episodes",
            "run": self.w.settings.run,
            "worker_id": self.w.worker_id,
        }
        merge_json_file(path, {"openai": info})
        log.info("endpoint for agents: %s (token in %s)", info["base_url"], path)

    # -- the main thread's loop -----------------------------------------------------------------------

    def loop(self) -> None:
        w = self.w
        try:
            while not w.stop_event.is_set():
                w.sync_versions()
                self._measure()
                self._start_groups()
                self.svc.queue.serve(w.engine, wait_s=IDLE_POLL_S, while_running=w.sync_versions)  # type: ignore[arg-type]
                self._hand_over()
                if self._done():
                    assert w.submitter is not None
                    log.info("submitted %d groups (max_groups): stopping", w.submitter.groups_submitted)
                    break
        finally:
            self._drain()

    def _done(self) -> bool:
        budget = self.w.budget()
        return budget is not None and budget <= 0 and len(self.svc.book) == 0 and self._lease is None

    def _slot_ok(self) -> bool:
        w = self.w
        slot = w.book.current()
        assert w.spec is not None
        return slot is not None and versions_left(slot.version, w.book.newest_known, w.spec.max_staleness) >= 0

    def _measure(self) -> None:
        """Feed admission control the trainer's pace and the proxy's counts; publish its gauges."""
        w = self.w
        assert w.spec is not None and w.submitter is not None
        with self._admission_lock:
            self.admission.on_version(w.book.newest_known, w.spec.groups_per_step, w.spec.max_staleness)
            if (counts := w.submitter.trained_counts) is not None:
                self.admission.on_trained(*counts)
            gauges = self.admission.gauges()
        for name, value in gauges.items():
            w.metrics.set(name, value)

    def _limits(self) -> Limits:
        spec = self.w.spec
        assert spec is not None
        return Limits(spec.group_size, spec.groups_per_step, spec.max_staleness, self.target)

    def _open_groups(self) -> list[OpenGroup]:
        now = time.monotonic()
        return [OpenGroup(g.source, g.version, now - g.created) for g in self.svc.book.groups()]

    def _room(self, source: str) -> int:
        """New groups of ``source`` admission control lets start now (docs/multi-turn.md "Slow agents")."""
        w = self.w
        slot = w.book.current()
        assert slot is not None
        has_env = self.svc.env is not None
        return self.admission.room(
            source, self._open_groups(), slot.version, w.book.newest_known, self._limits(), has_env=has_env
        )

    def _stale_reason(self, group: GroupRun) -> str | None:
        """Why the proxy will refuse ``group`` as stale (what its agent is told at finish), or None."""
        w = self.w
        assert w.spec is not None
        newest, limit = w.book.newest_known, w.spec.max_staleness
        if versions_left(group.version, newest, limit) >= 0:
            return None
        age = time.monotonic() - group.created
        why = (
            f"this episode's group is stale: its policy version {group.version} is older than the latest {newest} "
            f"- max_staleness {limit}, so the proxy will refuse it and it will not be trained (the group has been "
            f"open {age:.0f} s). Finish a group's episodes sooner, or raise the run spec's max_staleness"
        )
        now = time.monotonic()
        if now - self._stale_warned > STALE_WARN_EVERY_S:  # the operator's view of it, not once per episode
            self._stale_warned = now
            with self._admission_lock:
                seen = self.admission.handed_staleness()
            log.warning(
                "an agent's group finished too stale to be trained: %s. Agents' groups handed over recently were "
                "%s versions old (max_staleness %d); a max_staleness of at least %d would have kept this one",
                why,
                ", ".join(map(str, seen)) or "none",
                limit,
                newest - group.version,
            )
        return why

    def _start_groups(self) -> None:
        w = self.w
        if self.svc.env is None:
            return
        if self._lease is not None:
            future, _ = self._lease
            if not future.done():
                return
            self._lease = None
            for p in future.result():
                self._start(p)
        if w.stop_event.is_set() or not self._slot_ok():
            return
        with self._admission_lock:
            want = self._room(ENV)  # its fair share beside the agents that ask, inside their groups' window
            if want <= 0 and sum(g.source == ENV for g in self.svc.book.groups()) < self.target:
                self.admission.deferred(ENV)
        budget = w.budget()
        if budget is not None:
            want = min(want, budget)
        if want > 0:
            self._lease = (w.leaser.submit(w.lease_prompts, want), want)

    def _pin(self, prompt: PromptLeaseItem, *, source: str) -> GroupRun:
        w = self.w
        slot = w.book.current()
        assert slot is not None and w.spec is not None
        held = HeldVersions(w.book)  # given back by the submitter once the group is settled
        held.hold(slot.version)
        self._held[prompt.prompt_id] = held
        return GroupRun(
            prompt,
            w.examples[prompt.index],
            version=slot.version,
            adapter=slot.name,
            lease_id=slot.lease_id,
            sampling=w.spec.sampling,
            group_size=w.spec.group_size,
            external=source != ENV,
            source=source,
        )

    def _start(self, prompt: PromptLeaseItem) -> None:
        if not self._slot_ok():  # the version moved on while the lease was out: hand the prompt back
            assert self.w.submitter is not None
            self.w.submitter.release_prompts([prompt.prompt_id])
            self.w.metrics.inflight(-1)
            return
        with self._admission_lock:
            self.admission.admitted(ENV)
        self.svc.start_group(self._pin(prompt, source=ENV))

    def _hand_over(self) -> None:
        w = self.w
        assert w.submitter is not None
        for group in self.svc.take_finished():
            with self._admission_lock:
                staleness = w.book.newest_known - group.version
                self.admission.on_handed(group.source, group.version, time.monotonic() - group.created, staleness)
            w.metrics.generated(sum(len(t.completion_ids) for e in group.episodes for t in e.turns))
            batch = GeneratedBatch(
                held=self._held.pop(group.prompt.prompt_id),
                prompts=[group.prompt],
                examples=[group.example],
                prompt_token_ids=[w.prompt_ids(group.prompt.index)],
                samples=[],
                sampling=group.sampling,
                episodes=[group.episodes],
            )
            w.submitter.put(batch, w.stop_event, w.settings.shutdown_timeout_s, idle=self._idle)

    def _idle(self) -> None:
        self.w.sync_versions()
        self.svc.queue.serve(self.w.engine, wait_s=0.0)  # type: ignore[arg-type]

    # -- external agents (the agent-lease thread) ------------------------------------------------------

    def _external_group(self, agent: str | None) -> GroupRun:
        w = self.w
        source = agent_source(agent)
        if w.stop_event.is_set():
            raise EndpointError(503, "stopping", "this generator is stopping", retry_after=5)
        if not self._slot_ok():
            raise EndpointError(503, "no_policy", "no policy version is loaded yet", retry_after=2)
        budget = w.budget()
        if budget is not None and budget <= 0:
            raise EndpointError(503, "done", "this generator submitted its max_groups", retry_after=60)
        with self._admission_lock:
            if self._room(source) <= 0:
                raise self._refused(source)
        try:
            lease = w.client.lease_prompts(
                w.worker_id,
                1,
                ttl_s=w.settings.prompt_lease_ttl_s,
                version=w.book.newest_known or None,
                wait_s=AGENT_LEASE_WAIT_S,
                request_id=uuid.uuid4().hex,
            )
        except errors.Backpressure as exc:
            retry = 1.0 if exc.retry_after is None else exc.retry_after
            raise EndpointError(429, "backpressure", "the trainer has enough work queued; retry", retry) from exc
        except errors.BucketRLError as exc:
            raise EndpointError(503, "unavailable", f"cannot lease a prompt: {exc.message}", retry_after=2) from exc
        w.ledger.add(lease.prompts)
        good = [p for p in lease.prompts if p.index < len(w.examples)]
        bad = [p.prompt_id for p in lease.prompts if p.index >= len(w.examples)]
        if bad:
            assert w.submitter is not None
            w.submitter.release_prompts(bad)
        if not good:
            raise EndpointError(429, "backpressure", "no prompt available right now; retry", retry_after=1)
        w.metrics.inflight(len(good))
        with self._admission_lock:
            self.admission.admitted(source)
        return self._pin(good[0], source=source)

    def _refused(self, source: str) -> EndpointError:
        w = self.w
        slot = w.book.current()
        assert slot is not None
        has_env = self.svc.env is not None
        no = self.admission.refuse(
            source, self._open_groups(), slot.version, w.book.newest_known, self._limits(), has_env=has_env
        )
        self.w.metrics.add("episode/admission_refused_total")
        return EndpointError(429, "admission", no.reason, retry_after=no.retry_after_s)

    # -- stopping --------------------------------------------------------------------------------------

    def _drain(self) -> None:
        """Episodes in flight get ``shutdown_timeout_s`` to finish (still sampled); the rest are released."""
        w = self.w
        self.svc.stopping = True
        deadline = time.monotonic() + w.settings.shutdown_timeout_s
        while len(self.svc.book) and time.monotonic() < deadline:
            w.sync_versions()
            self.svc.queue.serve(w.engine, wait_s=IDLE_POLL_S)  # type: ignore[arg-type]
            self._hand_over()
        if self._lease is not None:  # its prompts sit in the ledger: released with the worker's leftovers
            self._lease[0].result()
            self._lease = None
        assert w.submitter is not None
        for group in self.svc.abort_open("the generator stopped before the episode ended"):
            w.submitter.release_prompts([group.prompt.prompt_id])
            w.metrics.inflight(-1)
            self._held.pop(group.prompt.prompt_id).give_back()
        self._hand_over()
        self.svc.close()
