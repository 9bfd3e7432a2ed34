"""Evaluation during training on the generator (bucketrl/proxy/state/evals.py): eval prompts of a loaded version,
sampled with the run's eval settings, scored with its reward and submitted, between training batches."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from bucketrl import errors
from bucketrl.client import ProxyClient
from bucketrl.datasets import examples_for_run
from bucketrl.generator.adapters import VersionBook
from bucketrl.generator.metrics import GeneratorMetrics
from bucketrl.rewards import RewardItem, RewardPool
from bucketrl.rollout.detokenize import complete_text
from bucketrl.rollout.engine import Engine, SampledCompletion
from bucketrl.rollout.example import Example
from bucketrl.wire import EvalResult, EvalSample, RunSpec
from bucketrl.wire.runs import DatasetSpec

# The worker's logger: these lines read as they did when this code was part of the worker.
log = logging.getLogger("bucketrl.generator.worker")

# A version the proxy had no eval prompts of for us is asked about again after this long (s).
EVAL_RECHECK_S = 30.0


class Evaluator:
    """The generator's eval batches; ``spec`` is read at each call (mutable run fields change between versions)."""

    def __init__(
        self,
        *,
        client: ProxyClient,
        worker_id: str,
        spec: Callable[[], RunSpec | None],
        engine: Engine,
        pool: RewardPool,
        book: VersionBook,
        metrics: GeneratorMetrics,
        encode: Callable[[Example, int], list[int]],
        tokenizer: Any,
        prompts_per_request: int,
        stop_event: threading.Event,
    ) -> None:
        self.client = client
        self.worker_id = worker_id
        self.spec = spec
        self.engine = engine
        self.pool = pool
        self.book = book
        self.metrics = metrics
        self.encode = encode
        self.tokenizer = tokenizer
        self.prompts_per_request = prompts_per_request
        self.stop_event = stop_event
        self._eval_examples: tuple[DatasetSpec, list[Example]] | None = None
        # version -> when the proxy had no eval prompt of it for us (all done, or leased to others: asked again
        # after EVAL_RECHECK_S, in case another generator's leases expire unfinished).
        self._eval_done: dict[int, float] = {}
        self._eval_broken: DatasetSpec | None = None  # an eval set that could not be read

    def evaluate_some(self) -> None:
        """One batch of eval prompts of a loaded version, sampled with the eval settings, scored with the run's
        reward and submitted. Called when the training lease came back empty and after each training batch (the
        prefetched training lease keeps running meanwhile): eval takes at most one small batch per training
        batch. Versions the proxy had nothing more for are not asked about again."""
        spec = self.spec()
        if spec is None or spec.eval is None or spec.env is not None:
            self.book.unpin(*self.book.pinned())
            return  # multi-turn runs are not evaluated by generators (yet): their episodes need the environment
        if self._eval_broken is not None and self._eval_broken == spec.eval_dataset():
            return
        now = time.monotonic()
        versions = self._versions_due(spec, now)
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
            items = self.client.lease_eval(self.worker_id, versions, n=self.prompts_per_request).items
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
        samples = self._sample(spec, version, [examples[i.index] for i in items])
        if samples is None:
            return
        results = self._score(version, [examples[i.index] for i in items], [i.index for i in items], samples)
        try:
            self.client.submit_eval(self.worker_id, results)
            self.metrics.add("eval/prompts_total", len(results))
        except errors.BucketRLError as exc:
            log.warning("eval results not submitted (%s); the prompts are evaluated again", exc.message)

    def _versions_due(self, spec: RunSpec, now: float) -> list[int]:
        """Loaded versions the run evaluates that the proxy may still have eval prompts of."""
        assert spec.eval is not None
        return [
            v
            for v in self.book.loaded_versions()
            if spec.eval.evaluates(v) and now - self._eval_done.get(v, -math.inf) > EVAL_RECHECK_S
        ]

    def _sample(self, spec: RunSpec, version: int, examples: list[Example]) -> list[list[SampledCompletion]] | None:
        """The eval samples of ``examples`` with ``version``; None if it was retired or the engine failed."""
        assert spec.eval is not None
        try:
            slot = self.book.begin(version)
        except KeyError:  # retired since the lease: the lease expires and another generator does it
            return None
        # The proxy had prompts of it: keep it loaded past the staleness window until none are left, else a
        # version whose eval outlasts the window is never finished (seen: 16 of 32 prompts of v51 in the demo).
        self.book.pin(version)
        try:
            sampling = spec.eval_sampling()
            assert sampling is not None
            ids = [self.encode(ex, sampling.max_new_tokens) for ex in examples]
            return self.engine.generate(ids, adapter=slot.name, n=spec.eval.n, sampling=sampling)
        except Exception:
            log.exception("engine failed on %d eval prompts (their lease expires; evaluated again)", len(examples))
            return None
        finally:
            self.book.end(version)

    def _score(
        self, version: int, examples: list[Example], indices: list[int], samples: list[list[SampledCompletion]]
    ) -> list[EvalResult]:
        """Each prompt's samples scored with the run's reward, as the proxy's eval results."""
        flat = [
            RewardItem(complete_text(self.tokenizer, smp.token_ids), ex.answer, ex.prompt)
            for ex, group in zip(examples, samples, strict=True)
            for smp in group
        ]
        rewards = iter(self.pool.score(flat, cancel=self.stop_event))
        return [
            EvalResult(
                version=version,
                index=index,
                samples=[EvalSample(reward=next(rewards), length=len(smp.token_ids)) for smp in group],
            )
            for index, group in zip(indices, samples, strict=True)
        ]

    def _eval_set(self, spec: RunSpec) -> list[Example]:
        """The eval set's examples (loaded once per eval dataset spec)."""
        ds = spec.eval_dataset()
        assert ds is not None
        if self._eval_examples is None or self._eval_examples[0] != ds:
            self._eval_examples = (ds, examples_for_run(ds, self.client))
        return self._eval_examples[1]
