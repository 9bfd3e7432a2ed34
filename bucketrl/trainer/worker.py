"""The trainer worker: claim rollouts through the proxy, step GRPO on LoRA, publish, checkpoint, ack.

    BUCKETRL_PROXY_URL=http://127.0.0.1:8000 BUCKETRL_TOKEN=... BUCKETRL_RUN=demo \\
    BUCKETRL_RUN_SPEC=run.json bucketrl trainer

Start-up
    1. create or confirm the run spec (``PUT /runs/{run}``; ``dataset.size`` counted when missing), or read it;
       upload BUCKETRL_DATASET_FILE as the run's dataset (``bucket:dataset.jsonl``) when given;
    2. load the model, then register (``POST /runs/{run}/trainer``): a new fencing epoch; older trainers are
       fenced from now on (loading first keeps the hand-over gap short);
    3. resume from the latest checkpoint: restore it, then ack the deliveries it lists (TEAM.md ack protocol);
    4. make sure the latest published version holds the current weights: publish v1 (the initial adapter)
       on a new run, or publish the restored weights as latest+1 when versions newer than the checkpoint
       exist (they came from weights that died with the previous trainer). Generators always sample from a
       version the trainer can reproduce.

Each step (until ``max_steps``)
    take the claimed groups (``groups_per_step``; the time blocked on them is ``perf/rollout_wait_s``) and start
    claiming the next step's (with ``min_version`` = the version that step will train with - max_staleness, so no
    trained group is staler than max_staleness) -> :meth:`Learner.train_step` -> every ``sync_every`` steps publish
    version latest+1 -> every ``checkpoint_every`` steps write the checkpoint (it lists the deliveries consumed
    since the previous one) and THEN ack them -> push metrics (TRL names; staleness; per-generator logprob
    mismatch; zero-variance groups).

    Claims run a step ahead on a helper thread; publishes, checkpoints, acks and metric pushes run in order on the
    :class:`~bucketrl.trainer.uploader.Uploader` thread from snapshots taken at the step, so the next step's
    compute overlaps the proxy round trips (``bench/trainer_overhead.py`` measures it).

Endings
    ``max_steps`` reached: publish and checkpoint what is not yet, print where the final adapter is, exit 0.
    SIGTERM/SIGINT, or a drain of this worker (a preemption notice, issue 25: its long-poll or a push's answer):
    stop claiming, finish the step in progress, checkpoint (then ack) if anything is new, exit 0.
    Fenced (another trainer registered): stop at once, publish nothing, exit 3 with a message saying so.
    Claimed-but-untrained deliveries are never acked: the proxy hands them out again.
"""

from __future__ import annotations

import json
import logging
import math
import random
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from bucketrl import errors, preflight
from bucketrl.client import ProxyClient
from bucketrl.drain_watch import DrainWatch
from bucketrl.trainer.claims import ClaimLoop, within_staleness
from bucketrl.trainer.cost_reports import CostReports
from bucketrl.trainer.exits import EXIT_CONFIG, EXIT_ERROR, EXIT_FENCED, EXIT_OK, ConfigError, RankFailure, Stopped
from bucketrl.trainer.ledger import DeliveryLedger
from bucketrl.trainer.reporting import EVAL_REPORTED, EvalReports, RewardWatch, log_step, step_audit
from bucketrl.trainer.retry import retrying
from bucketrl.trainer.run_setup import ensure_run, finish_generation, open_run_trackers
from bucketrl.trainer.settings import TrainerSettings
from bucketrl.trainer.step_group import StepGroup
from bucketrl.trainer.uploader import Uploader
from bucketrl.wire import Delivery, MetricsPush, RunSpec

log = logging.getLogger("bucketrl.trainer")

T = TypeVar("T")


