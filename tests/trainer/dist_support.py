"""Ranks of a data-parallel trainer on CPU/gloo, started with ``torch.multiprocessing`` (what torchrun does for
``bucketrl trainer``, minus the launcher): each rank joins through the same ``env://`` variables torchrun sets
and runs the same scenario; rank 0 saves what the test compares with one process.
"""

from __future__ import annotations

import datetime
import os
import random
import traceback
from pathlib import Path
from typing import Any

import torch

from bucketrl.trainer.learner import Learner, StepGroup
from bucketrl.trainer.settings import TrainerSettings
from bucketrl.wire.runs import LossSpec, RunSpec
from tests.trainer.helpers import random_group, settings, tiny_spec

STEPS = 3
GROUPS_PER_STEP = 5


def cfg(**overrides: Any) -> TrainerSettings:
    """The tests' trainer settings: lr 1e-3 and AdamW eps 1e-6. AdamW moves a weight by up to lr / (4 eps) per
    unit change of a near-zero gradient coordinate, so float-order differences of ~1e-9 in the summed gradient
    (well within the 1e-6 the gradients are compared to) would shift the defaults' update (lr 1e-2, eps 1e-8)
    by far more than 1e-6: a property of AdamW's conditioning, not of the ranks."""
    return settings(**{"lr": 1e-3, "adam_eps": 1e-6, **overrides})


def specs(model_dir: Path) -> dict[str, RunSpec]:
    """The loss aggregations (their normalisers are the step's totals over all ranks), with and without KL; Dr.GRPO
    (constant: the step's sequence count over all ranks times the budget) with truncated IS."""
    dr_grpo = LossSpec(objective="decoupled", aggregation="constant", scale_rewards="none")
    return {
        "token": tiny_spec(model_dir),
        "sequence_kl": tiny_spec(model_dir, loss=LossSpec(aggregation="sequence", kl_coef=0.05)),
        "dr_grpo": tiny_spec(model_dir, loss=dr_grpo),
    }


def batches(seed: int = 0) -> list[list[StepGroup]]:
    """Groups of uneven sizes (prompts 2-6 tokens, completions 1-8): the token balance splits them unevenly."""
    rng = random.Random(seed)
    return [
        [StepGroup(random_group(rng, index=GROUPS_PER_STEP * i + j), 1, f"g{j % 2}") for j in range(GROUPS_PER_STEP)]
        for i in range(STEPS)
    ]


def stale_batches(seed: int = 1) -> list[list[StepGroup]]:
    """Groups of versions 0 (stale: the mismatch check runs a no-grad forward under version 0's weights for them)
    and 1 (current), one generator each: the ranks get different numbers of stale micro-batches to check."""
    rng = random.Random(seed)
    return [
        [
            StepGroup(random_group(rng, index=GROUPS_PER_STEP * i + j), j % 2, f"g{j % 2}")
            for j in range(GROUPS_PER_STEP)
        ]
        for i in range(STEPS)
    ]


def stale_trajectory(learner: Learner) -> dict[str, Any]:
    """``trajectory`` over ``stale_batches`` with version 0 = the initial adapter (every stale sample checked)."""
    learner.remember_version(0, learner.policy.adapter_snapshot())
    return trajectory(learner, stale_batches())


def lone_run(learner: Learner, speaks: bool = True) -> dict[str, bytes]:
    """One group, all on rank 0: the published adapter's bytes and (rank 0) the checkpoint's."""
    import numpy as np

    from bucketrl.trainer.checkpoint import TrainerState, pack_checkpoint

    # The checkpoint holds the python / numpy RNG states: seeded as the worker seeds them (not by the learner).
    random.seed(0)
    np.random.seed(0)
    learner.train_step(batches()[0][:1], policy_version=1)
    state = TrainerState(step=0, policy_version=1, created_at=1.0)
    return {"adapter": learner.policy.adapter_tar(), "checkpoint": pack_checkpoint(learner, state) if speaks else b""}


def grads(learner: Learner) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in learner.policy.model.named_parameters() if p.grad is not None}


def trajectory(learner: Learner, steps: list[list[StepGroup]]) -> dict[str, Any]:
    """Loss of every step, gradients of the first (after the all-reduce and clipping), the final adapter."""
    losses: list[float] = []
    first: dict[str, torch.Tensor] = {}
    updated: dict[str, torch.Tensor] = {}
    stats: dict[str, float] = {}
    for i, groups in enumerate(steps):
        stats = learner.train_step(groups, policy_version=1)
        losses.append(stats["train/loss"])
        if i == 0:
            first = grads(learner)
            updated = learner.policy.adapter_state()
    return {
        "losses": losses,
        "grads": first,
        "updated": updated,
        "adapter": learner.policy.adapter_state(),
        "stats": stats,
    }


