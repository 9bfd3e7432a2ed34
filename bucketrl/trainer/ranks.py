"""The rank primitives of a trainer made of N ranks (:mod:`bucketrl.trainer.distributed` drives them): joining the
job torchrun started, the collectives (each raising :class:`~bucketrl.trainer.exits.RankFailure` instead of a
backend-specific error), the token-balanced split of a step's groups, and the :class:`Message` rank 0 sends."""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from bucketrl.trainer.exits import RankFailure
from bucketrl.trainer.settings import TrainerSettings
from bucketrl.trainer.step_group import StepGroup

if TYPE_CHECKING:
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
