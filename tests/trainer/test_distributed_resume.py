"""A checkpoint written by a 2-rank trainer (torchrun, gloo, the base sharded with FSDP2) resumes in ONE process,
bit-exact: ``bucketrl trainer`` processes against a real proxy + Redis.

The 2-rank job trains steps 1-2 and checkpoints at 2; a single process then resumes (a new epoch) and trains step 3.
Its state after step 3 (adapter and AdamW moments, as its step-3 checkpoint holds them) is recomputed here: the
2-rank checkpoint restored into a fresh learner, then the very groups the single process trained at step 3. Equal
bytes: the single process continued from exactly the state the two ranks left (weights, optimizer, step).

    .venv/bin/python -m pytest -q -s tests/trainer/test_distributed_resume.py
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from tests.proxy.harness import TOKENS, ProxyHarness, running
from tests.support.services import RedisServer
from tests.trainer.fake_generator import FakeGenerator
from tests.trainer.test_worker import spec_json
from tests.trainer.test_worker_processes import audit, lineage

pytestmark = pytest.mark.slow

DATASET = {"uri": "toy:digits", "size": 64}


def env_for(proxy: ProxyHarness, tmp: Path, name: str, model_dir: Path, **settings: object) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUCKETRL_")}
    env.update(
        {
            "BUCKETRL_PROXY_URL": proxy.url,
            "BUCKETRL_TOKEN": TOKENS["trainer"],
            "BUCKETRL_RUN": "k1",
            "BUCKETRL_WORKER_ID": name,
            "BUCKETRL_RUN_SPEC": spec_json(model_dir, DATASET),
            "BUCKETRL_DEVICE": "cpu",
            "BUCKETRL_LR": "0.01",
            "BUCKETRL_CLAIM_WAIT_S": "0.5",
            "BUCKETRL_AUDIT_LOG": str(tmp / "audit.jsonl"),
            "BUCKETRL_DIST_TIMEOUT_S": "60",
            "BUCKETRL_DIST_HEARTBEAT_S": "2",
            # One thread everywhere: the step recomputed in this process runs the same kernels on the same floats.
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
        }
    )
    env.update({f"BUCKETRL_{k.upper()}": str(v) for k, v in settings.items()})
    return env


def start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen([*argv, "-m", "bucketrl.cli", "trainer"], env=env, stdout=out, stderr=subprocess.STDOUT)


def members(tar: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        return {m.name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}  # type: ignore[union-attr]


def test_one_process_resumes_a_two_rank_checkpoint_bit_exact(
    redis_server: RedisServer, tmp_path: Path, tiny_model_dir: Path
) -> None:
    launch = [sys.executable, "-m", "bucketrl.trainer.launch", "--standalone", "--nproc-per-node=2"]
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as proxy:
        gen = FakeGenerator(proxy.url, "k1", TOKENS["generator"])
        gen.start()
        procs: list[subprocess.Popen] = []
        try:
            env = env_for(proxy, tmp_path, "ranks", tiny_model_dir, max_steps=2, checkpoint_every=2, shard_base="true")
            procs.append(start(launch, env, tmp_path / "ranks.log"))
            rc1 = procs[0].wait(180)
            ranks_log = (tmp_path / "ranks.log").read_text()
            assert rc1 == 0, ranks_log
            client = proxy.client("k1")
            written = client.download_checkpoint(2)

            env = env_for(proxy, tmp_path, "single", tiny_model_dir, max_steps=3, checkpoint_every=3)
            procs.append(start([sys.executable], env, tmp_path / "single.log"))
            rc2 = procs[1].wait(180)
            assert rc2 == 0, (tmp_path / "single.log").read_text()
            resumed = client.download_checkpoint(3)
            status = client.status()
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            gen.stop()

    assert "rank 0 of 2" in ranks_log and "rank 1 of 2" in ranks_log and "sharded over 2 ranks with FSDP2" in ranks_log
    records = audit(tmp_path)
    starts = [r for r in records if r["event"] == "start"]
    assert [(r["epoch"], r["step"]) for r in starts] == [(1, 0), (2, 2)]
    (step3,) = [r for r in records if r["event"] == "step" and r["step"] == 3]

    # Step 3 recomputed here from the 2-rank checkpoint and the groups the single process trained.
    from bucketrl.trainer.checkpoint import TrainerState, restore_checkpoint, snapshot
    from bucketrl.trainer.learner import Learner, StepGroup
    from bucketrl.trainer.settings import TrainerSettings
    from bucketrl.wire.runs import RunSpec

    spec = RunSpec.model_validate_json(spec_json(tiny_model_dir, DATASET))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        learner = Learner(spec, TrainerSettings(device="cpu", lr=0.01))
        assert restore_checkpoint(learner, written).step == 2
        # The restore itself is bit-exact: written back, the restored state is the 2-rank checkpoint's bytes.
        again = members(snapshot(learner, TrainerState(step=2, policy_version=0)).pack())
        for name in ("adapter/adapter_model.safetensors", "optimizer.safetensors", "optimizer.json"):
            assert again[name] == members(written)[name], name
        groups = [StepGroup(*gen.groups[d], "gen-fake") for d in step3["deliveries"]]
        learner.train_step(groups, policy_version=status.latest_version)
    finally:
        torch.set_num_threads(threads)
    want = members(snapshot(learner, TrainerState(step=3, policy_version=0)).pack())
    got = members(resumed)
    for name in (
        "adapter/adapter_model.safetensors",
        "adapter/adapter_config.json",
        "optimizer.safetensors",
        "optimizer.json",
    ):
        assert got[name] == want[name], f"{name}: the resumed process is not the 2-rank state plus step 3"

    # Invariant 4 across the change of size: every delivery trained once in the final lineage, and acked.
    kept = lineage(records)
    assert sorted(kept) == [1, 2, 3]
    trained = [d for step in sorted(kept) for d in kept[step]]
    assert len(trained) == len(set(trained)) == 6
    assert status.queue.acked_total == len(trained)
