"""The trainer worker: claim rollouts through the proxy, step GRPO on LoRA, publish, checkpoint, ack.

    BUCKETRL_PROXY_URL=http://127.0.0.1:8000 BUCKETRL_TOKEN=... BUCKETRL_RUN=demo \\
    BUCKETRL_RUN_SPEC=run.json bucketrl trainer

Start-up
    1. create or confirm the run spec (``PUT /runs/{run}``; ``dataset.size`` counted when missing), or read it;
    2. register (``POST /runs/{run}/trainer``): a new fencing epoch; older trainers are fenced from now on;
    3. resume from the latest checkpoint: restore it, then ack the deliveries it lists (TEAM.md ack protocol);
    4. make sure the latest published version holds the current weights: publish v1 (the initial adapter)
       on a new run, or publish the restored weights as latest+1 when versions newer than the checkpoint
       exist (they came from weights that died with the previous trainer). Generators always sample from a
       version the trainer can reproduce.

Each step (until ``max_steps``)
    claim until ``groups_per_step`` groups (``perf/rollout_wait_s``) -> :meth:`Learner.train_step` ->
    every ``sync_every`` steps publish version latest+1 (``perf/weight_sync_s``) -> every ``checkpoint_every``
    steps write the checkpoint (it lists the deliveries consumed since the previous one) and THEN ack them
    -> push metrics (TRL names; staleness; per-generator logprob mismatch; zero-variance groups).

Endings
    ``max_steps`` reached: publish and checkpoint what is not yet, print where the final adapter is, exit 0.
    SIGTERM/SIGINT: stop claiming, finish the step in progress, checkpoint (then ack) if anything is new, exit 0.
    Fenced (another trainer registered): stop at once, publish nothing, exit 3 with a message saying so.
    Claimed-but-untrained deliveries are never acked: the proxy hands them out again.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from bucketrl import errors
from bucketrl.client import ProxyClient
from bucketrl.trainer.settings import TrainerSettings
from bucketrl.wire import Delivery, MetricsPush, RunSpec

log = logging.getLogger("bucketrl.trainer")

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_FENCED = 3

T = TypeVar("T")


class Stopped(Exception):
    """A stop was requested (SIGTERM) while waiting: wind down."""


class TrainerWorker:
    """One trainer process for one run. ``run()`` returns the exit code."""

    def __init__(
        self, settings: TrainerSettings, *, client: ProxyClient | None = None, echo: Callable[[str], None] = print
    ) -> None:
        self.settings = settings
        self.worker_id = settings.resolved_worker_id("trainer")
        self.client = client or ProxyClient(
            settings.proxy_url, settings.run, settings.token, timeout_s=settings.http_timeout_s
        )
        self.echo = echo
        self.stop_requested = threading.Event()
        self.epoch = 0
        self.latest_version = 0  # the newest version the proxy has (ours after every publish)
        self.policy_version = 0  # the version whose weights equal the current ones
        self.policy_step = -1  # the step at which policy_version was saved
        self.last_checkpoint_step = -1
        self.consumed: list[str] = []  # delivery ids trained on since the last checkpoint
        self.counters: dict[str, float] = {"sample/dropped_stale_total": 0.0}
        self.learner: Any = None
        self.spec: RunSpec | None = None

    # -- entry point ------------------------------------------------------------------------------------

    def request_stop(self, *_: object) -> None:
        if not self.stop_requested.is_set():
            log.info("stop requested: finishing the current step, then checkpointing")
        self.stop_requested.set()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)

    def run(self) -> int:
        try:
            return self._run()
        except errors.Fenced as exc:
            self.echo(
                f"bucketrl trainer: FENCED: another trainer registered for run {self.settings.run!r} after this one "
                f"(epoch {self.epoch}); this trainer stops without publishing anything more. ({exc.message})"
            )
            return EXIT_FENCED
        except ConfigError as exc:
            self.echo(f"bucketrl trainer: {exc}")
            return EXIT_CONFIG
        except errors.BucketRLError as exc:
            self.echo(f"bucketrl trainer: proxy error {exc.code}: {exc.message}")
            return EXIT_ERROR
        finally:
            self.client.close()

    def _run(self) -> int:
        from bucketrl.trainer.learner import Learner

        self.spec = self._ensure_run()
        reg = self.client.register_trainer(self.worker_id)
        self.epoch = reg.epoch
        self.latest_version = reg.latest_version
        log.info("registered as %s with epoch %d (latest version %d)", self.worker_id, self.epoch, self.latest_version)
        self._seed()
        self.learner = Learner(self.spec, self.settings)
        self._resume()
        self._ensure_published()
        self._audit({"event": "start", "epoch": self.epoch, "step": self.learner.step})
        while self.learner.step < self.settings.max_steps and not self.stop_requested.is_set():
            try:
                self._step()
            except Stopped:
                break
        return self._finish()

    # -- start-up -----------------------------------------------------------------------------------------

    def _ensure_run(self) -> RunSpec:
        given = self.settings.run_spec_dict()
        if given is None:
            try:
                return self.client.get_run().spec
            except errors.NotFound as exc:
                raise ConfigError(
                    f"run {self.settings.run!r} does not exist on the proxy: set BUCKETRL_RUN_SPEC to create it"
                ) from exc
        dataset = given.get("dataset")
        if isinstance(dataset, dict) and "size" not in dataset:
            from bucketrl.datasets import describe_dataset

            counted = describe_dataset(
                dataset.get("uri", ""),
                prompt_field=dataset.get("prompt_field", "prompt"),
                answer_field=dataset.get("answer_field", "answer"),
                split=dataset.get("split", "train"),
                client=self.client,
            )
            given = {**given, "dataset": {**dataset, "size": counted.size}}
            log.info("dataset %s has %d examples", counted.uri, counted.size)
        spec = RunSpec.model_validate(given)
        try:
            return self.client.put_run(spec).spec
        except errors.Conflict as exc:
            raise ConfigError(
                f"BUCKETRL_RUN_SPEC changes an immutable field of the existing run {self.settings.run!r}: "
                f"{exc.message}. Use a new BUCKETRL_RUN or the original spec."
            ) from exc

    def _seed(self) -> None:
        import random

        import numpy as np
        import torch

        random.seed(self.settings.seed)
        np.random.seed(self.settings.seed)
        torch.manual_seed(self.settings.seed)

    def _resume(self) -> None:
        from bucketrl.trainer.checkpoint import restore_checkpoint

        info = self.client.latest_checkpoint()
        if info is None:
            return
        state = restore_checkpoint(self.learner, self.client.download_checkpoint(info.step))
        self.policy_version, self.policy_step = state.policy_version, state.policy_step
        self.counters.update(state.counters)
        self.last_checkpoint_step = state.step
        # Deliveries trained into this checkpoint: ack them (again) before claiming anything.
        if state.consumed_delivery_ids:
            self._retrying(lambda: self.client.ack(state.consumed_delivery_ids))
        log.info(
            "resumed from checkpoint step %d (policy v%d); acked %d deliveries it lists",
            state.step,
            state.policy_version,
            len(state.consumed_delivery_ids),
        )
        self._audit({"event": "resume", "epoch": self.epoch, "step": state.step, "acked": state.consumed_delivery_ids})

    def _ensure_published(self) -> None:
        """Make the latest version equal the current weights (v1 on a new run)."""
        step = self.learner.step
        if self.latest_version == 0:
            self._publish()
        elif self.last_checkpoint_step < 0 and self.latest_version == 1:
            # v1 is the initial adapter: LoRA B is zero, so any initialisation computes the same function.
            self.policy_version, self.policy_step = 1, step
        elif not (self.latest_version == self.policy_version and self.policy_step == step):
            log.info("latest v%d is not the restored weights (step %d): publishing them", self.latest_version, step)
            self._publish()

    # -- one step -----------------------------------------------------------------------------------------

    def _step(self) -> None:
        from bucketrl.trainer.learner import StepGroup

        t0 = time.perf_counter()
        deliveries, wait_s, dropped = self._claim_groups()
        groups = [StepGroup(g, d.version, d.worker_id) for d in deliveries for g in d.groups]
        stats = self.learner.train_step(groups, policy_version=self.policy_version)
        self.consumed += [d.delivery_id for d in deliveries]
        step = self.learner.step
        self._audit(
            {"event": "step", "epoch": self.epoch, "step": step, "deliveries": [d.delivery_id for d in deliveries]}
        )
        self.counters["sample/dropped_stale_total"] += dropped
        stats["perf/rollout_wait_s"] = wait_s
        if step % self.settings.sync_every == 0:
            stats["perf/weight_sync_s"] = self._publish()
        if step % self.settings.checkpoint_every == 0:
            stats["perf/checkpoint_s"] = self._checkpoint()
        stats["sample/dropped_stale"] = float(dropped)
        stats["sample/dropped_stale_total"] = self.counters["sample/dropped_stale_total"]
        stats["policy/version"] = float(self.policy_version)
        stats["perf/step_s"] = time.perf_counter() - t0
        self._push(step, stats)
        log.info(
            "step %d/%d loss %.4f reward %.3f staleness %.2f wait %.2fs step %.2fs",
            step,
            self.settings.max_steps,
            stats.get("train/loss", 0.0),
            stats.get("reward", math.nan),
            stats.get("sample/staleness_mean", math.nan),
            wait_s,
            stats["perf/step_s"],
        )

    def _claim_groups(self) -> tuple[list[Delivery], float, int]:
        """Claim until the step holds ``groups_per_step`` groups. Raises Stopped on a stop request."""
        assert self.spec is not None
        need = self.spec.groups_per_step
        got: list[Delivery] = []
        dropped = 0
        t0 = time.monotonic()
        n = 0
        while n < need:
            if self.stop_requested.is_set():
                raise Stopped
            waited = time.monotonic() - t0
            if self.settings.max_rollout_wait_s and waited > self.settings.max_rollout_wait_s:
                raise errors.Unavailable(
                    f"no rollouts for {waited:.0f}s (BUCKETRL_MAX_ROLLOUT_WAIT_S): are generators running?"
                )
            resp = self._retrying(
                lambda k=need - n: self.client.claim(self.worker_id, max_groups=k, wait_s=self.settings.claim_wait_s)
            )
            dropped += resp.dropped_stale
            got += resp.deliveries
            n = sum(len(d.groups) for d in got)
        return got, time.monotonic() - t0, dropped

    # -- publish, checkpoint, metrics -----------------------------------------------------------------------

    def _publish(self) -> float:
        t0 = time.perf_counter()
        tar = self.learner.policy.adapter_tar()
        version = self.latest_version + 1
        self._retrying(lambda: self.client.publish_adapter(version, tar))
        self.latest_version = self.policy_version = version
        self.policy_step = self.learner.step
        log.info("published v%d (step %d, %d bytes)", version, self.policy_step, len(tar))
        return time.perf_counter() - t0

    def _checkpoint(self) -> float:
        from bucketrl.trainer.checkpoint import TrainerState, pack_checkpoint

        t0 = time.perf_counter()
        step = self.learner.step
        consumed = list(self.consumed)
        state = TrainerState(
            step=step,
            policy_version=self.policy_version,
            policy_step=self.policy_step,
            consumed_delivery_ids=consumed,
            counters=dict(self.counters),
            epoch=self.epoch,
            run=self.settings.run,
        )
        tar = pack_checkpoint(self.learner, state)
        self._retrying(lambda: self.client.put_checkpoint(step, tar))
        # Only now that the checkpoint (which lists them) is durable: ack what it trained on.
        if consumed:
            self._retrying(lambda: self.client.ack(consumed))
        self.consumed = []
        self.last_checkpoint_step = step
        log.info("checkpoint step %d stored (%d bytes); acked %d deliveries", step, len(tar), len(consumed))
        self._audit({"event": "checkpoint", "epoch": self.epoch, "step": step, "acked": consumed})
        return time.perf_counter() - t0

    def _push(self, step: int, stats: dict[str, float]) -> None:
        metrics = {k: float(v) for k, v in stats.items() if isinstance(v, int | float) and math.isfinite(v)}
        try:
            self.client.push_metrics(MetricsPush(worker_id=self.worker_id, step=step, metrics=metrics))
        except errors.BucketRLError as exc:  # metrics are best effort: never stop training for them
            log.warning("metrics push failed: %s", exc)

    def _finish(self) -> int:
        step = self.learner.step
        stopped = self.stop_requested.is_set()
        if self.policy_step != step and not stopped:
            self._publish()
        if step > 0 and self.last_checkpoint_step != step:
            self._checkpoint()
        if stopped:
            self.echo(f"bucketrl trainer: stopped at step {step} (checkpointed); resume by starting it again")
            return EXIT_OK
        run = self.settings.run
        self.echo(
            f"bucketrl trainer: done, {step} steps. Final adapter: v{self.policy_version} at "
            f"runs/{run}/adapters/v{self.policy_version}/files/ in the proxy's bucket (PeftModel.from_pretrained "
            f"loads that directory); also GET {self.settings.proxy_url}/v1/runs/{run}/adapters/{self.policy_version}"
        )
        return EXIT_OK

    # -- helpers ------------------------------------------------------------------------------------------------

    def _retrying(self, call: Callable[[], T]) -> T:
        """Retry a call through proxy outages (503 / unreachable) for up to ``proxy_retry_s``.

        Every call retried here is idempotent on the proxy: claims of a dead request are redelivered, a
        re-sent publish or checkpoint of the same bytes answers 200, acks are idempotent.
        """
        deadline = time.monotonic() + self.settings.proxy_retry_s
        while True:
            try:
                return call()
            except errors.Unavailable as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("proxy unavailable (%s); retrying", exc.message)
                time.sleep(1.0)

    def _audit(self, record: dict[str, Any]) -> None:
        if not self.settings.audit_log:
            return
        with Path(self.settings.audit_log).open("a") as fh:
            fh.write(json.dumps(record) + "\n")


class ConfigError(Exception):
    """A setting is wrong: the message says which one."""


def main(settings: TrainerSettings) -> int:
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    worker = TrainerWorker(settings)
    worker.install_signal_handlers()
    return worker.run()