class TrainerWorker:
    """One trainer process for one run. ``run()`` returns the exit code.

    The worker is the loop (:meth:`_run`, :meth:`_step`); its collaborators:
    :func:`~bucketrl.trainer.run_setup.ensure_run` (the run spec and dataset),
    :class:`~bucketrl.trainer.claims.ClaimLoop` (claims, on a helper thread), the learner (the GRPO step),
    :class:`~bucketrl.trainer.uploader.Uploader` (publish, checkpoint, ack, metrics in order),
    :class:`~bucketrl.trainer.reporting.EvalReports` and :class:`~bucketrl.trainer.reporting.RewardWatch`.
    """

    def __init__(
        self,
        settings: TrainerSettings,
        *,
        echo: Callable[[str], None] = print,
        ranks: Any = None,
        speaker: Any = None,
    ) -> None:
        self.settings = settings
        # Under torchrun this is rank 0, which speaks for all ranks: ``speaker`` (distributed.SpeakerHooks, passed in
        # by the torchrun entry, bucketrl/trainer/distributed.py) tells the others what to train. None: one process.
        self.ranks = ranks
        self.speaker: Any = speaker
        self.worker_id = settings.resolved_worker_id("trainer")
        # One client per thread (main, claim prefetch, uploader): each keeps its own connection. They share one
        # outage budget (BUCKETRL_OUTAGE_BUDGET_S) and log an outage once, whichever thread meets it first.
        self.outage = settings.outage(self.worker_id)
        self.client, self.claim_client, self.write_client = (self._new_client() for _ in range(3))
        self.echo = echo
        self.stop_requested = threading.Event()
        self.stop_at: float | None = None  # when SIGTERM (a preemption notice, issue 25) came, monotonic
        self.notice_s: float | None = None  # a drain's notice (issue 25), once one came
        self.epoch = 0
        self.latest_version = 0  # the newest version on the proxy (ours after every publish)
        self.policy_version = 0  # the version whose weights equal the current ones
        self.policy_step = -1  # the step at which policy_version was saved
        self.last_checkpoint_step = -1
        self.consumed: list[str] = []  # delivery ids trained on (or held as repeats) since the last checkpoint
        self.ledger = DeliveryLedger()  # what this lineage took for training: repeats are held, not trained
        self.counters: dict[str, float] = {"sample/dropped_stale_total": 0.0}
        self.last_sync_s = math.nan  # duration of the latest completed publish (snapshot to commit)
        self.learner: Any = None
        self.spec: RunSpec | None = None
        self.uploader: Uploader | None = None
        self._prefetch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bucketrl-claim")
        # Where adapter and checkpoint files are written before packing (BUCKETRL_WORK_DIR; default: $TMPDIR).
        self.scratch: Path | None = Path(settings.work_dir) if settings.work_dir else None
        if self.scratch is not None:
            self.scratch.mkdir(parents=True, exist_ok=True)
        self._audit_lock = threading.Lock()
        self.run_created_at = 0.0  # the run's creation time on the proxy: names the tracker run
        self.trackers: Any = None
        self.phase = "starting"
        self.rewards = RewardWatch(settings.max_unscorable_fraction, settings.max_failed_episode_fraction)
        self.eval_reports = EvalReports(self.counters)  # shares the checkpointed counters
        self.cost_reports = CostReports()
        self.claims = ClaimLoop(
            settings=settings,
            client=self.claim_client,
            worker_id=self.worker_id,
            spec=lambda: self.spec,
            ledger=self.ledger,
            stop_requested=self.stop_requested,
            retrying=self._retrying,
        )

    def _new_client(self) -> ProxyClient:
        return self.settings.proxy_client(self.outage)

    # -- entry point ------------------------------------------------------------------------------------

    def request_stop(self, *_: object) -> None:
        if not self.stop_requested.is_set():
            self.stop_at = time.monotonic()
            log.info("stop requested (a preemption notice): finishing the current step, then checkpointing at once")
        self.stop_requested.set()
        self.outage.stopping()

    def drained(self, notice_s: float, why: str = "drain") -> None:
        """A drain (its long-poll, a push's answer) or the cloud's spot notice: stop as SIGTERM does, checkpoint."""
        if self.notice_s is None:
            log.warning("preemption notice (%s, %.1fs): finishing the step, then checkpointing at once", why, notice_s)
            self.notice_s = notice_s
        self.request_stop()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)

    def run(self) -> int:
        code = EXIT_ERROR
        spot = self.settings.spot_watch(self.drained, self.stop_requested)  # the cloud's own notice (issue 33)
        try:
            code = self._run_reporting()
            return code
        finally:
            if spot is not None:
                spot.done()  # Azure: acknowledged once the checkpoint is written, not before
            if self.speaker is not None:  # the other ranks exit with rank 0's code
                self.speaker.stop(code)

    def _run_reporting(self) -> int:
        try:
            return self._run()
        except errors.Fenced as exc:
            self.echo(
                f"bucketrl trainer: FENCED: another trainer registered for run {self.settings.run!r} after this one "
                f"(epoch {self.epoch}); this trainer stops without publishing anything more. ({exc.message})"
            )
            return EXIT_FENCED
        except (ConfigError, preflight.ConfigError) as exc:
            # One line with the prefix `bucketrl up` looks for; status shows the note.
            self.echo(f"bucketrl trainer: {preflight.CONFIG_ERROR_PREFIX}{exc}")
            self._announce("stopped: configuration error", {"config_error": str(exc)[:1000]})
            return EXIT_CONFIG
        except errors.BucketRLError as exc:
            self.echo(f"bucketrl trainer: proxy error {exc.code}: {exc.message}")
            return EXIT_ERROR
        except RankFailure as exc:
            self.echo(f"bucketrl trainer: {exc}")
            return EXIT_ERROR
        finally:
            self.stop_requested.set()  # ends a prefetching claim within claim_wait_s
            self._prefetch.shutdown(wait=True)
            if self.uploader is not None:
                self.uploader.close()
            if self.trackers is not None:
                self.trackers.close()
            for c in (self.client, self.claim_client, self.write_client):
                c.close()

    def _make_learner(self, spec: RunSpec) -> Any:
        """The policy, optimizer and step counter (the simulated trainer, ``bucketrl.sim.trainer``, swaps it),
        after `bucketrl up`'s checks of the model, dataset, LoRA targets and context (a production trainer has no
        `up` in front of it): a mistake is one line and exit 2 (preflight.ConfigError). The reward is not checked:
        the trainer never runs it."""
        from bucketrl.trainer.learner import Learner

        preflight.check_run(spec, names=preflight.SPEC_NAMES, client=self.client, reward="skip")
        self._announce("loading model")
        return Learner(spec, self.settings, ranks=self.ranks)

    def _run(self) -> int:
        self._announce("checking configuration")
        self.spec = self._ensure_run()
        if self.speaker is not None:
            self.speaker.spec(self.spec)
        self._seed()
        self.learner = self._make_learner(self.spec)
        if self.stop_requested.is_set():  # SIGTERM during the model load: leave the current trainer alone
            self.echo("bucketrl trainer: stopped before registering; nothing changed")
            return EXIT_OK
        reg = self.client.register_trainer(self.worker_id)
        self.epoch = self.claim_client.epoch = self.write_client.epoch = reg.epoch
        self.latest_version = reg.latest_version
        log.info("registered as %s with epoch %d (latest version %d)", self.worker_id, self.epoch, self.latest_version)
        self.uploader = Uploader()
        # A spot-notice watcher's drain reaches the trainer in milliseconds (bucketrl/drain_watch.py); each poll as
        # long as a claim's, so a stopping trainer leaves none open for longer than its claims.
        wait_s = self.settings.claim_wait_s
        DrainWatch(self._new_client(), self.worker_id, self.drained, self.stop_requested, wait_s=wait_s).start()
        self._resume()
        self._open_trackers()
        if self.speaker is not None:  # every rank continues from rank 0's (restored) state
            self.speaker.state(self.learner)
        self._ensure_published()
        self._audit({"event": "start", "epoch": self.epoch, "step": self.learner.step})
        self._announce("waiting for rollouts")
        pending = self._claim_ahead(steps_ahead=1)
        while self.learner.step < self.settings.max_steps and not self.stop_requested.is_set():
            t0 = time.perf_counter()
            try:
                deliveries, dropped, repeats = pending.result() if self.speaker is None else self.speaker.wait(pending)
            except Stopped:
                break
            wait_s = time.perf_counter() - t0
            if self.learner.step + 1 < self.settings.max_steps:
                pending = self._claim_ahead(steps_ahead=2)  # for the step after the one about to train
            self._step(deliveries, dropped, wait_s, t0, repeats)
        return self._finish()

    # -- start-up -----------------------------------------------------------------------------------------

    def _ensure_run(self) -> RunSpec:
        spec, self.run_created_at = ensure_run(self.settings, self.client)
        return spec

    def _seed(self) -> None:
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
        self.ledger.seed(state.earlier_delivery_ids)
        self.ledger.seed(state.consumed_delivery_ids)
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

    def _open_trackers(self) -> None:
        assert self.spec is not None
        self.trackers = open_run_trackers(self.settings, self.spec, self.run_created_at, self.learner.step)

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
        if self.policy_version not in self.learner.versions:
            self._remember(self.policy_version, self.learner.policy.adapter_snapshot())
        self._uploader().drain()  # generators must find it before the first claim can be answered

    # -- one step -----------------------------------------------------------------------------------------

    def _step(
        self, deliveries: list[Delivery], dropped: int, wait_s: float, t0: float, repeats: list[str] | None = None
    ) -> None:
        """One step, in stages: collect the claimed groups, train on them, consume their deliveries, publish and
        snapshot what is due, report, then store the checkpoint."""
        self._uploader().check()  # a failed background write (e.g. fenced) ends the run before more work
        deliveries, held_back, groups = self._collect(deliveries)
        stats = self._train(groups)
        step = self._consume(deliveries, list(repeats or []), stats)
        self.counters["sample/dropped_stale_total"] += dropped
        stats["perf/rollout_wait_s"] = wait_s
        store_checkpoint = self._publish_and_snapshot(step)
        self._report(step, stats, dropped=dropped, held_back=held_back, t0=t0)
        if store_checkpoint is not None:
            store_checkpoint()
        log_step(step, self.settings.max_steps, stats, wait_s)

    def _collect(self, deliveries: list[Delivery]) -> tuple[list[Delivery], int, list[Any]]:
        """The deliveries within the staleness window, how many groups were held back, and the step's groups;
        the completions without a reward are counted (and may stop the run)."""
        assert self.spec is not None
        deliveries, held_back = within_staleness(
            deliveries, policy_version=self.policy_version, max_staleness=self.spec.max_staleness, ledger=self.ledger
        )
        groups = [StepGroup(g, d.version, d.worker_id, d.sampling) for d in deliveries for g in d.groups]
        self._check_rewards(deliveries)
        return deliveries, held_back, groups

    def _train(self, groups: list[Any]) -> dict[str, float]:
        """The GRPO step (on every rank: rank 0 sends the others the groups first)."""
        if self.speaker is not None:
            self.speaker.step(groups, self.policy_version)
        stats = self.learner.train_step(groups, policy_version=self.policy_version)
        stats["reward/unscorable_frac"] = self.rewards.last_fraction()
        if (failed := self.rewards.last_failed_fraction()) is not None:
            stats["episode/failed_frac"] = failed
        return stats

    def _consume(self, deliveries: list[Delivery], repeats: list[str], stats: dict[str, float]) -> int:
        """Record the step's deliveries (and repeats) as consumed, for the next checkpoint to ack; the step."""
        # Repeats of deliveries this lineage already trained (their claims came after the ones that trained
        # them, so they are trained by now): not trained again, acked with the next checkpoint.
        # (A repeat of one trained in this interval is listed once: a checkpoint acks each delivery once.)
        self.consumed = list(dict.fromkeys(self.consumed + [d.delivery_id for d in deliveries] + repeats))
        step = self.learner.step
        self._audit(
            {
                "event": "step",
                "epoch": self.epoch,
                "step": step,
                "deliveries": [d.delivery_id for d in deliveries],
                "repeats": repeats,
                **step_audit(stats),
            }
        )
        if repeats:
            stats["sample/repeats_held"] = float(len(repeats))
            log.info(
                "held %d redelivered group(s) this lineage already trained; acked with the next checkpoint",
                len(repeats),
            )
        return step

    def _publish_and_snapshot(self, step: int) -> Callable[[], None] | None:
        """Publish every ``sync_every`` steps, snapshot a checkpoint every ``checkpoint_every`` (returns its store)."""
        if step % self.settings.sync_every == 0:
            self._publish()
        # Snapshotted now (its cost is part of the step), stored after this step's metrics push: that push may
        # report an eval result, and the checkpoint must hold what was reported up to its step (_new_eval_metrics).
        # The last step's checkpoint is _finish's, after the run's final eval report.
        final = step >= self.settings.max_steps
        due = step % self.settings.checkpoint_every == 0 and not final
        return self._checkpoint(submit=False) if due else None

    def _report(self, step: int, stats: dict[str, float], *, dropped: int, held_back: int, t0: float) -> None:
        """The step's metrics, pushed (with an eval result, if one is new) on the uploader thread."""
        if math.isfinite(self.last_sync_s):
            stats["perf/weight_sync_s"] = self.last_sync_s
        stats["sample/dropped_stale"] = float(dropped)
        if held_back:
            stats["sample/stale_held_back"] = float(held_back)
        stats["sample/dropped_stale_total"] = self.counters["sample/dropped_stale_total"]
        stats["policy/version"] = float(self.policy_version)
        stats["perf/step_s"] = time.perf_counter() - t0
        # The last step's eval report is made by _finish, which can wait for the final version's evaluation.
        self._push(step, stats, report_eval=step < self.settings.max_steps)

    def _check_rewards(self, deliveries: list[Delivery]) -> None:
        """:meth:`RewardWatch.check`: preflight.ConfigError (exit 2) when too many recent completions lack a reward."""
        self.rewards.check(deliveries, self.spec.reward.name if self.spec else "?")

    def _announce(self, phase: str, notes: dict[str, str] | None = None) -> None:
        """Tell the proxy what this trainer is doing (status, dashboard, live view); best effort."""
        self.phase = phase
        self.settings.push_phase(self.worker_id, phase, notes)

    def _claim_ahead(self, steps_ahead: int) -> Future[tuple[list[Delivery], int, list[str]]]:
        """Start claiming (helper thread) the groups of the step ``steps_ahead`` steps from now.

        The proxy only knows its own ``latest``, which lags the version this trainer will train those groups
        with: the claim runs a step ahead, and the publish at the end of the step in between is asynchronous.
        So the claim carries ``min_version`` = that train-time version - max_staleness, and the proxy drops (and
        counts) every group below it: no trained group is staler than max_staleness (docs/design.md section 4).
        """
        assert self.spec is not None
        train_version = self._train_version(steps_ahead)
        return self._prefetch.submit(self._claim_groups, train_version)

    def _train_version(self, steps_ahead: int) -> int:
        """The policy version step ``learner.step + steps_ahead`` trains with: the current one plus one for each
        step in between that publishes (every ``sync_every``-th, at its end). Read on the main thread only."""
        step = self.learner.step
        syncs = sum(1 for k in range(step + 1, step + steps_ahead) if k % self.settings.sync_every == 0)
        return self.policy_version + syncs

    def _claim_groups(self, train_version: int) -> tuple[list[Delivery], int, list[str]]:
        """:meth:`ClaimLoop.claim_groups` (on the claim helper thread)."""
        return self.claims.claim_groups(train_version)

    # -- publish, checkpoint, metrics (snapshots now, writes on the uploader thread) ------------------------

    def _uploader(self) -> Uploader:
        assert self.uploader is not None
        return self.uploader

    def _publish(self) -> None:
        t0 = time.perf_counter()
        snap = self.learner.policy.adapter_snapshot()
        dtype = self.learner.policy.adapter_dtype
        version = self.latest_version + 1
        step = self.learner.step
        self._remember(version, snap)

        def job() -> None:
            t1 = time.perf_counter()
            tar = snap.tar(self.scratch, dtype)  # the master weights stay float32; only what ships is cast
            t2 = time.perf_counter()
            self._retrying(lambda: self.write_client.publish_adapter(version, tar))
            self.last_sync_s, tar_s, put_s = time.perf_counter() - t0, t2 - t1, time.perf_counter() - t2
            # up's sync latency and the benches parse this line: its shape stays, what follows "s" is free.
            line = "published v%d (step %d, %d bytes) in %.3fs (%s; tar %.3fs, put %.3fs)"
            log.info(line, version, step, len(tar), self.last_sync_s, dtype, tar_s, put_s)

        self._uploader().submit(f"publish v{version}", job)
        # The uploader runs jobs in order and stops at the first failure, so everything submitted after this
        # (checkpoints naming this version) happens only once the version is committed.
        self.latest_version = self.policy_version = version
        self.policy_step = step

    def _checkpoint(self, *, submit: bool = True) -> Callable[[], None]:
        """Snapshot the learner now and store it on the uploader thread: at once, or (``submit=False``) when the
        returned function is called, so that jobs submitted in between (the step's metrics push) run first."""
        from bucketrl.trainer.checkpoint import TrainerState, snapshot

        t0 = time.perf_counter()
        step = self.learner.step
        consumed = list(self.consumed)
        snap = snapshot(
            self.learner,
            TrainerState(
                step=step,
                policy_version=self.policy_version,
                policy_step=self.policy_step,
                consumed_delivery_ids=consumed,
                earlier_delivery_ids=self.ledger.remembered(),
                counters=dict(self.counters),
                epoch=self.epoch,
                run=self.settings.run,
            ),
        )

        def job() -> None:
            # The eval results reported so far are the uploader thread's (it reports them with the metrics pushes,
            # which ran before this job): read now, so a resumed trainer reports none of them again.
            if EVAL_REPORTED in self.counters:
                snap.state.counters[EVAL_REPORTED] = self.counters[EVAL_REPORTED]
            tar = snap.pack(self.scratch)
            self._retrying(lambda: self.write_client.put_checkpoint(step, tar))
            # Only now that the checkpoint (which lists them) is durable: ack what it trained on.
            if consumed:
                self._retrying(lambda: self.write_client.ack(consumed))
            log.info(
                "checkpoint step %d stored (%d bytes) and %d deliveries acked in %.3fs",
                step,
                len(tar),
                len(consumed),
                time.perf_counter() - t0,
            )
            self._audit({"event": "checkpoint", "epoch": self.epoch, "step": step, "acked": consumed})

        def store() -> None:
            self._uploader().submit(f"checkpoint {step}", job)

        if submit:
            store()
        self.consumed = []
        self.ledger.checkpointed()
        self.last_checkpoint_step = step
        return store

    def _push(self, step: int, stats: dict[str, float], *, report_eval: bool = True) -> None:
        metrics = {k: float(v) for k, v in stats.items() if isinstance(v, int | float) and math.isfinite(v)}
        notes = {f"reward_error/{kind}": text for kind, text in self.rewards.reward_errors.items()}
        notes.update({f"episode_error/{kind}": text for kind, text in self.rewards.episode_errors.items()})
        trackers = self.trackers
        with_eval = report_eval and self.spec is not None and self.spec.eval is not None

        def job() -> None:
            if with_eval:
                metrics.update(self._new_eval_metrics())
            push = MetricsPush(worker_id=self.worker_id, step=step, metrics=metrics, phase="training", notes=notes)
            push.gpu_class, push.usd_per_hour = self.settings.declared_gpu_class(), self.settings.usd_per_hour
            if trackers is not None:  # guarded: a failing tracker is dropped with one warning
                final = step >= self.settings.max_steps
                trackers.log({**metrics, **self.cost_reports.due(self.write_client, final=final)}, step)
            try:
                got = self.write_client.push_metrics(push)
                if got is not None and got.drain is not None:  # the fallback to the drain long-poll
                    self.drained(got.drain.notice_s)
            except errors.BucketRLError as exc:  # metrics are best effort: never stop training for them
                log.warning("metrics push failed: %s", exc)

        self._uploader().submit(f"metrics {step}", job)

    def _new_eval_metrics(self) -> dict[str, float]:
        """:meth:`EvalReports.new_metrics` (uploader thread)."""
        return self.eval_reports.new_metrics(self.write_client)

    def _report_final_eval(self, step: int) -> None:
        """The run's last eval report, at its last step (whose own push left it out). When the run evaluates the
        final version, wait up to ``final_eval_wait_s`` for the generators to finish it: the policy a user keeps
        is the one whose score they want, and it is published only now. Then report the newest version not
        reported yet (older unreported ones, if any, stay in the bucket, the status and the dashboard's table).
        The last step's checkpoint is stored after this report, so a trainer resumed to train past max_steps
        does not report it again."""
        spec = self.spec
        if spec is None or spec.eval is None:
            return
        self._uploader().drain()  # the final version is committed; every earlier push has reported
        final = self.policy_version
        wait_s = self.settings.final_eval_wait_s if spec.eval.evaluates(final) else 0.0
        metrics = self.eval_reports.final_metrics(self.client, final, wait_s, self.stop_requested)
        if metrics:
            self._push(step, metrics, report_eval=False)

    def _finish(self) -> int:
        step = self.learner.step
        stopped = self.stop_requested.is_set()
        if self.policy_step != step and not stopped:
            self._publish()
        if not stopped and step >= self.settings.max_steps:
            self._report_final_eval(step)
        if step > 0 and self.last_checkpoint_step != step:
            self._checkpoint()
        self._uploader().drain()
        if stopped:
            took = "" if self.stop_at is None else f" {time.monotonic() - self.stop_at:.1f}s after the stop request"
            took += "" if self.notice_s is None else f", a drain's notice of {self.notice_s:.1f}s"
            self.echo(
                f"bucketrl trainer: stopped at step {step} (checkpointed{took}); steps lost: 0, a successor resumes "
                f"at step {step}; resume by starting it again"
            )
            return EXIT_OK
        run = self.settings.run
        finish_generation(self.client)
        self.echo(
            f"bucketrl trainer: done, {step} steps. Final adapter: v{self.policy_version} at "
            f"runs/{run}/adapters/v{self.policy_version}/files/ in the proxy's bucket (PeftModel.from_pretrained "
            f"loads that directory); also GET {self.settings.proxy_url}/v1/runs/{run}/adapters/{self.policy_version}"
        )
        return EXIT_OK

    # -- helpers ------------------------------------------------------------------------------------------------

    def _remember(self, version: int, snap: Any) -> None:
        """Record the current weights as ``version`` (on every rank: the stale-sample mismatch check)."""
        self.learner.remember_version(version, snap)
        if self.speaker is not None:
            self.speaker.remember(version)

    def _retrying(self, call: Callable[[], T]) -> T:
        """:func:`~bucketrl.trainer.retry.retrying` within ``outage_budget_s``."""
        return retrying(call, budget_s=self.settings.outage_budget_s, outage=self.outage)

    def _audit(self, record: dict[str, Any]) -> None:
        if not self.settings.audit_log:
            return
        line = json.dumps({**record, "t": time.time()}) + "\n"
        with self._audit_lock, Path(self.settings.audit_log).open("a") as fh:
            fh.write(line)
