"""Data-parallel training on CPU/gloo: N ranks give the update of one process on the same claimed groups.

Each world size runs as real processes joined over gloo (``tests/trainer/dist_support.py``); the single-process
reference runs here. fp32 throughout, so agreement is to float summation order (1e-6).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from bucketrl.trainer.checkpoint import restore_checkpoint
from bucketrl.trainer.learner import Learner, StepGroup
from bucketrl.trainer.ranks import group_tokens, shard_groups
from bucketrl.up.ports import free_port
from tests.trainer import dist_support
from tests.trainer.helpers import random_group

TOL = 1e-6

# torch.distributed ranks as processes (their set-up is most of a minute): make test, not make test-fast.
pytestmark = pytest.mark.slow


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, tol: float = TOL) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        diff = float((got[k] - want[k]).abs().max())
        assert diff <= tol, f"{what}: {k} differs by {diff}"


@pytest.fixture(scope="module")
def single(tiny_model_dir: Path) -> dict[str, dict]:
    steps = dist_support.batches()
    specs = dist_support.specs(tiny_model_dir)
    results = {name: dist_support.trajectory(Learner(spec, dist_support.cfg()), steps) for name, spec in specs.items()}
    results["stale"] = dist_support.stale_trajectory(
        Learner(specs["token"], dist_support.cfg(mismatch_max_samples=1000))
    )
    results["lone"] = dist_support.lone_run(Learner(specs["token"], dist_support.cfg()))
    return results


@pytest.fixture(scope="module")
def ranked(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """The scenario on 3 ranks and on 2, then the timeout checks on 2, as real processes joined over gloo."""
    out = tmp_path_factory.mktemp("ranks")
    port = free_port()
    mp.start_processes(
        dist_support.run_rank, args=(port, str(tiny_model_dir), str(out)), nprocs=3, start_method="spawn"
    )
    return {**torch.load(out / "results.pt", weights_only=False), "out": out}


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_train_like_one_process(world: int, tiny_model_dir: Path, ranked: dict, single: dict) -> None:
    got = ranked[world]
    steps = dist_support.batches()

    for name in ("token", "sequence_kl", "dr_grpo"):
        have, want = got[name], single[name]
        assert have["losses"] == pytest.approx(want["losses"], abs=TOL), name
        assert_close(have["grads"], want["grads"], f"{name} gradients of step 1")
        assert_close(have["updated"], want["updated"], f"{name} adapter updated by step 1")
        assert_close(have["adapter"], want["adapter"], f"{name} adapter after {dist_support.STEPS} steps")
        # The step's totals are the whole step's, not rank 0's share.
        for key in ("train/tokens", "train/sequences", "reward", "ratio", "entropy"):
            assert have["stats"][key] == pytest.approx(want["stats"][key], abs=TOL), (name, key)
    assert got["sequence_kl"]["stats"]["kl"] == pytest.approx(single["sequence_kl"]["stats"]["kl"], abs=TOL)
    # The loss really is split: every rank trained a share of the last step.
    shares = shard_groups(steps[-1], world)
    assert all(shares) and sorted(i for s in shares for i in s) == list(range(dist_support.GROUPS_PER_STEP))

    # All samples on rank 0 (one group): the same float operations as one process, so the published adapter is
    # byte-identical.
    lone = Learner(dist_support.specs(tiny_model_dir)["token"], dist_support.cfg())
    lone.train_step(steps[0][:1], policy_version=1)
    assert got["lone_adapter_tar"] == lone.policy.adapter_tar()

    # A restarted job resumes bit-exact from the checkpoint rank 0 wrote; every rank holds the same replica.
    for k, v in got["uninterrupted"].items():
        assert torch.equal(got["restarted"][k], v), k
    for replica in got["replicas"]:
        for k, v in replica.items():
            assert torch.equal(v, got["restarted"][k]), k

    # The checkpoint of N ranks resumes in one process: its next step matches the N-rank job's.
    one = Learner(dist_support.specs(tiny_model_dir)["token"], dist_support.cfg(seed=3))
    state = restore_checkpoint(one, got["checkpoint"])
    assert state.step == 2
    one.train_step(steps[2], policy_version=1)
    assert_close(one.policy.adapter_state(), got["uninterrupted"], f"1 process resuming a {world}-rank checkpoint")


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_with_the_base_sharded_by_fsdp2_train_like_one_process(world: int, ranked: dict, single: dict) -> None:
    """FSDP2 (fully_shard per block, gloo on CPU): each rank holds 1/N of the frozen base; the ranks run their
    token-balanced shares in lockstep (filler passes), and the update is one process's."""
    got = ranked[world]
    for name in ("token", "sequence_kl", "dr_grpo", "stale"):
        have, want = got[f"{name}_fsdp"], single[name]
        assert have["losses"] == pytest.approx(want["losses"], abs=TOL), name
        assert_close(have["grads"], want["grads"], f"{name} (FSDP2) gradients of step 1")
        assert_close(have["updated"], want["updated"], f"{name} (FSDP2) adapter updated by step 1")
        assert_close(have["adapter"], want["adapter"], f"{name} (FSDP2) adapter after {dist_support.STEPS} steps")
        for key in ("train/tokens", "train/sequences", "reward", "ratio", "entropy"):
            assert have["stats"][key] == pytest.approx(want["stats"][key], abs=TOL), (name, key)
        # Sharding changes where the base lives, not what is computed: the unsharded ranks' exact floats.
        if name != "stale":
            # Each rank stores about 1/N of the base (FSDP pads dim 0 to a multiple of N), together all of it.
            held = have["held"]
            base = held[0][1]
            assert len(held) == world and all(total == base for _, total in held)
            assert sum(h for h, _ in held) == base and max(h for h, _ in held) <= 1.1 * base / world, held
            assert have["losses"] == got[name]["losses"], name
            for k, v in got[name]["adapter"].items():
                assert torch.equal(have["adapter"][k], v), (name, k)
    assert got["sequence_kl_fsdp"]["stats"]["kl"] == pytest.approx(single["sequence_kl"]["stats"]["kl"], abs=TOL)
    # Stale samples (and gradient checkpointing): every rank checked its share under version 0's weights (different
    # numbers of no-grad forwards, padded), and the merged per-generator mismatch is one process's.
    mismatch = [k for k in single["stale"]["stats"] if k.startswith("mismatch/")]
    assert len(mismatch) == 2, mismatch
    for key in mismatch:
        assert got["stale_fsdp"]["stats"][key] == pytest.approx(single["stale"]["stats"][key], abs=TOL), key
    # All samples on rank 0 (the others run filler passes only): the published adapter and the checkpoint rank 0
    # writes are byte-identical to one process's.
    assert got["lone_fsdp"]["adapter"] == single["lone"]["adapter"]
    assert members(got["lone_fsdp"]["checkpoint"]) == members(single["lone"]["checkpoint"])
    assert got["lone_fsdp"]["checkpoint"] == single["lone"]["checkpoint"]


