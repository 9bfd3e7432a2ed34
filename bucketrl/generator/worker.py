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

Stopping: SIGTERM/SIGINT (or ``request_stop``) -> no new leases; the batch being sampled finishes; queued
batches get ``shutdown_timeout_s`` to be submitted, after which their prompts are released; every lease
still held is released; exit 0. A SIGKILLed worker loses nothing: its prompt leases expire on the proxy
and the prompts are issued again.
"""

from __future__ import annotations

import logging
import math
import shutil
import signal
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bucketrl import errors, preflight
from bucketrl.client import ProxyClient
from bucketrl.datasets import Example, examples_for_run, prompt_token_ids
from bucketrl.generator import trust
from bucketrl.generator.adapters import VersionBook, VersionSlot, clear_stale_tmp, fetch_adapter, gc_cache
from bucketrl.generator.engines.base import Engine, check_reproducible, make_engine
from bucketrl.generator.metrics import GeneratorMetrics
from bucketrl.generator.settings import GeneratorSettings
from bucketrl.generator.submit import GeneratedBatch, PromptLedger, Submitter
from bucketrl.rewards import RewardItem, RewardPool
from bucketrl.wire import EvalResult, EvalSample, MetricsPush, PromptLease, PromptLeaseItem, PromptLeaseRequest, RunSpec
from bucketrl.wire.metrics import Renewals, Renewed
from bucketrl.wire.runs import DatasetSpec

if TYPE_CHECKING:
    from bucketrl.generator.episode_loop import EpisodeDriver

log = logging.getLogger(__name__)

# While the main thread waits (a prompt lease, a full submit queue), it loads fetched versions this often (s).
IDLE_POLL_S = 0.02
# A version the proxy had no eval prompts of for us is asked about again after this long (s).
EVAL_RECHECK_S = 30.0
# MetricsPush.notes' cap.
MAX_NOTES = 16
# A prompt lease long-polls this long for admission control's room (the proxy caps it at its max_wait_s).
PROMPT_WAIT_S = 2.0


class GeneratorWorker:
    """One generator process. ``run()`` blocks until stopped (or ``max_groups`` submitted) and returns 0."""

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
        self._prompt_cache: dict[int, list[int]] = {}
        self._tokenizer: Any = None
        self._pool: RewardPool | None = None
        self._eval_examples: tuple[DatasetSpec, list[Example]] | None = None
        # version -> when the proxy had no eval prompt of it for us (all done, or leased to others: asked again
        # after EVAL_RECHECK_S, in case another generator's leases expire unfinished).
        self._eval_done: dict[int, float] = {}
        self._eval_broken: DatasetSpec | None = None  # an eval set that could not be read
        self.submitter: Submitter | None = None
        self._threads: list[threading.Thread] = []
        self._cache_dir: Path | None = None
        self._own_cache_dir = False
        self._cache_gc_at = 0  # newest_known at the last cache GC
        self._version_ready = threading.Event()
        self._leaser = ThreadPoolExecutor(1, thread_name_prefix="prompt-lease")
        self._prefetch: tuple[Future[list[PromptLeaseItem]], int] | None = None
        self.episodes: EpisodeDriver | None = None  # multi-turn runs (run spec env)
        self.phase = "starting"

    # -- lifecycle ------------------------------------------------------------------------------------

    def request_stop(self, *_: object) -> None:
        self.phase = "stopping"
        if not self.stop_event.is_set():
            log.info("stop requested: no new leases; finishing what is in flight")
        self.stop_event.set()
        if self.client.outage is not None:
            self.client.outage.stopping()
        self._version_ready.set()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)

    def run(self) -> int:
        try:
            if not self._setup():
                return 0
            self._loop()
        finally:
            self._shutdown()
        return 0

    def _setup(self) -> bool:
        """Everything before the loop. False if stopped while waiting for the run to exist."""
        s = self.settings
        spec = self._wait_for_run()
        if spec is None:
            return False
        self.spec = spec
        model = s.model_path or spec.base_model
        self.announce("checking configuration")
        # The operator's allow-lists first: nothing the spec names is imported or read unless they admit it.
        trust.check_spec(spec, s.allowed_reward_modules, s.allowed_dataset_locations)
        examples = self._load_examples(spec)
        if examples is None:
            return False
        # The same checks as `bucketrl up`'s, against this worker's model and dataset: a mistake is one line and
        # exit code 2 (preflight.ConfigError), never a crash loop.
        preflight.check_run(
            spec,
            model=model,
            names=preflight.SPEC_NAMES,
            client=self.client,
            max_model_len=s.max_model_len,
            examples=examples,
            reward="resolve",
        )
        self.examples = examples[: spec.dataset.size]
        from transformers import AutoTokenizer

        self.announce("loading model")
        self._tokenizer = AutoTokenizer.from_pretrained(model)
        # The engine first: vLLM forks its engine core, which must happen before this process has threads.
        if self.engine is None:
            self.engine = make_engine(s, spec)
        if self.engine.max_model_len <= spec.sampling.max_new_tokens:
            raise preflight.ConfigError(
                f"the engine holds {self.engine.max_model_len} tokens (BUCKETRL_MAX_MODEL_LEN, capped by the model), "
                f"no room for a prompt before sampling.max_new_tokens={spec.sampling.max_new_tokens}"
            )
        self._pool = RewardPool(
            spec.reward, workers=s.reward_workers, timeout_s=s.reward_timeout_s, on_failure=self.metrics.reward_error
        )
        if s.adapter_cache_dir:
            self._cache_dir = Path(s.adapter_cache_dir) / s.run
            self._cache_dir.mkdir(parents=True, exist_ok=True)
            clear_stale_tmp(self._cache_dir)
        else:
            self._cache_dir = Path(tempfile.mkdtemp(prefix=f"bucketrl-{s.run}-adapters-"))
            self._own_cache_dir = True
        self.submitter = Submitter(
            client=self.client,
            worker_id=self.worker_id,
            pool=self._pool,
            decode=lambda ids: self._tokenizer.decode(ids, skip_special_tokens=True),
            book=self.book,
            ledger=self.ledger,
            metrics=self.metrics,
            use_msgpack=s.use_msgpack,
            max_batches=s.submit_queue_batches,
            placeholder_token=self._tokenizer.eos_token_id or 0,
        )
        self.submitter.start()
        if spec.env is not None:
            from bucketrl.generator.episode_loop import EpisodeDriver

            self.episodes = EpisodeDriver(self)
            self.episodes.start()
        for target, name in ((self._sync_adapters, "adapter-sync"), (self._keep, "keeper")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        log.info(
            "generator %s: run %s, engine %s, G=%d, %d prompts/request, dataset %s (%d prompts)",
            self.worker_id,
            s.run,
            s.engine,
            spec.group_size,
            s.prompts_per_request,
            spec.dataset.uri,
            len(self.examples),
        )
        return True

    def announce(self, phase: str, notes: dict[str, str] | None = None) -> None:
        """Tell the proxy what this worker is doing (status, dashboard, live view); best effort."""
        self.phase = phase
        self.settings.push_phase(self.worker_id, phase, notes)

    def _load_examples(self, spec: RunSpec) -> list[Example] | None:
        """The run's examples; a ``bucket:`` dataset the trainer has not uploaded yet is waited for."""
        delay = 0.5
        while not self.stop_event.is_set():
            try:
                examples = preflight.check_dataset(spec.dataset, self.client, preflight.SPEC_NAMES)
            except (errors.NotFound, errors.Unavailable) as exc:
                log.info("waiting for the run's dataset %s: %s", spec.dataset.uri, exc.message)
                self.stop_event.wait(delay)
                delay = min(delay * 2, 10.0)
                continue
            if len(examples) < spec.dataset.size:
                raise preflight.ConfigError(
                    f"{preflight.SPEC_NAMES['dataset']} {spec.dataset.uri}: {len(examples)} examples but the run was "
                    f"created with dataset.size={spec.dataset.size}"
                )
            return examples
        return None

    def _wait_for_run(self) -> RunSpec | None:
        delay = 0.5
        while not self.stop_event.is_set():
            try:
                return self.client.get_run().spec
            except (errors.NotFound, errors.Unavailable) as exc:
                log.info("waiting for run %s on %s: %s", self.settings.run, self.settings.proxy_url, exc.message)
            self.stop_event.wait(delay)
            delay = min(delay * 2, 10.0)
        return None

    # -- the engine loop (main thread) ----------------------------------------------------------------

    def _loop(self) -> None:
        assert self.spec is not None and self.engine is not None and self.submitter is not None
        if self.episodes is not None:
            self.episodes.loop()
            return
        s = self.settings
        try:
            while not self.stop_event.is_set():
                self._load_pending()
                self._retire()
                slot = self.book.current()
                if slot is None or slot.version < self.book.newest_known - self.spec.max_staleness:
                    # No version yet, or ours left the staleness window (newer ones failed to load or are
                    # still downloading): groups sampled now would only be dropped as stale.
                    self._version_ready.wait(1.0)
                    self._version_ready.clear()
                    continue
                budget = self._budget()
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
                self._sync_versions()
                slot = self.book.current() or slot
                # Lease the next prompts while these are sampled: the engine never waits on the proxy.
                after = self._budget()
                n_next = s.prompts_per_request if after is None else min(s.prompts_per_request, after)
                if n_next > 0 and not self.stop_event.is_set():
                    self._prefetch = (self._lease_next(n_next), n_next)
                self._sample_and_hand_over(slot, prompts)
                # At most one eval batch (greedy: one sample per prompt, against G per training prompt) per
                # training batch, so an evaluated version is done while it is loaded, without starving training.
                self._evaluate_some()
        finally:
            if self._prefetch is not None:  # its prompts land in the ledger and are released at shutdown
                self._prefetch[0].result()
                self._prefetch = None

    def _budget(self) -> int | None:
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
        return self._await(self._leaser.submit(self._lease_prompts, min(n, self.settings.prompts_per_request)))

    def _await(self, future: Future[list[PromptLeaseItem]]) -> list[PromptLeaseItem]:
        """``future.result()``, loading fetched adapter versions while it is not done."""
        while True:
            try:
                return future.result(timeout=IDLE_POLL_S)
            except TimeoutError:
                self._sync_versions()

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
        riding = self.submitter.lease_with_next(req)
        if riding is None:
            return self._leaser.submit(self._lease_prompts, n)

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
            return self._lease_prompts(n) if lease is None or not lease.prompts else self._took(lease)

        return self._leaser.submit(after_submit)

    def _lease_prompts(self, n: int) -> list[PromptLeaseItem]:
        assert self.submitter is not None
        s = self.settings
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
        return self._took(lease)

    def _took(self, lease: PromptLease) -> list[PromptLeaseItem]:
        """A lease's prompts this worker can sample (in flight from now); any beyond the dataset released."""
        assert self.submitter is not None
        self.ledger.add(lease.prompts)
        bad = [p for p in lease.prompts if p.index >= len(self.examples)]
        if bad:
            log.error("prompt indices beyond the dataset's %d examples; releasing them", len(self.examples))
            self.submitter.release_prompts([p.prompt_id for p in bad])
        good = [p for p in lease.prompts if p.index < len(self.examples)]
        self.metrics.inflight(len(good))  # in flight from the lease until submitted or released
        return good

    def _prompt_ids(self, index: int) -> list[int]:
        ids = self._prompt_cache.get(index)
        if ids is None:
            ids = self._encode(self.examples[index], self.spec.sampling.max_new_tokens)  # type: ignore[union-attr]
            self._prompt_cache[index] = ids
        return ids

    def _encode(self, example: Example, max_new_tokens: int) -> list[int]:
        """The prompt's token ids (through the chat template for chat rows), cut to leave room to sample."""
        ids = prompt_token_ids(self._tokenizer, example.prompt, example.chat())
        room = self.engine.max_model_len - max_new_tokens  # type: ignore[union-attr]
        if len(ids) > room:
            # Keep the end of the prompt (where the question is) so the completion always fits.
            ids = ids[-room:]
            self.metrics.add("rollout/truncated_prompts_total")
        return ids

    def _sample_and_hand_over(self, slot: VersionSlot, prompts: list[PromptLeaseItem]) -> None:
        assert self.spec is not None and self.engine is not None and self.submitter is not None
        spec = self.spec
        ids = [self._prompt_ids(p.index) for p in prompts]
        self.book.begin(slot.version)
        batch = GeneratedBatch(
            version=slot.version,
            lease_id=slot.lease_id,
            prompts=prompts,
            examples=[self.examples[p.index] for p in prompts],
            prompt_token_ids=ids,
            samples=[],
            sampling=spec.sampling,
        )
        try:
            batch.samples = self.engine.generate(
                ids, adapter=slot.name, n=spec.group_size, sampling=spec.sampling, while_running=self._sync_versions
            )
        except Exception:
            log.exception("engine failed on %d prompts; releasing them", len(prompts))
            self.submitter.release(batch, "engine error")
            self.stop_event.wait(1.0)
            return
        self.metrics.generated(sum(len(smp.token_ids) for g in batch.samples for smp in g))
        self.submitter.put(batch, self.stop_event, self.settings.shutdown_timeout_s, idle=self._sync_versions)

    # -- evaluation during training (bucketrl/proxy/state/evals.py) --------------------------------------

    def _evaluate_some(self) -> None:
        """One batch of eval prompts of a loaded version, sampled with the eval settings, scored with the run's
        reward and submitted. Called when the training lease came back empty and after each training batch (the
        prefetched training lease keeps running meanwhile): eval takes at most one small batch per training
        batch. Versions the proxy had nothing more for are not asked about again."""
        spec = self.spec
        if spec is None or spec.eval is None or self.engine is None or self._pool is None or spec.env is not None:
            self.book.unpin(*self.book.pinned())
            return  # multi-turn runs are not evaluated by generators (yet): their episodes need the environment
        if self._eval_broken is not None and self._eval_broken == spec.eval_dataset():
            return
        now = time.monotonic()
        versions = [
            v
            for v in self.book.loaded_versions()
            if spec.eval.evaluates(v) and now - self._eval_done.get(v, -math.inf) > EVAL_RECHECK_S
        ]
        if not versions:
            return
        try:
            examples = self._eval_set(spec)
        except errors.BucketRLError as exc:
            # A run spec error (no such split...): say so once per eval set, keep generating for training.
            log.error(
                "eval set unreadable; this generator evaluates nothing until the run's eval changes: %s", exc.message
            )
            self._eval_broken = spec.eval_dataset()
            return
        try:
            items = self.client.lease_eval(self.worker_id, versions, n=self.settings.prompts_per_request).items
        except errors.BucketRLError as exc:
            log.warning("cannot lease eval prompts: %s", exc.message)
            return
        if not items:
            # Every prompt of these versions is done or leased to others: nothing keeps them loaded for eval.
            self._eval_done.update(dict.fromkeys(versions, now))
            self.book.unpin(*versions)
            return
        version = items[0].version
        items = [i for i in items if i.version == version and i.index < len(examples)]
        try:
            slot = self.book.begin(version)
        except KeyError:  # retired since the lease: the lease expires and another generator does it
            return
        # The proxy had prompts of it: keep it loaded past the staleness window until none are left, else a
        # version whose eval outlasts the window is never finished (seen: 16 of 32 prompts of v51 in the demo).
        self.book.pin(version)
        try:
            sampling = spec.eval_sampling()
            assert sampling is not None
            ids = [self._encode(examples[i.index], sampling.max_new_tokens) for i in items]
            samples = self.engine.generate(ids, adapter=slot.name, n=spec.eval.n, sampling=sampling)
        except Exception:
            log.exception("engine failed on %d eval prompts (their lease expires; evaluated again)", len(items))
            return
        finally:
            self.book.end(version)
        decode = self._tokenizer.decode
        flat = [
            RewardItem(
                decode(smp.token_ids, skip_special_tokens=True), examples[i.index].answer, examples[i.index].prompt
            )
            for i, group in zip(items, samples, strict=True)
            for smp in group
        ]
        rewards = iter(self._pool.score(flat, cancel=self.stop_event))
        results = [
            EvalResult(
                version=version,
                index=i.index,
                samples=[EvalSample(reward=next(rewards), length=len(smp.token_ids)) for smp in group],
            )
            for i, group in zip(items, samples, strict=True)
        ]
        try:
            self.client.submit_eval(self.worker_id, results)
            self.metrics.add("eval/prompts_total", len(results))
        except errors.BucketRLError as exc:
            log.warning("eval results not submitted (%s); the prompts are evaluated again", exc.message)

    def _eval_set(self, spec: RunSpec) -> list[Example]:
        """The eval set's examples (loaded once per eval dataset spec)."""
        ds = spec.eval_dataset()
        assert ds is not None
        if self._eval_examples is None or self._eval_examples[0] != ds:
            self._eval_examples = (ds, examples_for_run(ds, self.client))
        return self._eval_examples[1]

    # -- adapter versions -----------------------------------------------------------------------------

    def _sync_versions(self) -> None:
        """Between engine steps and during waits: load what the sync thread fetched, retire what left the
        window (the version being sampled is in use, so it stays), so a long call or wait neither delays
        weight sync nor piles up resident adapters."""
        self._load_pending()
        self._retire()

    def _load_pending(self) -> None:
        """Load the newest fetched version into the engine (older versions stay resident)."""
        assert self.engine is not None and self.spec is not None
        slot = self.book.pending()
        if slot is None:
            return
        capacity = getattr(self.engine, "max_loras", None)
        if capacity is not None and len(self.engine.loaded_adapters()) >= capacity:
            return  # _retire makes room between engine calls
        t0 = time.monotonic()
        try:
            self.engine.load_adapter(slot.name, slot.version, slot.path)
        except Exception as exc:
            log.error("adapter v%d could not be loaded (%s); staying on the current version", slot.version, exc)
            self.metrics.add("sync/adapter_failures_total")
            self.book.drop(slot.version)
            self._release_version_lease(slot.lease_id)
            return
        self.book.mark_loaded(slot.version)
        load_s = slot.fetch_s + (time.monotonic() - t0)
        self.metrics.set("sync/adapter_load_s", load_s)
        self.metrics.set("sync/adapter_version", slot.version)
        self.metrics.set("policy/version", slot.version)
        log.info("loaded %s in %.2fs (resident: %s)", slot.name, load_s, self.book.loaded_versions())

    def _retire(self) -> None:
        """Unload versions nobody uses that left the staleness window (or whose slot the next version needs);
        release the leases of versions no longer sampled from."""
        assert self.engine is not None and self.spec is not None
        capacity = getattr(self.engine, "max_loras", None) or (self.spec.max_staleness + 2)
        reserve = 1 if self.book.pending() is not None else 0
        retired = self.book.retire(self.spec.max_staleness, capacity, reserve)
        for slot in retired:
            self.engine.unload_adapter(slot.name)
            self._release_version_lease(slot.lease_id)
            log.info("unloaded %s", slot.name)
        for lease_id in self.book.take_idle_leases():
            self._release_version_lease(lease_id)
        if self._cache_dir is not None and (retired or self.book.newest_known > self._cache_gc_at):
            # Superseded (fetched, never loaded) and retired versions leave the disk: the cache stays bounded
            # (issue 10 item 11: a long run filled the chart's emptyDir).
            self._cache_gc_at = self.book.newest_known
            gone = gc_cache(self._cache_dir, self.book.versions(), self.book.newest_known)
            if gone:
                log.debug("deleted cached adapters %s", gone)

    def _release_version_lease(self, lease_id: str) -> None:
        if not lease_id:
            return
        try:
            self.client.release_lease(lease_id)
        except errors.BucketRLError as exc:  # expired already (410) or proxy away: it will expire anyway
            log.debug("release of lease %s: %s", lease_id, exc)

    def _sync_adapters(self) -> None:
        """Thread: long-poll for new versions; lease, fetch and verify each; the main thread loads it."""
        delay = 0.5
        while not self.stop_event.is_set():
            try:
                info = self.client.wait_for_version(self.book.newest_known, wait_s=self.settings.version_wait_s)
                if info is not None and not self.stop_event.is_set():
                    self._fetch_version(info.version, info.sha256)
                delay = 0.5
            except errors.BucketRLError as exc:
                if self.stop_event.is_set():
                    return
                log.warning("adapter sync: %s %s", exc.code, exc.message)
                self.stop_event.wait(delay)
                delay = min(delay * 2, 10.0)
            except Exception:
                if self.stop_event.is_set():
                    return  # the client was closed under a long-poll at shutdown
                log.exception("adapter sync failed")
                self.stop_event.wait(delay)
                delay = min(delay * 2, 10.0)

    def _fetch_version(self, announced: int, sha256: str) -> None:
        assert self._cache_dir is not None
        s = self.settings
        self._refresh_spec()
        t0 = time.monotonic()
        # Lease "the latest" rather than the announced number: never Gone, and maybe one newer already.
        lease = self.client.lease_version(self.worker_id, None, ttl_s=s.version_lease_ttl_s)
        self.book.begin_fetch(lease.version, lease.lease_id)  # the keeper renews it during the download
        try:
            expected = sha256 if lease.version == announced else None
            path = fetch_adapter(self.client, lease.version, self._cache_dir, expected)
        except errors.Invalid as exc:
            self._release_version_lease(self.book.end_fetch(lease.version) or lease.lease_id)
            if exc.retryable:  # a corrupted transfer: try again
                raise
            log.error("adapter v%d is unusable, skipping it: %s", lease.version, exc.message)
            self.metrics.add("sync/adapter_failures_total")
            self.book.newest_known = max(self.book.newest_known, lease.version)
            return
        except BaseException:
            self._release_version_lease(self.book.end_fetch(lease.version) or lease.lease_id)
            raise
        lease_id = self.book.end_fetch(lease.version) or lease.lease_id
        for old in self.book.add(lease.version, lease_id, path, time.monotonic() - t0):
            self._release_version_lease(old.lease_id)  # fetched but never loaded: superseded
        if self.stop_event.is_set():  # shutdown may have released the book's leases already
            self._release_version_lease(lease_id)
        self._version_ready.set()

    def _refresh_spec(self) -> None:
        """Mutable run fields (sampling, max_staleness) may change between versions; pick them up."""
        try:
            spec = self.client.get_run().spec
            check_reproducible(spec.sampling, spec.vocab_size, self.settings.engine)
            trust.check_spec(spec, self.settings.allowed_reward_modules, self.settings.allowed_dataset_locations)
        except preflight.ConfigError as exc:  # a spec change the allow-lists refuse: keep the admitted one
            log.error("keeping the current run spec: %s", exc)
            return
        except errors.BucketRLError as exc:
            log.warning("keeping the current run spec: %s", exc.message)
            return
        if self.spec is not None and spec.sampling.max_new_tokens != self.spec.sampling.max_new_tokens:
            self._prompt_cache = {}
        self.spec = spec

    # -- keeper ----------------------------------------------------------------------------------------

    def _keep(self) -> None:
        """Thread: renew leases at a third of their TTL and push metrics (the heartbeat)."""
        s = self.settings
        period = min(s.metrics_interval_s, s.version_lease_ttl_s / 3, s.prompt_lease_ttl_s / 3)
        last_push = 0.0
        while not self.stop_event.wait(period):
            if time.monotonic() - last_push >= s.metrics_interval_s:
                last_push = time.monotonic()
                if self.push_metrics(renew=True):
                    continue  # the renewals rode on the heartbeat: one request instead of three
            self._renew_leases()

    def _renew_leases(self) -> None:
        s = self.settings
        for version, lease_id in self.book.leases().items():
            try:
                self.client.renew_lease(lease_id, ttl_s=s.version_lease_ttl_s)
            except errors.Gone:
                self._version_lease_expired(version, lease_id)
            except errors.BucketRLError as exc:
                log.warning("renewing version %d lease: %s", version, exc.message)
        ids = self.ledger.ids()
        if ids:
            try:
                renewed = self.client.renew_prompts(self.worker_id, ids, ttl_s=s.prompt_lease_ttl_s)
                self._prompts_renewed(ids, renewed)
            except errors.Gone:
                log.warning("all %d prompt leases had expired", len(ids))
            except errors.BucketRLError as exc:
                log.warning("renewing prompt leases: %s", exc.message)

    def _version_lease_expired(self, version: int, lease_id: str) -> None:
        """Expired (a long stall): lease the same version again if it still exists."""
        s = self.settings
        try:
            fresh = self.client.lease_version(self.worker_id, version, s.version_lease_ttl_s)
            if not self.book.replace_lease(version, lease_id, fresh.lease_id):
                self._release_version_lease(fresh.lease_id)  # released on purpose meanwhile
        except errors.BucketRLError as exc:
            log.warning("version %d lease lost: %s", version, exc.message)

    def _prompts_renewed(self, ids: list[str], renewed: PromptLease) -> None:
        # Ids submitted meanwhile are complete, not lost: only those still held count.
        lost = (set(ids) - {p.prompt_id for p in renewed.prompts}) & set(self.ledger.ids())
        if lost:
            log.warning("%d prompt lease(s) had expired; the proxy may issue them again", len(lost))

    def _renewals(self) -> tuple[dict[int, str], Renewals]:
        s = self.settings
        held = self.book.leases()
        return held, Renewals(
            version_leases=list(held.values()),
            version_ttl_s=s.version_lease_ttl_s,
            prompt_ids=self.ledger.ids(),
            prompt_ttl_s=s.prompt_lease_ttl_s,
        )

    def _renewed(self, held: dict[int, str], sent: Renewals, got: Renewed) -> None:
        for version, lease_id in held.items():
            if lease_id in got.versions and got.versions[lease_id] is None:
                self._version_lease_expired(version, lease_id)
        if sent.prompt_ids and got.prompts is not None:
            if got.prompts.prompts:
                self._prompts_renewed(sent.prompt_ids, got.prompts)
            else:
                log.warning("all %d prompt leases had expired", len(sent.prompt_ids))

    def push_metrics(self, *, renew: bool = False) -> bool:
        """Push the heartbeat; ``renew``: with the leases to renew. True when the proxy renewed them (an older
        proxy ignores them, a failed push renewed nothing: the caller renews on the renew routes then)."""
        if self.phase not in ("stopping",):
            self.phase = "generating" if self.book.current() is not None else "waiting for the first version"
        push = MetricsPush(
            worker_id=self.worker_id,
            metrics=self.metrics.snapshot(),
            loaded_versions=self.book.loaded_versions(),
            phase=self.phase,
            notes=dict(
                [
                    *((f"reward_error/{kind}", text) for kind, text in self.metrics.reward_errors.items()),
                    *((f"episode_error/{kind}", text) for kind, text in self.metrics.episode_errors.items()),
                ][:MAX_NOTES]
            ),
            samples=self.metrics.take_samples() or None,
        )
        held, renewals = self._renewals() if renew else ({}, None)
        if renewals is not None and (renewals.version_leases or renewals.prompt_ids):
            push.renew = renewals
        try:
            got = self.client.push_metrics(push)
        except errors.BucketRLError as exc:
            log.warning("metrics push failed: %s", exc.message)
            return False
        if push.renew is None:
            return renew  # nothing to renew
        if got is None:
            return False
        self._renewed(held, push.renew, got)
        return True

    # -- shutdown --------------------------------------------------------------------------------------

    def _shutdown(self) -> None:
        s = self.settings
        self.stop_event.set()
        self._version_ready.set()
        if self.submitter is not None and not self.submitter.close(s.shutdown_timeout_s):
            log.warning("shutdown: in-flight batches not submitted (within %.0fs) were released", s.shutdown_timeout_s)
        leftover = self.ledger.ids()
        if leftover:
            try:
                self.client.release_prompts(self.worker_id, leftover)
                self.metrics.add("rollout/released_prompts_total", len(leftover))
            except errors.BucketRLError as exc:
                log.warning("shutdown: could not release %d prompts (they will expire): %s", len(leftover), exc)
            self.ledger.remove(leftover)
        self.metrics.inflight(-self.metrics.inflight_groups)  # everything is settled or released now
        self._leaser.shutdown(wait=False)
        for lease_id in self.book.leases().values():
            self._release_version_lease(lease_id)
        if self.spec is not None:
            self.push_metrics()
        for t in self._threads:
            t.join(timeout=1.0)  # the long-poll thread may be mid-request; it is a daemon
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
        log.info("generator %s stopped", self.worker_id)
