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
    take the claimed groups (``groups_per_step``; the time blocked on them is ``perf/rollout_wait_s``) and
    start claiming the next step's (with ``min_version`` = the version that step will train with -
    max_staleness, so no trained group is staler than max_staleness) -> :meth:`Learner.train_step` -> every
    ``sync_every`` steps publish version latest+1 -> every ``checkpoint_every`` steps write the checkpoint (it
    lists the deliveries consumed since the previous one) and THEN ack them -> push metrics (TRL names;
    staleness; per-generator logprob mismatch; zero-variance groups).

    Claims run one step ahead on a helper thread, and publishes, checkpoints, acks and metric pushes run in
    order on the :class:`~bucketrl.trainer.uploader.Uploader` thread from snapshots taken at the step, so
    the next step's compute overlaps the proxy round trips (``bench/trainer_overhead.py`` measures it).

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
import os
import random
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from bucketrl import errors, preflight
from bucketrl.client import ProxyClient
from bucketrl.datasets import describe_dataset, parse_jsonl
from bucketrl.trainer.ledger import DeliveryLedger
from bucketrl.trainer.settings import TrainerSettings
from bucketrl.trainer.trackers import open_trackers, parse_report_to, tracker_run_id
from bucketrl.trainer.uploader import Uploader
from bucketrl.wire import DatasetSpec, Delivery, EvalVersionResult, MetricsPush, RunSpec

log = logging.getLogger("bucketrl.trainer")

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_FENCED = 3

BUCKET_DATASET_URI = "bucket:dataset.jsonl"
# Steps over which the share of completions without a reward is compared with max_unscorable_fraction.
UNSCORABLE_WINDOW = 3
# The checkpointed counter of the newest evaluated version the trainer has reported (_new_eval_metrics).
EVAL_REPORTED = "eval/reported_version"

T = TypeVar("T")


class Stopped(Exception):
    """A stop was requested (SIGTERM) while waiting: wind down."""


class ConfigError(Exception):
    """A setting is wrong: the message says which one."""


class RankFailure(RuntimeError):
    """Under torchrun: a collective across the trainer's ranks failed (a rank died or timed out)."""