def members(tar: bytes) -> dict[str, bytes]:
    """name -> bytes of a checkpoint tar (a failure then names the file that differs)."""
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        return {m.name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}  # type: ignore[union-attr]


def test_groups_are_split_balanced_by_tokens() -> None:
    rng = random.Random(5)
    groups = [StepGroup(random_group(rng, index=i), 1) for i in range(11)]
    for world in (1, 2, 3, 4):
        shares = shard_groups(groups, world)
        assert sorted(i for s in shares for i in s) == list(range(11))
        loads = [sum(group_tokens(groups[i]) for i in s) for s in shares]
        # LPT's bound: no rank carries more than the average plus the largest group.
        assert max(loads) <= sum(loads) / world + max(group_tokens(g) for g in groups)
        assert shard_groups(groups, world) == shares  # deterministic: every rank computes the same split
    # More ranks than groups: the extra ranks train nothing.
    assert shard_groups(groups[:2], 3)[2] == []


def test_heartbeats_outlast_the_timeout_and_a_hung_rank_fails_the_collective(ranked: dict) -> None:
    import json

    out = ranked["out"]
    got = json.loads((out / "timeouts.json").read_text())
    kinds = json.loads((out / "follower.json").read_text())
    # An 8 s wait for rollouts with a 4 s timeout: rank 1 got heartbeats, then the stop, and never timed out.
    assert got["waited"] == "rollouts"
    assert kinds[-1] == "stop" and kinds.count("wait") >= 4 and set(kinds[:-1]) == {"wait"}
    # Rank 1 hangs for 10 s: rank 0's collective fails on its 4 s timeout (not when rank 1 exits), as a RankFailure
    # (the trainer then exits 1).
    assert "failed" in got["hung_rank"], got
    assert got["failed_after_s"] < 2 * dist_support.TIMEOUT_S, got
