"""FSDP2 sharding of the frozen base model across the trainer's ranks (``BUCKETRL_SHARD_BASE=true`` under torchrun).

    policy = PolicyModel(spec, device=..., shard=BaseSharder(ranks))   # each rank keeps 1/N of the base

For a base that does not fit one device: each transformer block (the classes the model names in
``_no_split_modules``) becomes one ``fully_shard`` unit, then the rest of the base (embeddings, final norm, output
head) one more, on a mesh over the ranks' gradient group. A rank holds 1/N of every base weight at rest; a unit's
full weights exist on a rank only while that unit runs (all-gathered before its forward and again before its
backward, freed after).

**The LoRA adapter is not sharded** (``ignored_params``): it stays a plain, replicated tensor on every rank, its
gradient is summed by the same one flat all-reduce as without sharding (:func:`~bucketrl.trainer.distributed.
all_reduce_grads`), and every rank steps the same AdamW on it. So the update is the one of the unsharded ranks,
which is the one of a single process up to float summation order (all-gathered base weights are the very bits of
the unsharded ones), and publishing and checkpointing read rank 0's replica with the single-process writer: no
gather, same bytes. Letting FSDP own the adapter too would save no memory worth having (it is ~0.1-1% of the
base), average instead of sum (a divide factor to undo), and make the published adapter and the optimizer state a
gather of DTensor shards.

**Lockstep.** Every unit's all-gather is a collective, so every rank must run the same sequence of forwards and
backwards. Ranks train token-balanced shares with different numbers of micro-batches (and a rank may get none),
so :class:`~bucketrl.trainer.learner.Learner` agrees on the step's largest count (one all-reduce) and a rank that
has fewer runs :func:`filler_batch` passes: a one-token sequence through the same calls (forward, the KL
reference pass, backward of ``0 * logprob``) whose gradient is exactly zero, so nothing changes but the
collectives line up. The no-grad forwards of the stale-sample mismatch check are padded the same way.

CPU (gloo) and CUDA (NCCL) both work; on CPU it saves no memory worth having and exists to be tested
(``tests/trainer/test_distributed.py``). Not supported together with ``lora.dropout > 0`` any more than the
unsharded ranks are (dropout masks are drawn per rank).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from bucketrl.trainer.batching import MicroBatch, TrainingSample, collate

if TYPE_CHECKING:
    from bucketrl.trainer.ranks import Ranks

log = logging.getLogger("bucketrl.trainer")


def block_classes(model: torch.nn.Module) -> set[str]:
    """Class names of the model's transformer blocks (transformers lists them in ``_no_split_modules``)."""
    return set(getattr(model, "_no_split_modules", None) or [])


class BaseSharder:
    """Shards a base model over ``ranks`` with FSDP2, leaving the given (LoRA) parameters alone."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self.units = 0
        # Bytes of base weights this rank keeps at rest, and of the whole base.
        self.held_bytes = 0
        self.base_bytes = 0

    def __call__(self, base: torch.nn.Module, keep: set[torch.nn.Parameter], device: torch.device) -> None:
        """Shard ``base`` in place onto ``device``: its managed weights move there as shards (one block at a
        time, so the full base never has to fit the device); ``keep`` stays as it is, unsharded."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(self.ranks.grads, device_type=device.type)
        names = block_classes(base)
        blocks = [m for m in base.modules() if type(m).__name__ in names]
        if not blocks:
            # Still sharded at rest, but the whole base is gathered for each forward: no help with peak memory.
            log.warning("%s names no transformer blocks: the base is sharded as one unit", type(base).__name__)
        for block in blocks:
            fully_shard(block, mesh=mesh, ignored_params=keep)
        fully_shard(base, mesh=mesh, ignored_params=keep)
        self.units = len(blocks) + 1
        self.held_bytes, self.base_bytes = held_bytes(base, keep)
        log.info(
            "base model sharded over %d ranks with FSDP2: %d units (%s), this rank holds %.1f of its %.1f MiB; "
            "LoRA replicated",
            self.ranks.world,
            self.units,
            ", ".join(sorted(names)) or "no blocks",
            self.held_bytes / 2**20,
            self.base_bytes / 2**20,
        )


def held_bytes(base: torch.nn.Module, keep: set[torch.nn.Parameter]) -> tuple[int, int]:
    """(bytes of base weights stored on this rank, bytes of the whole base), ``keep`` left out."""
    from torch.distributed.tensor import DTensor

    held = total = 0
    for p in base.parameters():
        if p in keep:
            continue
        local = p.to_local() if isinstance(p, DTensor) else p
        held += local.numel() * local.element_size()
        total += p.numel() * p.element_size()
    return held, total


def filler_batch(pad_id: int) -> MicroBatch:
    """One sequence of two pad tokens, nothing counted (mask 0): what a rank with no more micro-batches runs so that
    its collectives match the other ranks'."""
    return collate(
        [
            TrainingSample(
                prompt_ids=[pad_id],
                completion_ids=[pad_id],
                behaviour_logprobs=[0.0],
                advantage=0.0,
                version=-1,
                worker_id="",
                n_valid=0,
            )
        ],
        pad_id,
    )
