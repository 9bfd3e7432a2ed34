"""One trainer made of N ranks (``torchrun --nproc-per-node N [--nnodes M ...] -m bucketrl.cli trainer``).

This module is the torchrun entry (:func:`main`: rank 0 runs the worker with :class:`SpeakerHooks`, the others a
:class:`Follower`); the rank primitives (joining the job, collectives, the split of a step's groups, the
:class:`~bucketrl.trainer.ranks.Message`) are :mod:`bucketrl.trainer.ranks`.

``bucketrl trainer`` started by ``torchrun`` (``WORLD_SIZE > 1`` in its environment) is data-parallel:

* **Rank 0 speaks for the job.** It alone talks to the proxy (register and its fencing epoch, claim, ack, publish,
  checkpoint): it is the ordinary :class:`~bucketrl.trainer.worker.TrainerWorker`, with hooks that tell the other
  ranks what to do (:class:`SpeakerWorker`). The other ranks (:class:`Follower`) never open a connection to the
  proxy: they receive :class:`Message` objects from rank 0 (the run spec, rank 0's state after its resume, each
  step's claimed groups, which versions were published, stop) over a gloo "control" group.
* **Groups are split across ranks balanced by token count** (:func:`shard_groups`: longest-processing-time
  greedy over prompt + completion tokens, deterministic). Every rank holds the whole step's groups (they are
  small), so the step's reward / staleness statistics are computed identically everywhere.
* **Exact loss normalisation.** The loss of each micro-batch is divided by the step's total unmasked tokens
  (token aggregation) or sequences (sequence aggregation); these totals are all-reduced before the first
  forward, so the sum over ranks of the per-rank gradients IS the single-process gradient (up to float
  summation order: within 1e-6 in fp32, see ``tests/trainer/test_distributed.py``).
* **Gradients are all-reduced (summed) over the LoRA parameters** in one flat buffer after each rank's
  backward passes (:func:`all_reduce_grads`). Not ``DistributedDataParallel``: ranks run different numbers of
  micro-batches (token-balanced, and a rank may get no sample at all when groups < ranks), which DDP's
  per-backward bucket hooks cannot express without hanging; one explicit SUM after accumulation is exactly what
  DDP's ``no_sync`` + final backward would compute, with no averaging to undo. Every rank then clips the same
  global norm and steps the same AdamW on the same gradients, so the LoRA weights and optimizer moments stay
  replicated bit-for-bit (a ring all-reduce leaves identical bits on every rank).
* **Publish and checkpoint on rank 0** from its replica: the same writer as a single process
  (:class:`~bucketrl.trainer.model.AdapterSnapshot`, :func:`~bucketrl.trainer.checkpoint.snapshot`), so the files
  have the same format and load the same way; a checkpoint does not depend on the number of ranks that wrote
  it, and a job of any size resumes from it (rank 0 restores it and sends its state to the others).
* **Faults.** Every collective has a timeout (``BUCKETRL_DIST_TIMEOUT_S``); while rank 0 waits for rollouts it
  sends a heartbeat every ``BUCKETRL_DIST_HEARTBEAT_S`` so that a long wait is not mistaken for a dead rank. A
  rank that dies makes torchrun stop the others at once (and a rank that is merely stuck makes the others' next
  collective fail within the timeout); every rank exits and the restarted job resumes from the last checkpoint
  under a new epoch, as a single process does. Ranks ask the kernel to kill them when their launcher dies
  (``PR_SET_PDEATHSIG``), so no rank outlives a killed ``torchrun``.

* **The frozen base may be sharded** across the ranks with FSDP2 (``BUCKETRL_SHARD_BASE``,
  :mod:`bucketrl.trainer.sharding`): the LoRA adapter stays replicated and reduced as above, and the ranks run the
  same number of forward/backward passes (filler passes of zero gradient), since every pass all-gathers the base.

Backends: NCCL for the gradient all-reduce when the ranks train on CUDA (each on ``cuda:LOCAL_RANK``), gloo on
CPU; the control messages always go over gloo. Exact agreement with one process needs ``lora.dropout == 0``
(the default): dropout masks are drawn per rank.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import suppress
from typing import TYPE_CHECKING, Any, NoReturn

from bucketrl.trainer.exits import RankFailure
from bucketrl.trainer.ranks import Message, Ranks, init_ranks
from bucketrl.trainer.settings import TrainerSettings
from bucketrl.trainer.worker import TrainerWorker

if TYPE_CHECKING:
    from bucketrl.trainer.learner import Learner
    from bucketrl.trainer.step_group import StepGroup
    from bucketrl.wire.runs import RunSpec

log = logging.getLogger("bucketrl.trainer")


def state_message(learner: Learner) -> Message:
    from bucketrl.trainer.checkpoint import rng_state

    return Message(
        kind="state",
        step=learner.step,
        adapter=learner.policy.adapter_snapshot().state,
        optimizer=learner.optimizer.state_dict(),
        rng=rng_state(),
        versions={v: snap.state for v, snap in learner.versions.items()},
    )


def adopt_state(learner: Learner, msg: Message) -> None:
    """Make ``learner`` an exact replica of the one ``msg`` was taken from."""
    from bucketrl.trainer.checkpoint import set_rng_state
    from bucketrl.trainer.model import AdapterSnapshot

    learner.policy.load_adapter_state(msg.adapter)
    learner.optimizer.load_state_dict(msg.optimizer)
    set_rng_state(msg.rng)
    learner.step = msg.step
    config = learner.policy.adapter_snapshot().config_json
    learner.versions = OrderedDict((v, AdapterSnapshot(state=s, config_json=config)) for v, s in msg.versions.items())


class SpeakerHooks:
    """What :class:`~bucketrl.trainer.worker.TrainerWorker` calls on rank 0 to drive the other ranks."""

    def __init__(self, ranks: Ranks, heartbeat_s: float) -> None:
        self.ranks = ranks
        self.heartbeat_s = heartbeat_s
        self.stopped = False

    def spec(self, spec: RunSpec) -> None:
        self.ranks.broadcast(Message(kind="spec", spec=spec))

    def state(self, learner: Learner) -> None:
        self.ranks.broadcast(state_message(learner))

    def step(self, groups: list[StepGroup], policy_version: int) -> None:
        self.ranks.broadcast(Message(kind="step", groups=groups, policy_version=policy_version))

    def remember(self, version: int) -> None:
        self.ranks.broadcast(Message(kind="remember", version=version))

    def wait(self, pending: Future[Any]) -> Any:
        """``pending.result()``, sending a heartbeat every ``heartbeat_s`` while it is not there yet."""
        while True:
            try:
                return pending.result(timeout=self.heartbeat_s)
            except FutureTimeout:
                self.ranks.broadcast(Message(kind="wait"))

    def stop(self, code: int) -> None:
        """Tell the others to exit with ``code`` (best effort: they may be gone already)."""
        if self.stopped:
            return
        self.stopped = True
        try:
            self.ranks.broadcast(Message(kind="stop", code=code))
        except RankFailure as exc:
            log.warning("could not tell the other ranks to stop: %s", exc)


class Follower:
    """Ranks 1..N-1: train what rank 0 sends; never talk to the proxy."""

    def __init__(self, settings: TrainerSettings, ranks: Ranks, echo: Callable[[str], None] = print) -> None:
        self.settings = settings
        self.ranks = ranks
        self.echo = echo
        self.learner: Learner | None = None

    def run(self) -> int:
        from bucketrl.trainer.learner import Learner

        while True:
            msg = self.ranks.broadcast(None)
            if msg.kind == "stop":
                return msg.code
            if msg.kind == "wait":
                continue
            if msg.kind == "spec":
                assert msg.spec is not None
                self.learner = Learner(msg.spec, self.settings, ranks=self.ranks)
                continue
            learner = self.learner
            if learner is None:
                raise RankFailure(f"rank {self.ranks.rank} got {msg.kind!r} before the run spec")
            if msg.kind == "state":
                adopt_state(learner, msg)
            elif msg.kind == "step":
                learner.train_step(msg.groups, policy_version=msg.policy_version)
            elif msg.kind == "remember":
                learner.remember_version(msg.version, learner.policy.adapter_snapshot())


def main(settings: TrainerSettings, *, echo: Callable[[str], None] = print) -> int:
    """Entry point of one rank (``bucketrl trainer`` under torchrun). Returns the exit code."""
    ranks, settings = init_ranks(settings)
    code = 1
    try:
        if ranks.speaks:
            speaker = SpeakerHooks(ranks, settings.dist_heartbeat_s)
            worker = TrainerWorker(settings, echo=echo, ranks=ranks, speaker=speaker)
            worker.install_signal_handlers()
            code = worker.run()
            return code
        # SIGTERM reaches every rank (torchrun forwards it): only rank 0 decides when the job stops; the others
        # finish what it sends, then its "stop".
        signal.signal(signal.SIGTERM, lambda *_: log.info("rank %d: SIGTERM; rank 0 decides the stop", ranks.rank))
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            code = Follower(settings, ranks, echo=echo).run()
            return code
        except RankFailure as exc:
            echo(f"bucketrl trainer rank {ranks.rank}: {exc}")
            return 1
    finally:
        ranks.close(clean=code == 0)


def exit_rank(code: int) -> NoReturn:
    """End a rank process now: flush what it printed and logged, then ``os._exit`` without the interpreter's
    teardown, which would destroy gloo/NCCL objects whose background threads may still see a peer leaving."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
