"""The generator worker loop (issue 3): stateless rollout production against the proxy's REST API.

    BUCKETRL_PROXY_URL=http://127.0.0.1:8000 BUCKETRL_TOKEN=tok BUCKETRL_RUN=demo bucketrl generator

Threads (the engine is only ever touched by the main thread):

- main ("engine"): load the newest fetched adapter under ``{run}-v{N}``; lease prompts (429 -> wait
  Retry-After); sample G completions per prompt in ONE engine request each (``n=G``), several prompts
  per call; hand the batch to the submitter; retire versions nobody uses any more. It never blocks
  without loading what the sync thread fetched: during sampling the engine calls back between steps, and
  every wait (a prompt lease held back by admission control, a full submit queue) polls for versions, so
  weight sync does not wait for the pipeline's pacing.
- ``adapter-sync``: long-polls ``/adapters/latest?after=N``; for a new version: lease it, download,
  verify sha256, unpack; the main thread loads it (on vLLM while the previous batch is still sampling).
- ``submitter`` (:mod:`bucketrl.generator.submit`): score, submit with an idempotency key, settle.
- ``keeper``: renews version and prompt leases, pushes metrics + ``loaded_versions`` (the heartbeat).

Stopping: SIGINT (or ``request_stop``) -> no new leases; the sampled batch finishes; queued batches get
``shutdown_timeout_s`` to be submitted, then their prompts and every lease are released; exit 0. SIGTERM or a
drain (its long-poll or the heartbeat's answer) is a notice (:mod:`bucketrl.generator.notice`): the same, bounded
by the notice, never-sampled prompts back at once. A SIGKILLed worker loses nothing: its leases expire.
"""

from __future__ import annotations

import logging
import shutil
import signal
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bucketrl import errors, preflight
from bucketrl.client import ProxyClient
from bucketrl.drain_watch import DrainWatch
from bucketrl.generator import startup, trust
from bucketrl.generator.adapters import VersionBook, VersionSlot, make_cache_dir
from bucketrl.generator.engines.factory import make_engine
from bucketrl.generator.episode_loop import EpisodeDriver
from bucketrl.generator.evaluation import Evaluator
from bucketrl.generator.job_server import JobServer
from bucketrl.generator.lease_keeper import LeaseKeeper
from bucketrl.generator.metrics import GeneratorMetrics
from bucketrl.generator.notice import Notice, NoticeExpired
from bucketrl.generator.prompt_tokens import PromptTokens
from bucketrl.generator.settings import GeneratorSettings
from bucketrl.generator.staleness_guard import StaleCall, StalenessGuard
from bucketrl.generator.submit import GeneratedBatch, HeldVersions, PromptLedger, Submitter
from bucketrl.generator.versions import AdapterVersions, release_version_lease
from bucketrl.rewards import RewardPool
from bucketrl.rollout.detokenize import complete_text
from bucketrl.rollout.engine import Engine
from bucketrl.rollout.example import Example
from bucketrl.wire import MetricsPush, PromptLease, PromptLeaseItem, PromptLeaseRequest, RunSpec

log = logging.getLogger(__name__)

# While the main thread waits (a prompt lease, a full submit queue), it loads fetched versions this often (s).
IDLE_POLL_S = 0.02
# A prompt lease long-polls this long for admission control's room (the proxy caps it at its max_wait_s).
PROMPT_WAIT_S = 2.0


