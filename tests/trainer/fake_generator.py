"""A stand-in generator for trainer tests: the real wire (version lease, prompt lease, submit with an
idempotency key through ``ProxyClient``), random tokens instead of a model (the trainer is the subject).

Every accepted group's delivery id is ``{batch_id}:{g}`` (the proxy's stable id), recorded in ``accepted``, and the
group itself with the version it was sampled from in ``groups`` (to recompute a trainer's step).
``lag=k`` makes it a slow generator: it samples from version ``latest - k`` (the oldest the run accepts when
k = max_staleness) instead of the latest.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
import uuid

from bucketrl import errors
from bucketrl.client import ProxyClient
from bucketrl.wire import Completion, EvalResult, EvalSample, RolloutBatch, RolloutGroup

EOS = 1


class FakeGenerator(threading.Thread):
    def __init__(
        self,
        url: str,
        run: str,
        token: str,
        *,
        worker_id: str = "gen-fake",
        group_size: int = 4,
        seed: int = 0,
        lag: int = 0,
        multi_turn: bool = False,
        evaluate: bool = False,
    ) -> None:
        super().__init__(daemon=True, name=f"fake-{worker_id}")
        self.client = ProxyClient(url, run, token, retries=2, backoff_s=0.05)
        self.worker_id = worker_id
        self.group_size = group_size
        self.lag = lag
        # Multi-turn episodes (1-3 model turns with env tokens between; every other group splits its episodes).
        self.multi_turn = multi_turn
        # Evaluation during training: before each batch, evaluate the leased version's eval prompts (if the run
        # asks) with reward 0.1 * version and length = version, so a test knows each version's result.
        self.evaluate = evaluate
        self.evaluated: list[int] = []
        self.rng = random.Random(seed)
        self.halt = threading.Event()
        self.accepted: list[str] = []
        self.groups: dict[str, tuple[RolloutGroup, int]] = {}
        self.rejected_stale = 0
        self.errors: list[str] = []

    def stop(self) -> None:
        self.halt.set()
        self.join(30)
        self.client.close()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                self._one_batch()
            except errors.BucketRLError as exc:  # no version yet, backpressure, a proxy restart...
                lag_lost = self.lag and isinstance(exc, errors.Gone)  # the old version was collected meanwhile
                if not lag_lost and not isinstance(exc, errors.NotFound | errors.Backpressure | errors.Unavailable):
                    self.errors.append(f"{type(exc).__name__}: {exc.message}")
                self.halt.wait(min(exc.retry_after or 0.1, 0.3))

    def _one_batch(self) -> None:
        lease = self.client.lease_version(self.worker_id, ttl_s=60)
        if self.lag and lease.version > 1:
            latest = lease
            lease = self.client.lease_version(self.worker_id, version=max(1, latest.version - self.lag), ttl_s=60)
            self.client.release_lease(latest.lease_id)
        try:
            if self.evaluate:
                self._evaluate(lease.version)
            prompts = self.client.lease_prompts(self.worker_id, n=2, ttl_s=60).prompts
            if not prompts:
                self.halt.wait(0.1)
                return
            groups = [self._group(p.prompt_id, p.index) for p in prompts]
            batch = RolloutBatch(
                worker_id=self.worker_id, lease_id=lease.lease_id, version=lease.version, groups=groups
            )
            key = uuid.uuid4().hex
            while not self.halt.is_set():
                try:
                    resp = self.client.submit_rollouts(batch, key)
                except errors.Backpressure as exc:
                    self.halt.wait(min(exc.retry_after or 0.1, 0.3))
                    continue
                except errors.Stale:
                    self.rejected_stale += len(groups)
                    return
                if not resp.duplicate:
                    ids = [f"{resp.batch_id}:{g}" for g in range(resp.accepted_groups)]
                    self.groups.update((i, (g, lease.version)) for i, g in zip(ids, groups, strict=False))
                    self.accepted += ids
                return
        finally:
            with contextlib.suppress(errors.BucketRLError):
                self.client.release_lease(lease.lease_id)

    def _evaluate(self, version: int) -> None:
        items = self.client.lease_eval(self.worker_id, [version], n=64).items
        if items:
            sample = EvalSample(reward=0.1 * version, length=version)
            self.client.submit_eval(
                self.worker_id, [EvalResult(version=i.version, index=i.index, samples=[sample]) for i in items]
            )
            self.evaluated.append(version)

    def _group(self, prompt_id: str, index: int) -> RolloutGroup:
        if self.multi_turn:
            return self._episodes(prompt_id, index)
        rng = self.rng
        comps = []
        for _ in range(self.group_size):
            tokens = [rng.randrange(3, 64) for _ in range(rng.randint(1, 6))]
            if rng.random() < 0.5:
                tokens[-1] = EOS
            comps.append(
                Completion(
                    token_ids=tokens,
                    logprobs=[-3.9 - 0.4 * rng.random() for _ in tokens],
                    reward=float(rng.random() < 0.5),
                    finish_reason="stop" if tokens[-1] == EOS else "length",
                )
            )
        prompt = [rng.randrange(3, 64) for _ in range(rng.randint(2, 5))]
        return RolloutGroup(prompt_id=prompt_id, prompt_index=index, prompt_token_ids=prompt, completions=comps)

    def _episodes(self, prompt_id: str, index: int) -> RolloutGroup:
        rng = self.rng
        prompt = [rng.randrange(3, 64) for _ in range(rng.randint(2, 5))]
        split = index % 2 == 1
        comps: list[Completion] = []
        for e in range(self.group_size):
            reward = float(rng.random() < 0.5)
            segments: list[tuple[str, list[int], list[float] | None]] = []
            for turn in range(rng.randint(1, 3)):
                if turn:
                    segments.append(("env", [rng.randrange(3, 64) for _ in range(rng.randint(1, 3))], None))
                tokens = [rng.randrange(3, 64) for _ in range(rng.randint(1, 4))]
                segments.append(("model", tokens, [-3.9 - 0.4 * rng.random() for _ in tokens]))
            if not split:
                comps.append(Completion.from_segments(segments, reward))  # type: ignore[arg-type]
                continue
            # A template that re-renders history: each model turn is a sample with its own prompt.
            context = list(prompt)
            for kind, tokens, lps in segments:
                if kind == "model":
                    own = None if context == prompt else list(context)
                    comps.append(
                        Completion.from_segments([("model", tokens, lps)], reward, prompt_token_ids=own, episode=e)
                    )
                context += tokens
        return RolloutGroup(prompt_id=prompt_id, prompt_index=index, prompt_token_ids=prompt, completions=comps)


def wait_until(predicate, timeout_s: float = 60.0, interval_s: float = 0.1) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise TimeoutError(f"condition not met within {timeout_s}s")