def run_rank(rank: int, port: int, model_dir: str, out: str) -> None:
    """Rank ``rank`` of a 3-rank job: the scenario on all 3 ranks, then on a 2-rank group of ranks 0 and 1 (one
    set of processes for both sizes: starting them is what costs)."""
    import torch.distributed as dist

    from bucketrl.trainer.ranks import Ranks, init_ranks

    torch.set_num_threads(1)
    env = {"RANK": rank, "WORLD_SIZE": 3, "LOCAL_RANK": rank, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    os.environ.update({k: str(v) for k, v in env.items()})
    ranks, rank_cfg = init_ranks(cfg(dist_timeout_s=120.0))
    code = 1
    try:
        results = {3: scenario(ranks, rank_cfg, Path(model_dir))}
        pair = dist.new_group([0, 1], backend="gloo")
        if rank < 2:
            two = Ranks(rank=rank, world=2, local_rank=rank, grads=pair, control=pair, timeout_s=120.0)
            results[2] = scenario(two, rank_cfg, Path(model_dir))
        if ranks.speaks:
            torch.save(results, Path(out) / "results.pt")
        dist.barrier()
        # Then ranks 0 and 1 as a job with a short collective timeout (rank 2 is done).
        quick = dist.new_group([0, 1], backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
        if rank < 2:
            timeouts(Ranks(rank=rank, world=2, local_rank=rank, grads=quick, control=quick, timeout_s=TIMEOUT_S), out)
        code = 0
    except BaseException:
        traceback.print_exc()  # os._exit below would swallow it
    finally:
        os._exit(code)  # no destroy_process_group: after timeouts() a peer may be gone or stuck


def scenario(ranks: Any, rank_cfg: TrainerSettings, model_dir: Path) -> dict[str, Any]:
    from bucketrl.trainer.checkpoint import TrainerState, pack_checkpoint, restore_checkpoint
    from bucketrl.trainer.distributed import adopt_state, state_message

    result: dict[str, Any] = {}
    steps = batches()
    sharded = rank_cfg.model_copy(update={"shard_base": True, "mismatch_max_samples": 1000})
    for name, spec in specs(model_dir).items():
        result[name] = trajectory(Learner(spec, rank_cfg, ranks=ranks), steps)
        # FSDP2: the frozen base sharded across the ranks, the same update.
        fsdp = Learner(spec, sharded, ranks=ranks)
        assert fsdp.lockstep and fsdp.policy.sharded and fsdp.sharder is not None
        result[f"{name}_fsdp"] = trajectory(fsdp, steps)
        result[f"{name}_fsdp"]["held"] = ranks.all_gather((fsdp.sharder.held_bytes, fsdp.sharder.base_bytes))
    # ... with gradient checkpointing too (its recomputed forwards all-gather again, in the same order on every rank).
    checkpointed = sharded.model_copy(update={"gradient_checkpointing": True})
    result["stale_fsdp"] = stale_trajectory(Learner(specs(model_dir)["token"], checkpointed, ranks=ranks))
    result["lone_fsdp"] = lone_run(Learner(specs(model_dir)["token"], sharded, ranks=ranks), ranks.speaks)

    # One group: every sample on rank 0, nothing on the others (their gradients count as zeros).
    spec = specs(model_dir)["token"]
    lone = Learner(spec, rank_cfg, ranks=ranks)
    lone.train_step(steps[0][:1], policy_version=1)
    result["lone_adapter_tar"] = lone.policy.adapter_tar()

    # Checkpoint after 2 steps (rank 0 writes it, as the worker does), then the uninterrupted 3rd step.
    learner = Learner(spec, rank_cfg, ranks=ranks)
    for groups in steps[:2]:
        learner.train_step(groups, policy_version=1)
    tar = pack_checkpoint(learner, TrainerState(step=0, policy_version=3)) if ranks.speaks else b""
    learner.train_step(steps[2], policy_version=1)
    result["checkpoint"] = tar
    result["uninterrupted"] = learner.policy.adapter_state()

    # A restarted job: fresh learners (another LoRA init), rank 0 restores the checkpoint and sends its state
    # to the others (what TrainerWorker does after its resume), then the 3rd step again.
    restarted = Learner(spec, cfg(dist_timeout_s=120.0, seed=7), ranks=ranks)
    if ranks.speaks:
        restore_checkpoint(restarted, tar)
        ranks.broadcast(state_message(restarted))
    else:
        adopt_state(restarted, ranks.broadcast(None))
    restarted.train_step(steps[2], policy_version=1)
    result["restarted"] = restarted.policy.adapter_state()
    # Every rank holds the same replica (rank 0's is what gets published).
    result["replicas"] = ranks.all_gather(restarted.policy.adapter_state())
    return result


TIMEOUT_S = 4.0


def timeouts(ranks: Any, out: str) -> None:
    """Two ranks, a 4 s collective timeout: rank 0's heartbeats keep rank 1 waiting through an 8 s rollout wait; then
    rank 1 hangs (sleeps) and rank 0's next collective fails within the timeout instead of hanging."""
    import json
    import threading
    import time
    from concurrent.futures import Future

    from bucketrl.trainer.distributed import SpeakerHooks
    from bucketrl.trainer.ranks import Message
    from bucketrl.trainer.worker import RankFailure

    result: dict[str, Any] = {}
    if ranks.speaks:
        pending: Future[str] = Future()
        threading.Timer(2 * TIMEOUT_S, lambda: pending.set_result("rollouts")).start()
        result["waited"] = SpeakerHooks(ranks, heartbeat_s=1.0).wait(pending)
        ranks.broadcast(Message(kind="stop"))
        t0 = time.monotonic()
        try:
            ranks.all_reduce_sum([1.0])
            result["hung_rank"] = "no error"
        except RankFailure as exc:
            result["hung_rank"] = str(exc)[:200]
        result["failed_after_s"] = time.monotonic() - t0
        Path(out, "timeouts.json").write_text(json.dumps(result))
    else:
        kinds = []
        while not kinds or kinds[-1] != "stop":
            kinds.append(ranks.broadcast(None).kind)
        Path(out, "follower.json").write_text(json.dumps(kinds))
        time.sleep(2.5 * TIMEOUT_S)  # hung: does not join rank 0's all_reduce before its timeout