class GeneratorWorker:
    """One generator process. ``run()`` blocks until stopped (or ``max_groups`` submitted) and returns 0.

    The worker is the loop; its collaborators do the rest: :class:`~bucketrl.generator.versions.AdapterVersions`
    (the adapter-sync thread, loading and retiring versions), :class:`~bucketrl.generator.prompt_tokens.PromptTokens`
    (prompt token ids), :class:`~bucketrl.generator.submit.Submitter` (score and submit),
    :class:`~bucketrl.generator.evaluation.Evaluator` (eval batches),
    :class:`~bucketrl.generator.lease_keeper.LeaseKeeper` (the keeper thread) and, for multi-turn runs,
    :class:`~bucketrl.generator.episode_loop.EpisodeDriver`, which drives episodes through the
    :class:`~bucketrl.generator.episode_loop.EpisodeHost` this worker is.
    """

    def __init__(
        self, settings: GeneratorSettings, *, client: ProxyClient | None = None, engine: Engine | None = None
    ) -> None:
        self.settings = settings
        self.worker_id = settings.resolved_worker_id("generator")
        # Retries through proxy outages for BUCKETRL_OUTAGE_BUDGET_S, logging each outage once (all threads).
        self.client = client or settings.proxy_client(settings.outage(self.worker_id))
        self.engine = engine
        self._own_engine = engine is None  # an engine passed in belongs to the caller: not closed here
        self.stop_event = threading.Event()
        self.metrics = GeneratorMetrics()
        self.book = VersionBook(settings.run)
        self.ledger = PromptLedger()
        self.spec: RunSpec | None = None
        self.examples: list[Example] = []
        self.tokenizer: Any = None
        self._pool: RewardPool | None = None
        self.submitter: Submitter | None = None
        self.versions: AdapterVersions | None = None
        self.prompt_tokens: PromptTokens | None = None
        self.evaluator: Evaluator | None = None
        self._threads: list[threading.Thread] = []
        self._cache_dir: Path | None = None
        self._own_cache_dir = False
        self._version_ready = threading.Event()
        self.leaser = ThreadPoolExecutor(1, thread_name_prefix="prompt-lease")
        self._prefetch: tuple[Future[list[PromptLeaseItem]], int] | None = None
        self.keeper: LeaseKeeper | None = None  # the keeper thread's renewals, once started
        self.episodes: EpisodeDriver | None = None  # multi-turn runs (run spec env)
        self.phase = "starting"
        self.notice = Notice()  # a preemption notice's deadline, once one is given
        self.guard = StalenessGuard(self.book, lambda: self.spec, self.metrics, enabled=settings.staleness_guard)
        self.guard.switch_lag = settings.partial_switch_lag

    # -- lifecycle ------------------------------------------------------------------------------------

    def request_stop(self, *_: object) -> None:
        self.phase = "stopping"
        if not self.stop_event.is_set():
            log.info("stop requested: no new leases; finishing what is in flight")
        self.stop_event.set()
        if self.client.outage is not None:
            self.client.outage.stopping(self.notice.left())
        self._version_ready.set()

    def notice_given(self, notice_s: float, why: str = "drain") -> None:
        """A notice: take no prompts, hand back those never sampled (on a thread: maybe a signal handler)."""
        if not self.notice.give(notice_s):
            return
        log.warning("preemption notice (%s, %.1fs): submitting what completes in time", why, notice_s)
        self.request_stop()
        self.phase = "draining"
        threading.Thread(target=self._hand_back_idle, name="hand-back", daemon=True).start()

    def _hand_back_idle(self) -> None:
        # Episodes hold their prompts outside Notice.take: theirs are released at shutdown.
        idle = [] if self.episodes is not None else self.notice.idle(self.ledger.ids())
        if idle and self.submitter is not None:
            log.info("preemption notice: released %d prompt(s) never sampled", len(idle))
            self.submitter.release_prompts(idle)

    def _grace_s(self) -> float:
        """How long queued batches may still take: ``shutdown_timeout_s``, bounded by a notice."""
        left = self.notice.left()
        return self.settings.shutdown_timeout_s if left is None else min(left, self.settings.shutdown_timeout_s)

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.notice_given(self.settings.preemption_notice_s, "SIGTERM"))
        signal.signal(signal.SIGINT, self.request_stop)

    def run(self) -> int:
        # The cloud's own notice (bucketrl/spot_notice.py), heard from the start: a reclaim can come mid-load too.
        spot = self.settings.spot_watch(self.notice_given, self.stop_event)
        try:
            if not self._setup():
                return 0
            self._loop()
        finally:
            self._shutdown()
            if spot is not None:
                spot.done()  # Azure: the drain is over, the VM may go now (not before: the whole notice is ours)
        return 0

    def _setup(self) -> bool:
        """Everything before the loop. False if stopped while waiting for the run to exist."""
        spec = startup.wait_for_run(self.client, self.stop_event, self.settings.run, self.settings.proxy_url)
        if spec is None:
            return False
        self.spec = spec
        if not self._check_configuration(spec):
            return False
        self._load_model(spec)
        self._start_collaborators(spec)
        s, n = self.settings, len(self.examples)
        log.info("generator %s: run %s, engine %s, G=%d, %d prompts/request, dataset %s (%d prompts)", self.worker_id,
                 s.run, s.engine, spec.group_size, s.prompts_per_request, spec.dataset.uri, n)  # fmt: skip
        return True

    def _check_configuration(self, spec: RunSpec) -> bool:
        """The allow-lists and `bucketrl up`'s checks; sets the examples. False if stopped while waiting."""
        s = self.settings
        self.announce("checking configuration")
        # The operator's allow-lists first: nothing the spec names is imported or read unless they admit it.
        trust.check_spec(spec, s.allowed_reward_modules, s.allowed_dataset_locations)
        examples = startup.load_examples(self.client, self.stop_event, spec)
        if examples is None:
            return False
        # The same checks as `bucketrl up`'s, against this worker's model and dataset: a mistake is one line and
        # exit code 2 (preflight.ConfigError), never a crash loop.
        preflight.check_run(
            spec,
            model=s.model_path or spec.base_model,
            names=preflight.SPEC_NAMES,
            client=self.client,
            max_model_len=s.max_model_len,
            examples=examples,
            reward="resolve",
        )
        self.examples = examples[: spec.dataset.size]
        return True

    def _load_model(self, spec: RunSpec) -> None:
        """The tokenizer, then the engine (unless one was passed in), checked for room to sample."""
        from transformers import AutoTokenizer

        s = self.settings
        self.announce("loading model")
        self.tokenizer = AutoTokenizer.from_pretrained(s.model_path or spec.base_model)
        # The engine first: vLLM forks its engine core, which must happen before this process has threads.
        if self.engine is None:
            self.engine = make_engine(s, spec)
        # Partial rollouts need an engine that stops a call with its tokens kept (the others are guarded as before).
        self.guard.continues = bool(getattr(self.engine, "continues_calls", False))
        if self.engine.max_model_len <= spec.sampling.max_new_tokens:
            raise preflight.ConfigError(
                f"the engine holds {self.engine.max_model_len} tokens (BUCKETRL_MAX_MODEL_LEN, capped by the model), "
                f"no room for a prompt before sampling.max_new_tokens={spec.sampling.max_new_tokens}"
            )

    def _start_collaborators(self, spec: RunSpec) -> None:
        """The reward pool, adapter versions, prompt tokens, submitter, evaluator and threads (in that order)."""
        s = self.settings
        assert self.engine is not None
        self._pool = RewardPool(
            spec.reward, workers=s.reward_workers, timeout_s=s.reward_timeout_s, on_failure=self.metrics.reward_error
        )
        self._cache_dir, self._own_cache_dir = make_cache_dir(s.adapter_cache_dir, s.run)
        self.versions = AdapterVersions(
            client=self.client,
            worker_id=self.worker_id,
            settings=s,
            book=self.book,
            engine=self.engine,
            spec=lambda: self.spec,
            metrics=self.metrics,
            cache_dir=self._cache_dir,
            stop_event=self.stop_event,
            version_ready=self._version_ready,
            refresh_spec=self._refresh_spec,
        )
        self.prompt_tokens = PromptTokens(
            tokenizer=self.tokenizer,
            max_model_len=self.engine.max_model_len,
            examples=self.examples,
            max_new_tokens=lambda: self.spec.sampling.max_new_tokens,  # type: ignore[union-attr]
            metrics=self.metrics,
        )
        self.submitter = Submitter(
            client=self.client,
            worker_id=self.worker_id,
            pool=self._pool,
            decode=lambda ids: complete_text(self.tokenizer, ids),
            ledger=self.ledger,
            metrics=self.metrics,
            use_msgpack=s.use_msgpack,
            max_batches=s.submit_queue_batches,
            placeholder_token=self.tokenizer.eos_token_id or 0,
        )
        self.submitter.start()
        self.evaluator = Evaluator(
            client=self.client,
            worker_id=self.worker_id,
            spec=lambda: self.spec,
            engine=self.engine,
            pool=self._pool,
            book=self.book,
            metrics=self.metrics,
            encode=self.prompt_tokens.encode,
            tokenizer=self.tokenizer,
            prompts_per_request=s.prompts_per_request,
            stop_event=self.stop_event,
        )
        if spec.env is not None:
            self.episodes = EpisodeDriver(self)
            self.episodes.start()
        self.keeper = LeaseKeeper(
            client=self.client,
            worker_id=self.worker_id,
            settings=s,
            book=self.book,
            ledger=self.ledger,
            release_version_lease=self.versions.release,
        )
        # The drain long-poll (as long as the version one) hears of a drain at once, not at the next heartbeat.
        watch = DrainWatch(s.proxy_client(s.outage(self.worker_id)), self.worker_id, self.notice_given, self.stop_event)
        watch.wait_s = s.version_wait_s
        threads = (
            (self.versions.follow, "adapter-sync"),
            (lambda: self.keeper.keep(self.stop_event, self.push_metrics), "keeper"),
            (watch.run, "drain-watch"),
        )
        for target, name in threads:
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def announce(self, phase: str, notes: dict[str, str] | None = None) -> None:
        """Tell the proxy what this worker is doing (status, dashboard, live view); best effort."""
        self.phase = phase
        self.settings.push_phase(self.worker_id, phase, notes)

    # -- the engine loop (main thread) ----------------------------------------------------------------

    def _loop(self) -> None:
        assert self.spec is not None and self.engine is not None and self.submitter is not None
        if self.episodes is not None or self.settings.serve_completion_jobs:  # loops of their own (no prompts)
            (self.episodes or JobServer(self)).loop()
            return
        s = self.settings
        try:
            while not self.stop_event.is_set():
                self.sync_versions()
                slot = self.book.current()
                if slot is None or slot.version < self.book.newest_known - self.spec.max_staleness:
                    # No version yet, or ours left the staleness window (newer ones failed to load or are
                    # still downloading): groups sampled now would only be dropped as stale.
                    self._version_ready.wait(1.0)
                    self._version_ready.clear()
                    continue
                budget = self.budget()
                if budget is not None and budget <= 0 and self._prefetch is None:
                    if self.metrics.inflight_groups == 0:
                        log.info("submitted %d groups (max_groups): stopping", self.submitter.groups_submitted)
                        break
                    self.stop_event.wait(0.05)
                    continue
                prompts = self._next_prompts(s.prompts_per_request if budget is None else max(1, budget))
                if not prompts:
                    # Training had nothing for us (admission control): the idle time evaluates, if the run asks.
                    self._evaluate_some()
                    continue
                # Versions loaded (and old ones retired) while waiting for the prompts: sample with the newest. The
                # lease was asked for the newest FETCHED version (admission control judged it by that one): load
                # it now if the wait did not (strict on-policy drops every group of an older version).
                self.sync_versions()
                slot = self.book.current() or slot
                # Lease the next prompts while these are sampled: the engine never waits on the proxy.
                after = self.budget()
                n_next = s.prompts_per_request if after is None else min(s.prompts_per_request, after)
                if n_next > 0 and not self.stop_event.is_set():
                    self._prefetch = (self._lease_next(n_next), n_next)
                self.sample_and_hand_over(slot, prompts)
                # At most one eval batch (greedy: one sample per prompt, against G per training prompt) per
                # training batch, so an evaluated version is done while it is loaded, without starving training.
                self._evaluate_some()
        finally:
            if self._prefetch is not None:  # its prompts land in the ledger and are released at shutdown
                self._prefetch[0].result()
                self._prefetch = None

    def budget(self) -> int | None:
        """Groups still allowed under ``max_groups`` (None = unlimited), counting leases in flight."""
        if self.settings.max_groups is None:
            return None
        assert self.submitter is not None
        reserved = self._prefetch[1] if self._prefetch is not None else 0
        return self.settings.max_groups - self.submitter.groups_submitted - self.metrics.inflight_groups - reserved

    def _next_prompts(self, n: int) -> list[PromptLeaseItem]:
        if self._prefetch is not None:
            future, _ = self._prefetch
            self._prefetch = None
            got = self._await(future)
            if got:
                return got
        # Through the leaser thread too: a 429's Retry-After wait must not hold up adapter loads here.
        return self._await(self.leaser.submit(self.lease_prompts, min(n, self.settings.prompts_per_request)))

    def _await(self, future: Future[list[PromptLeaseItem]]) -> list[PromptLeaseItem]:
        """``future.result()``, loading fetched adapter versions while it is not done."""
        while True:
            try:
                return future.result(timeout=IDLE_POLL_S)
            except TimeoutError:
                self.sync_versions()

    def _lease_next(self, n: int) -> Future[list[PromptLeaseItem]]:
        """The next call's prompts, leased by the submit of a batch waiting to go out when there is one (one
        request per call instead of two), else (or when that submit leased none) on the leaser thread."""
        assert self.submitter is not None
        req = PromptLeaseRequest(
            worker_id=self.worker_id,
            n=n,
            ttl_s=self.settings.prompt_lease_ttl_s,
            version=self.book.newest_known or None,
            request_id=uuid.uuid4().hex,
        )
        riding = None if self.guard.declining else self.submitter.lease_with_next(req)
        if riding is None:
            return self.leaser.submit(self.lease_prompts, n)

        def after_submit() -> list[PromptLeaseItem]:
            # Answered by the submitter, whatever becomes of its batch. A stopping worker does not wait for a
            # submit held back by the queue: prompts it leases later are in the ledger, released at shutdown.
            while True:
                try:
                    lease = riding.result(timeout=0.2)
                    break
                except TimeoutError:
                    if self.stop_event.is_set():
                        return []
            return self.lease_prompts(n) if lease is None or not lease.prompts else self.took(lease)

        return self.leaser.submit(after_submit)

    def lease_prompts(self, n: int) -> list[PromptLeaseItem]:
        assert self.submitter is not None
        s = self.settings
        if self.guard.hold_back(self.stop_event):  # calls here outlast the staleness window (staleness_guard.py)
            return []
        t0 = time.monotonic()
        try:
            # The newest fetched version: it is loaded before the next batch samples (the loop's first step).
            lease = self.client.lease_prompts(
                self.worker_id,
                n,
                ttl_s=s.prompt_lease_ttl_s,
                version=self.book.newest_known or None,
                wait_s=PROMPT_WAIT_S,
                # The client's retry after a lost answer gets the same prompts, not more (which would sit
                # leased to this worker, unknown to it, until their leases expired).
                request_id=uuid.uuid4().hex,
            )
        except errors.Backpressure as exc:
            # Retry-After 0 after a long-poll: ask again now (with the version loaded meanwhile).
            wait = min(max(1.0 if exc.retry_after is None else exc.retry_after, 0.05), 30.0)
            self.stop_event.wait(wait)
            self.metrics.backpressure(time.monotonic() - t0)  # the long-poll and the wait after it
            return []
        except errors.Unavailable as exc:
            log.warning("cannot lease prompts: %s", exc.message)
            self.stop_event.wait(1.0)
            return []
        except errors.NotFound as exc:  # the run was deleted or the proxy lost it; keep polling politely
            log.warning("cannot lease prompts: %s", exc.message)
            self.stop_event.wait(2.0)
            return []
        if lease.waited_s > 0:
            self.metrics.backpressure(lease.waited_s)
        return self.took(lease)

    def took(self, lease: PromptLease) -> list[PromptLeaseItem]:
        """A lease's prompts this worker can sample (in flight from now); any beyond the dataset released."""
        assert self.submitter is not None
        self.ledger.add(lease.prompts)
        if self.notice.given:  # leased while a notice came: nothing will sample them, back at once
            self.submitter.release_prompts([p.prompt_id for p in lease.prompts])
            return []
        bad = [p for p in lease.prompts if p.index >= len(self.examples)]
        if bad:
            log.error("prompt indices beyond the dataset's %d examples; releasing them", len(self.examples))
            self.submitter.release_prompts([p.prompt_id for p in bad])
        good = [p for p in lease.prompts if p.index < len(self.examples)]
        self.metrics.inflight(len(good))  # in flight from the lease until submitted or released
        return good

    def prompt_ids(self, index: int) -> list[int]:
        assert self.prompt_tokens is not None
        return self.prompt_tokens.ids(index)

    def sample_and_hand_over(self, slot: VersionSlot, prompts: list[PromptLeaseItem]) -> None:
        assert self.spec is not None and self.engine is not None and self.submitter is not None
        spec = self.spec
        names = [p.prompt_id for p in prompts]
        if not self.notice.take(names, self.ledger.ids()):
            held = set(self.ledger.ids())  # a notice came: these go back now, unsampled
            self.submitter.release_prompts([n for n in names if n in held])
            return
        ids = [self.prompt_ids(p.index) for p in prompts]
        (versions := HeldVersions(self.book)).hold(slot.version)
        batch = GeneratedBatch(
            held=versions,
            prompts=prompts,
            examples=[self.examples[p.index] for p in prompts],
            prompt_token_ids=ids,
            samples=[],
            sampling=spec.sampling,
        )
        try:
            out = self.guard.rollout(self.engine, versions, ids, spec, self._while_sampling, names=names)
            batch.samples, batch.spans = out.samples, out.spans
        except (NoticeExpired, StaleCall) as exc:
            self.submitter.release(batch, str(exc))
            return
        except Exception:
            log.exception("engine failed on %d prompts; releasing them", len(prompts))
            self.submitter.release(batch, "engine error")
            self.stop_event.wait(1.0)
            return
        self.metrics.generated(sum(len(smp.token_ids) for g in batch.samples for smp in g))
        self.submitter.put(batch, self.stop_event, self._grace_s(), idle=self.sync_versions)

    def _while_sampling(self) -> None:
        """The engine's hook between steps: a notice's end abandons the call; versions load meanwhile."""
        self.notice.check()
        self.sync_versions()

    # -- evaluation during training (bucketrl/proxy/state/evals.py) --------------------------------------

    def _evaluate_some(self) -> None:
        """At most one eval batch (:meth:`Evaluator.evaluate_some`) between training batches."""
        if self.evaluator is None:
            self.book.unpin(*self.book.pinned())
            return
        self.evaluator.evaluate_some()

    # -- adapter versions -----------------------------------------------------------------------------

    def sync_versions(self) -> None:
        """Load what the sync thread fetched and retire what left the window (:meth:`AdapterVersions.sync`)."""
        assert self.versions is not None
        self.versions.sync()

    def _refresh_spec(self) -> None:
        """Mutable run fields (sampling, max_staleness) may change between versions; pick them up."""
        spec = startup.refreshed_spec(self.client, self.settings)
        if spec is None:
            return
        changed = self.spec is not None and spec.sampling.max_new_tokens != self.spec.sampling.max_new_tokens
        if changed and self.prompt_tokens is not None:
            self.prompt_tokens.forget()
        self.spec = spec

    # -- keeper ----------------------------------------------------------------------------------------

    def push_metrics(self, *, renew: bool = False) -> bool:
        """Push the heartbeat; ``renew``: with the leases to renew. True when the proxy renewed them (an older
        proxy ignores them, a failed push renewed nothing: the keeper renews on the renew routes then)."""
        if self.phase not in ("stopping", "draining"):
            self.phase = "generating" if self.book.current() is not None else "waiting for the first version"
        push = MetricsPush(
            worker_id=self.worker_id,
            metrics=self.metrics.snapshot(),
            loaded_versions=self.book.loaded_versions(),
            phase=self.phase,
            notes=self.metrics.notes(),
            samples=self.metrics.take_samples() or None,
            gpu_class=self.settings.declared_gpu_class(),
            usd_per_hour=self.settings.usd_per_hour,
        )
        held, renewals = self.keeper.renewals() if renew and self.keeper is not None else ({}, None)
        if renewals is not None and (renewals.version_leases or renewals.prompt_ids):
            push.renew = renewals
        try:
            got = self.client.push_metrics(push)
        except errors.BucketRLError as exc:
            log.warning("metrics push failed: %s", exc.message)
            return False
        if got is not None and got.drain is not None:
            self.notice_given(got.drain.notice_s, "drain")
        if push.renew is None:
            return renew  # nothing to renew
        if got is None:
            return False
        assert self.keeper is not None
        self.keeper.renewed(held, push.renew, got)
        return True

    # -- shutdown --------------------------------------------------------------------------------------

    def _shutdown(self) -> None:
        self.stop_event.set()
        self._version_ready.set()
        if self.notice.given:
            self._hand_back_idle()  # a prefetch answered after the notice
        grace = self._grace_s()
        if self.submitter is not None and not self.submitter.close(grace):
            log.warning("shutdown: in-flight batches not submitted (within %.0fs) were released", grace)
        leftover = self.ledger.ids()
        if leftover:
            try:
                self.client.release_prompts(self.worker_id, leftover)
                self.metrics.add("rollout/released_prompts_total", len(leftover))
            except errors.BucketRLError as exc:
                log.warning("shutdown: could not release %d prompts (they will expire): %s", len(leftover), exc)
            self.ledger.remove(leftover)
        self.metrics.inflight(-self.metrics.inflight_groups)  # everything is settled or released now
        self.leaser.shutdown(wait=False)
        for lease_id in self.book.leases().values():
            release_version_lease(self.client, lease_id)
        if self.spec is not None:
            self.push_metrics()
        for t in self._threads:
            t.join(timeout=0.2 if self.notice.given else 1.0)  # the long-poll thread may be mid-request; a daemon
        if self._pool is not None:
            self._pool.close()
        if self.engine is not None and self._own_engine:
            try:
                self.engine.close()
            except Exception:
                log.exception("engine close failed")
        if self._own_cache_dir and self._cache_dir is not None:
            shutil.rmtree(self._cache_dir, ignore_errors=True)
        self.client.close()
        if self.notice.given_at is not None:
            log.info(
                "generator %s stopped %.1fs after the preemption notice",
                self.worker_id,
                time.monotonic() - self.notice.given_at,
            )
        log.info("generator %s stopped", self.worker_id)
