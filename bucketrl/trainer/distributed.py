"""One trainer made of N ranks (``torchrun --nproc-per-node N [--nnodes M ...] -m bucketrl.cli trainer``).

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

import ctypes
import datetime
import logging
import os
import signal
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import torch
import torch.distributed as dist

from bucketrl.trainer.settings import TrainerSettings
from bucketrl.trainer.worker import RankFailure

if TYPE_CHECKING:
    from bucketrl.trainer.learner import Learner, StepGroup
    from bucketrl.wire.runs import RunSpec

log = logging.getLogger("bucketrl.trainer")

SPEAKER = 0


@dataclass
class Ranks:
    """This process's place in the job and the process groups it talks over."""

    rank: int
    world: int
    local_rank: int
    # Gradient all-reduce: NCCL on CUDA, gloo on CPU (the default group).
    grads: Any
    # Control messages (pickled objects): always gloo, so they never need a device.
    control: Any
    timeout_s: float

    @property
    def speaks(self) -> bool:
        return self.rank == SPEAKER

    # -- collectives, each raising RankFailure instead of a backend-specific error ---------------------------

    def broadcast(self, message: Message | None) -> Message:
        """Rank 0 sends ``message``; every other rank returns the message it received."""
        box = [message if self.speaks else None]
        with _collective("broadcast"):
            dist.broadcast_object_list(box, src=SPEAKER, group=self.control)
        result = box[0]
        assert isinstance(result, Message)
        return result

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        with _collective("all_gather"):
            dist.all_gather_object(out, obj, group=self.control)
        return out

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        """Exact for integers up to 2**53 (float64): token and sequence totals."""
        t = torch.tensor(list(values), dtype=torch.float64)
        with _collective("all_reduce"):
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.control)
        return [float(v) for v in t]

    def all_reduce_max(self, value: int) -> int:
        """The largest ``value`` of any rank (the step's most micro-batches, for sharded lockstep)."""
        t = torch.tensor([value], dtype=torch.int64)
        with _collective("all_reduce"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return int(t[0])

    def all_reduce_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over the ranks, in place (a missing gradient counts as zero)."""
        all_reduce_grads(params, self.grads)

    def close(self, *, clean: bool) -> None:
        """Leave the job. After a clean finish every rank meets at a barrier first, so none leaves while a
        peer is still in a collective. The process group is not destroyed: the rank process ends with
        ``os._exit`` right after (see ``exit_rank``), and tearing gloo down while a peer's connection closes
        aborted a finished rank ("terminate called without an active exception", exit -6) now and then."""
        if clean and dist.is_initialized():
            try:
                with _collective("final barrier"):
                    dist.barrier(group=self.control)
            except RankFailure as exc:
                log.warning("rank %d: %s", self.rank, exc)


@contextmanager
def _collective(what: str) -> Iterator[None]:
    try:
        yield
    except (RuntimeError, ValueError, ConnectionError) as exc:  # gloo/NCCL raise RuntimeError subclasses
        raise RankFailure(f"{what} across trainer ranks failed (a rank died or timed out): {exc}") from exc


def all_reduce_grads(params: Sequence[torch.nn.Parameter], group: Any) -> None:
    """One flat SUM all-reduce of the parameters' gradients (zeros for parameters without one)."""
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    with _collective("gradient all_reduce"):
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


def in_torchrun() -> bool:
    """True when started as one of several ranks (torchrun sets ``WORLD_SIZE``)."""
    return int(os.environ.get("WORLD_SIZE", "1") or "1") > 1


def rank_device(settings: TrainerSettings, local_rank: int) -> str:
    """The device of a rank: ``cuda:LOCAL_RANK`` when the setting asks for CUDA (or auto and CUDA is there)."""
    want = settings.device
    if want == "cpu" or want.startswith("cuda:"):
        return want if want == "cpu" else f"cuda:{local_rank}"
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        return f"cuda:{local_rank}"
    return "cpu" if want == "auto" else want


def init_ranks(settings: TrainerSettings) -> tuple[Ranks, TrainerSettings]:
    """Join the job torchrun started (``env://`` rendezvous): process groups with timeouts, this rank's device.

    Returns the ranks and the settings with ``device`` resolved to this rank's.
    """
    _die_with_launcher()
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = rank_device(settings, local_rank)
    timeout = datetime.timedelta(seconds=settings.dist_timeout_s)
    backend = "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        backend = "nccl"
    dist.init_process_group(backend=backend, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    ranks = Ranks(
        rank=rank,
        world=world,
        local_rank=local_rank,
        grads=dist.group.WORLD,
        control=control,
        timeout_s=settings.dist_timeout_s,
    )
    log.info("rank %d of %d (local %d) on %s, %s backend", rank, world, local_rank, device, backend)
    return ranks, settings.model_copy(update={"device": device})


def _die_with_launcher() -> None:
    """Linux: SIGKILL this rank when its parent (torchrun's agent) dies, however it dies."""

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    parent = os.getppid()
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the launcher died before the prctl: nobody would deliver the signal
        os._exit(1)


# -- splitting a step's groups ----------------------------------------------------------------------------------


def group_tokens(item: StepGroup) -> int:
    """What a group costs to train: prompt + completion tokens of every completion."""
    g = item.group
    return sum(len(g.prompt_of(c)) + len(c.token_ids) for c in g.completions)


def shard_groups(groups: Sequence[StepGroup], world: int) -> list[list[int]]:
    """Indices of the groups each rank trains, balanced by token count.

    Longest-processing-time greedy: groups from the most tokens down, each to the rank with the fewest tokens so
    far (ties: the lower rank). Deterministic, so every rank computes the same split; each rank's indices are
    kept in claim order.
    """
    loads = [0] * world
    shares: list[list[int]] = [[] for _ in range(world)]
    cost = [group_tokens(g) for g in groups]
    for i in sorted(range(len(groups)), key=lambda i: (-cost[i], i)):
        r = min(range(world), key=lambda r: (loads[r], r))
        loads[r] += cost[i]
        shares[r].append(i)
    return [sorted(s) for s in shares]


# -- rank 0 -> the others -------------------------------------------------------------------------------------------


@dataclass
class Message:
    """What rank 0 tells the other ranks (pickled over the control group; never leaves the job)."""

    kind: Literal["spec", "state", "step", "remember", "wait", "stop"]
    spec: RunSpec | None = None
    # "state": rank 0's learner after its resume: these replace the other ranks' weights, optimizer, RNG, step.
    step: int = 0
    adapter: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer: dict[str, Any] = field(default_factory=dict)
    rng: dict[str, Any] = field(default_factory=dict)
    versions: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    # "step": the groups to train and the policy version they train with.
    groups: list[StepGroup] = field(default_factory=list)
    policy_version: int = 0
    # "remember": the current weights were published as this version (the stale-sample mismatch check).
    version: int = 0
    # "stop": rank 0's exit code.
    code: int = 0


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
            from bucketrl.trainer.worker import TrainerWorker

            worker = TrainerWorker(settings, echo=echo, ranks=ranks)
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