class TrainerWorker:
    """One trainer process for one run. ``run()`` returns the exit code."""

    def __init__(self, settings: TrainerSettings, *, echo: Callable[[str], None] = print, ranks: Any = None) -> None:
        self.settings = settings
        # Under torchrun this is rank 0, which speaks for all ranks: ``speaker`` tells the others what to train
        # (bucketrl/trainer/distributed.py). None: a single-process trainer.
        self.ranks = ranks
        self.speaker: Any = None
        if ranks is not None:
            from bucketrl.trainer.distributed import SpeakerHooks

            self.speaker = SpeakerHooks(ranks, settings.dist_heartbeat_s)
        self.worker_id = settings.resolved_worker_id("trainer")
        # One client per thread (main, claim prefetch, uploader): each keeps its own connection. They share one
        # outage budget (BUCKETRL_OUTAGE_BUDGET_S) and log an outage once, whichever thread meets it first.
        self.outage = settings.outage(self.worker_id)
        self.client, self.claim_client, self.write_client = (self._new_client() for _ in range(3))
        self.echo = echo
        self.stop_requested = threading.Event()
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
        self.unscorable: list[tuple[int, int]] = []  # (completions, without a reward) of the last steps
        self.reward_errors: dict[str, str] = {}  # the first message of each reward failure kind seen

    def _new_client(self) -> ProxyClient:
        return self.settings.proxy_client(self.outage)

    # -- entry point ------------------------------------------------------------------------------------

    def request_stop(self, *_: object) -> None:
        if not self.stop_requested.is_set():
            log.info("stop requested: finishing the current step, then checkpointing")
        self.stop_requested.set()
        self.outage.stopping()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)

    def run(self) -> int:
        code = EXIT_ERROR
        try:
            code = self._run_reporting()
            return code
        finally:
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
        given = self.settings.run_spec_dict()
        if given is None:
            try:
                info = self.client.get_run()
                self.run_created_at = info.state.created_at
                return info.spec
            except errors.NotFound as exc:
                raise ConfigError(
                    f"run {self.settings.run!r} does not exist on the proxy: set BUCKETRL_RUN_SPEC to create it"
                ) from exc
        dataset = given.get("dataset")
        upload = self._dataset_upload(dataset)
        if isinstance(dataset, dict) and "size" not in dataset:
            given = {**given, "dataset": {**dataset, "size": self._count_dataset(dataset, upload)}}
        spec = RunSpec.model_validate(given)
        try:
            info = self.client.put_run(spec)
            spec, self.run_created_at = info.spec, info.state.created_at
        except errors.Conflict as exc:
            raise ConfigError(
                f"BUCKETRL_RUN_SPEC changes an immutable field of the existing run {self.settings.run!r}: "
                f"{exc.message}. Use a new BUCKETRL_RUN or the original spec."
            ) from exc
        if upload is not None:
            try:
                info = self.client.upload_dataset(upload)
            except errors.Invalid as exc:
                raise ConfigError(f"BUCKETRL_DATASET_FILE {self.settings.dataset_file}: {exc.message}") from exc
            except errors.Conflict as exc:
                raise ConfigError(
                    f"BUCKETRL_DATASET_FILE differs from the dataset run {self.settings.run!r} already has: "
                    f"{exc.message}. Use a new BUCKETRL_RUN."
                ) from exc
            log.info("uploaded dataset (%d rows, sha256 %s)", info.rows, info.sha256[:12])
        return spec

    def _dataset_upload(self, dataset: Any) -> bytes | None:
        """The bytes of BUCKETRL_DATASET_FILE, if set (the spec must point at the uploaded file)."""
        path = self.settings.dataset_file
        if not path:
            return None
        uri = dataset.get("uri") if isinstance(dataset, dict) else None
        if uri != BUCKET_DATASET_URI:
            raise ConfigError(
                f"BUCKETRL_DATASET_FILE is set, so the run spec's dataset.uri must be {BUCKET_DATASET_URI!r}, "
                f"not {uri!r}"
            )
        try:
            return Path(path).expanduser().read_bytes()
        except OSError as exc:
            raise ConfigError(f"BUCKETRL_DATASET_FILE: cannot read {path!r}: {exc}") from exc

    def _count_dataset(self, dataset: dict[str, Any], upload: bytes | None) -> int:

        fields = {k: dataset[k] for k in ("prompt_field", "answer_field", "split") if k in dataset}
        try:
            if upload is not None:
                probe = DatasetSpec(uri=BUCKET_DATASET_URI, size=1, **fields)
                size = len(parse_jsonl(upload, probe, self.settings.dataset_file))
            else:
                size = describe_dataset(dataset.get("uri", ""), client=self.client, **fields).size
        except errors.Invalid as exc:
            raise ConfigError(f"dataset {dataset.get('uri')!r}: {exc.message}") from exc
        if size < 1:
            raise ConfigError(f"dataset {dataset.get('uri')!r} is empty")
        log.info("dataset %s has %d examples", dataset.get("uri"), size)
        return size

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
        """BUCKETRL_REPORT_TO's trackers, continuing the same tracker run after a resume."""

        assert self.spec is not None
        s = self.settings
        self.trackers = open_trackers(
            parse_report_to(s.report_to),
            run=s.run,
            run_id=tracker_run_id(s.run, self.run_created_at),
            config={"run": s.run, "run_spec": self.spec.model_dump(mode="json"), "trainer": self._tracker_settings()},
            directory=s.tracker_dir,
            project=s.tracker_project,
            resume_step=self.learner.step,
        )

    def _tracker_settings(self) -> dict[str, Any]:
        """The trainer's own hyper-parameters for the tracker config (no token, no URLs)."""
        keep = ("lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "max_grad_norm", "warmup_steps")
        keep += ("lr_schedule", "min_lr_ratio", "max_steps", "sync_every", "checkpoint_every", "seed", "dtype")
        return {k: getattr(self.settings, k) for k in keep}

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
        from bucketrl.trainer.learner import StepGroup

        self._uploader().check()  # a failed background write (e.g. fenced) ends the run before more work
        deliveries, held_back = self._within_staleness(deliveries)
        groups = [StepGroup(g, d.version, d.worker_id, d.sampling) for d in deliveries for g in d.groups]
        self._check_rewards(deliveries)
        if self.speaker is not None:
            self.speaker.step(groups, self.policy_version)
        stats = self.learner.train_step(groups, policy_version=self.policy_version)
        stats["reward/unscorable_frac"] = self.unscorable[-1][1] / max(1, self.unscorable[-1][0])
        # Repeats of deliveries this lineage already trained (their claims came after the ones that trained
        # them, so they are trained by now): not trained again, acked with the next checkpoint.
        # (A repeat of one trained in this interval is listed once: a checkpoint acks each delivery once.)
        self.consumed = list(dict.fromkeys(self.consumed + [d.delivery_id for d in deliveries] + list(repeats or [])))
        step = self.learner.step
        self._audit(
            {
                "event": "step",
                "epoch": self.epoch,
                "step": step,
                "deliveries": [d.delivery_id for d in deliveries],
                "repeats": list(repeats or []),
                "fwd_bwd_s": stats["perf/fwd_bwd_s"],
            }
        )
        if repeats:
            stats["sample/repeats_held"] = float(len(repeats))
            log.info(
                "held %d redelivered group(s) this lineage already trained; acked with the next checkpoint",
                len(repeats),
            )
        self.counters["sample/dropped_stale_total"] += dropped
        stats["perf/rollout_wait_s"] = wait_s
        if step % self.settings.sync_every == 0:
            self._publish()
        # Snapshotted now (its cost is part of the step), stored after this step's metrics push: that push may
        # report an eval result, and the checkpoint must hold what was reported up to its step (_new_eval_metrics).
        # The last step's checkpoint is _finish's, after the run's final eval report.
        final = step >= self.settings.max_steps
        due = step % self.settings.checkpoint_every == 0 and not final
        store_checkpoint = self._checkpoint(submit=False) if due else None
        if math.isfinite(self.last_sync_s):
            stats["perf/weight_sync_s"] = self.last_sync_s
        stats["sample/dropped_stale"] = float(dropped)
        if held_back:
            stats["sample/stale_held_back"] = float(held_back)
        stats["sample/dropped_stale_total"] = self.counters["sample/dropped_stale_total"]
        stats["policy/version"] = float(self.policy_version)
        stats["perf/step_s"] = time.perf_counter() - t0
        # The last step's eval report is made by _finish, which can wait for the final version's evaluation.
        self._push(step, stats, report_eval=not final)
        if store_checkpoint is not None:
            store_checkpoint()
        # Multi-turn steps also say how many tokens were trained of those in context, and the turns per episode.
        turns = stats.get("episodes/turns_mean")
        extra = ""
        if turns is not None:
            trained, context = stats.get("train/tokens", 0.0), stats.get("train/tokens_context", 0.0)
            extra = f" tokens trained {trained:.0f} of {context:.0f} in context, turns {turns:.2f}"
            calls = stats.get("episodes/tool_calls_mean")
            if calls is not None:
                extra += f", tool calls {calls:.2f} (errors {stats['episodes/tool_errors']:.0f})"
                frac = stats.get("episodes/env_time_frac")
                if frac is not None:
                    extra += f", env time {frac:.0%}"
        log.info(
            "step %d/%d loss %.4f reward %.3f staleness %.2f wait %.2fs step %.2fs%s",
            step,
            self.settings.max_steps,
            stats.get("train/loss", 0.0),
            stats.get("reward", math.nan),
            stats.get("sample/staleness_mean", math.nan),
            wait_s,
            stats["perf/step_s"],
            extra,
        )

    def _check_rewards(self, deliveries: list[Delivery]) -> None:
        """Count the step's completions without a reward (keeping each failure kind's first message); stop the
        run (exit 2) when over the last few steps more than ``max_unscorable_fraction`` of them had none."""
        total = unscorable = 0
        for d in deliveries:
            for g in d.groups:
                results = g.episode_results()  # a split episode counts once
                total += len(results)
                unscorable += sum(c.reward is None for c in results)
                for kind, message in g.reward_errors.items():
                    self.reward_errors.setdefault(kind, message)
        self.unscorable = [*self.unscorable[-(UNSCORABLE_WINDOW - 1) :], (total, unscorable)]
        seen = sum(t for t, _ in self.unscorable)
        bad = sum(u for _, u in self.unscorable)
        limit = self.settings.max_unscorable_fraction
        if seen and bad / seen > limit:
            kinds = "; ".join(f"{k}: {m}" for k, m in self.reward_errors.items()) or "no message"
            raise preflight.ConfigError(
                f"the reward ({self.spec.reward.name if self.spec else '?'}) could not score {bad}/{seen} completions "
                f"of the last {len(self.unscorable)} step(s), over BUCKETRL_MAX_UNSCORABLE_FRACTION={limit:g}: "
                f"{kinds}"
            )

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

    def _within_staleness(self, deliveries: list[Delivery]) -> tuple[list[Delivery], int]:
        """The deliveries the current policy may train on, and how many groups were held back as too stale.

        A last guard: the claim's ``min_version`` already excludes such groups, so this finds none unless the
        version arithmetic of :meth:`_train_version` is broken. A held-back delivery is neither trained nor
        consumed, so it is never acked: the next claim gives it back (``release``; a claim never redelivers a
        delivery to the epoch holding it) and a later claim, whose ``min_version`` is at least as high, drops it
        and counts it in ``dropped_stale_total``, which comes back to this trainer's ``sample/dropped_stale_total``.
        So each such group is counted once, as a stale drop, by the proxy; its accounting (accepted = acked +
        dropped + queued + pending) stays truthful: ``acked`` only ever means trained. Until then it is pending.
        """
        assert self.spec is not None
        limit = self.policy_version - self.spec.max_staleness
        keep = [d for d in deliveries if d.version >= limit]
        if len(keep) == len(deliveries):
            return deliveries, 0
        held = sum(len(d.groups) for d in deliveries if d.version < limit)
        # Given back with the next claim: the proxy drops and counts them (they are not redelivered to the
        # epoch that holds them otherwise).
        self.ledger.give_back([d.delivery_id for d in deliveries if d.version < limit])
        log.warning(
            "held back %d group(s) older than v%d (policy v%d - max_staleness %d): not trained, left unacked for "
            "the proxy to drop and count on redelivery",
            held,
            limit,
            self.policy_version,
            self.spec.max_staleness,
        )
        return keep, held

    def _claim_groups(self, train_version: int) -> tuple[list[Delivery], int, list[str]]:
        """Claim until ``groups_per_step`` new groups to train with ``train_version``, none older than it minus
        max_staleness (helper thread); the claims tell the proxy this pace. Also returns the ids of repeats
        (deliveries this lineage already took: held, never trained twice). Raises Stopped on a stop request."""
        assert self.spec is not None
        min_version = max(0, train_version - self.spec.max_staleness)
        need = self.spec.groups_per_step
        got: list[Delivery] = []
        repeats: list[str] = []
        dropped = n = 0
        t0 = time.monotonic()
        while n < need:
            if self.stop_requested.is_set():
                raise Stopped  # what was claimed stays unacked: the next trainer gets it at once
            waited = time.monotonic() - t0
            if self.settings.max_rollout_wait_s and waited > self.settings.max_rollout_wait_s:
                raise errors.Unavailable(
                    f"no rollouts for {waited:.0f}s (BUCKETRL_MAX_ROLLOUT_WAIT_S): are generators running?"
                )
            # One request id per claim, the same on its retries: a replay after a lost answer gets the same
            # deliveries (the proxy never redelivers them to this epoch otherwise).
            request_id, release = secrets.token_hex(12), self.ledger.take_release()
            resp = self._retrying(
                lambda k=need - n, rid=request_id, rel=release: self.claim_client.claim(
                    self.worker_id,
                    max_groups=k,
                    wait_s=self.settings.claim_wait_s,
                    min_version=min_version,
                    train_version=train_version if train_version >= 1 else None,
                    sync_every=self.settings.sync_every,
                    request_id=rid,
                    release=rel,
                    hold_rebuilt=True,
                )
            )
            # Groups a rebuild re-queued (after a Redis wipe) below the floor: never trained now. Those this lineage
            # trained before are held and acked with the next checkpoint (counted acked, as they were); the rest are
            # given back, and the proxy drops and counts them stale.
            below = [d.delivery_id for d in resp.deliveries if d.rebuilt_stale]
            held = self.ledger.trained(below)
            if len(held) < len(below):
                self.ledger.give_back(sorted(set(below) - set(held)))
            # (An older proxy ignores hold_rebuilt: it drops them and lists them, and the ack of those this lineage
            # trained moves them to acked.)
            trained_before = self.ledger.trained(resp.dropped_rebuilt)
            dropped += resp.dropped_stale - len(trained_before)
            fresh, again = self.ledger.admit([d for d in resp.deliveries if not d.rebuilt_stale])
            got += fresh
            repeats += again + held + trained_before
            n = sum(len(d.groups) for d in got)
        return got, dropped, repeats

    # -- publish, checkpoint, metrics (snapshots now, writes on the uploader thread) ------------------------

    def _uploader(self) -> Uploader:
        assert self.uploader is not None
        return self.uploader

    def _publish(self) -> None:
        t0 = time.perf_counter()
        snap = self.learner.policy.adapter_snapshot()
        version = self.latest_version + 1
        step = self.learner.step
        self._remember(version, snap)

        def job() -> None:
            tar = snap.tar(self.scratch)
            self._retrying(lambda: self.write_client.publish_adapter(version, tar))
            self.last_sync_s = time.perf_counter() - t0
            log.info("published v%d (step %d, %d bytes) in %.3fs", version, step, len(tar), self.last_sync_s)

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
        notes = {f"reward_error/{kind}": text for kind, text in self.reward_errors.items()}
        trackers = self.trackers
        with_eval = report_eval and self.spec is not None and self.spec.eval is not None

        def job() -> None:
            if with_eval:
                metrics.update(self._new_eval_metrics())
            push = MetricsPush(worker_id=self.worker_id, step=step, metrics=metrics, phase="training", notes=notes)
            if trackers is not None:
                trackers.log(metrics, step)  # guarded: a failing tracker is dropped with one warning
            try:
                self.write_client.push_metrics(push)
            except errors.BucketRLError as exc:  # metrics are best effort: never stop training for them
                log.warning("metrics push failed: %s", exc)

        self._uploader().submit(f"metrics {step}", job)

    def _new_eval_metrics(self) -> dict[str, float]:
        """The oldest evaluated version not reported yet, once (uploader thread): pushed with this step's metrics,
        so it reaches the proxy's history and every tracker at the step it became known (``eval/version`` says
        which policy it measures). One per step, oldest first: when several versions finished since the last
        push (eval faster than training), each is reported at a step of its own; versions are published at most
        once per step, so the reports keep up. The newest version reported is a checkpointed counter (stored by
        the checkpoint job, after the pushes before it): a resumed trainer reports none of them again. A version
        whose evaluation finishes after a newer one was reported is not reported (it is in the bucket, the status
        and the dashboard's table)."""
        results = self._eval_results(self.write_client)
        return {} if results is None else self._eval_report(results, newest=False)

    def _eval_results(self, client: ProxyClient) -> list[EvalVersionResult] | None:
        try:
            return client.eval_results()
        except errors.BucketRLError as exc:
            log.warning("eval results not read: %s", exc.message)
            return None

    def _eval_report(self, results: list[EvalVersionResult], *, newest: bool) -> dict[str, float]:
        """The eval metrics of the oldest (or newest) version not reported yet, marked reported; {} if none."""
        done = self.counters.get(EVAL_REPORTED, 0.0)
        new = [e for e in results if e.version > done]
        if not new:
            return {}
        e = (max if newest else min)(new, key=lambda r: r.version)
        self.counters[EVAL_REPORTED] = float(e.version)
        out = {
            "eval/version": float(e.version),
            "eval/pass@1": e.pass_at_1,
            f"eval/pass@{e.k}": e.pass_at_k,
            "eval/mean_length": e.mean_length,
            "eval/unscorable_frac": e.unscorable_frac,
        }
        if e.reward_mean is not None:
            out["eval/reward"] = e.reward_mean
        return out

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
        if wait_s > 0:
            log.info("waiting up to %.0f s for the evaluation of the final version v%d", wait_s, final)
        deadline = time.monotonic() + wait_s
        while True:
            results = self._eval_results(self.client)
            if results is None:
                return
            if any(e.version == final for e in results) or time.monotonic() >= deadline:
                break
            if self.stop_requested.wait(1.0):
                break
        if wait_s > 0 and not any(e.version == final for e in results):
            log.warning("v%d was not evaluated within %.0f s (BUCKETRL_FINAL_EVAL_WAIT_S)", final, wait_s)
        metrics = self._eval_report(results, newest=True)
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

    def _remember(self, version: int, snap: Any) -> None:
        """Record the current weights as ``version`` (on every rank: the stale-sample mismatch check)."""
        self.learner.remember_version(version, snap)
        if self.speaker is not None:
            self.speaker.remember(version)

    def _retrying(self, call: Callable[[], T]) -> T:
        """Retry a call through proxy outages (503 / unreachable) and other retryable answers (409
        ``write_in_progress``: a slow write of the same bundle still holds its lock) for up to ``outage_budget_s``.

        The client already retries each request through an outage for that long (with backoff honouring
        Retry-After); this covers a retryable error raised by the call itself. Every call retried here is
        idempotent on the proxy: a replayed claim (same request id) answers the same deliveries, a re-sent
        publish or checkpoint of the same bytes answers 200, acks are idempotent.
        """
        deadline = time.monotonic() + self.settings.outage_budget_s
        while True:
            try:
                return call()
            except errors.BucketRLError as exc:
                if not exc.retryable or isinstance(exc, errors.Fenced) or time.monotonic() > deadline:
                    raise
                if isinstance(exc, errors.Unavailable) and self.outage.spent():
                    raise  # the client rode this outage out for the whole budget already: do not double it
                log.warning("proxy unavailable (%s); retrying", exc.message)
                time.sleep(1.0)

    def _audit(self, record: dict[str, Any]) -> None:
        if not self.settings.audit_log:
            return
        line = json.dumps({**record, "t": time.time()}) + "\n"
        with self._audit_lock, Path(self.settings.audit_log).open("a") as fh:
            fh.write(line)


def main(settings: TrainerSettings) -> int:

    world = int(os.environ.get("WORLD_SIZE", "1") or "1")  # torchrun sets it
    where = f" [rank {os.environ.get('RANK', '?')}/{world}]" if world > 1 else ""
    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s{where}: %(message)s",
        stream=sys.stderr,
    )
    if world > 1:
        from bucketrl.trainer.distributed import exit_rank
        from bucketrl.trainer.distributed import main as rank_main

        exit_rank(rank_main(settings))
    worker = TrainerWorker(settings)
    worker.install_signal_handlers()
    return worker.run()
