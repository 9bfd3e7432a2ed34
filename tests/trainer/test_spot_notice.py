"""The trainer hears its cloud's own spot notice (issue 33): the real trainer worker around the simulated learner
(``python -m bucketrl.sim.trainer``: no model, the worker's claims, checkpoints and acks are the real ones) on an
emulated Azure VM (tests/support/cloud_metadata.py). On the Preempt event it finishes its step, checkpoints at once
and exits 0; the event is acknowledged only after that checkpoint, so the trainer kept the whole notice."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.proxy.harness import TOKENS, running
from tests.support.cloud_metadata import CloudMetadata
from tests.support.services import RedisServer
from tests.trainer.fake_generator import FakeGenerator, wait_until
from tests.trainer.test_worker import spec_json
from tests.trainer.test_worker_processes import max_step

pytestmark = pytest.mark.slow


def test_trainer_on_azure_checkpoints_on_the_preempt_event_and_acknowledges_it_after(
    redis_server: RedisServer, tmp_path: Path, tiny_model_dir: Path
) -> None:
    log = tmp_path / "trainer.log"
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as proxy, CloudMetadata("azure") as azure:
        azure.on_ack = lambda: (log.read_text(), proxy.client("k1").latest_checkpoint())
        env = {k: v for k, v in os.environ.items() if not k.startswith("BUCKETRL_")}
        env.update(
            {
                "BUCKETRL_PROXY_URL": proxy.url,
                "BUCKETRL_TOKEN": TOKENS["trainer"],
                "BUCKETRL_RUN": "k1",
                "BUCKETRL_WORKER_ID": "trainer-spot",
                "BUCKETRL_RUN_SPEC": spec_json(tiny_model_dir, {"uri": "toy:digits", "size": 64}),
                "BUCKETRL_CLAIM_WAIT_S": "0.5",
                "BUCKETRL_AUDIT_LOG": str(tmp_path / "audit.jsonl"),
                "BUCKETRL_CHECKPOINT_EVERY": "1000",  # only the notice's checkpoint
                "BUCKETRL_SIM_STEP_S": "0.3",
                "BUCKETRL_SPOT_NOTICE": "azure",
                "BUCKETRL_SPOT_METADATA_URL": azure.url,
                "BUCKETRL_SPOT_POLL_S": "0.2",
                "PYTHONUNBUFFERED": "1",  # its printed account is in the log the moment it is printed
            }
        )
        gen = FakeGenerator(proxy.url, "k1", TOKENS["generator"])
        gen.start()
        with log.open("w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "bucketrl.sim.trainer"], env=env, stdout=out,
                                    stderr=subprocess.STDOUT)  # fmt: skip
        try:
            wait_until(lambda: max_step(tmp_path) >= 2 or proc.poll() is not None, timeout_s=120)
            assert proc.poll() is None, log.read_text()[-3000:]
            azure.announce(30)
            t0 = time.monotonic()
            rc = proc.wait(30)
            elapsed = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            gen.stop()
    out = log.read_text()
    assert rc == 0 and elapsed < 30, (rc, elapsed, out[-3000:])
    heard = re.search(r"preemption notice \(azure Preempt [^)]*, ([0-9.]+)s\)", out)
    assert heard is not None and 27 <= float(heard.group(1)) <= 30, out[-3000:]
    stopped = re.search(r"stopped at step (\d+) \(checkpointed", out)
    assert stopped is not None, out[-3000:]
    # One acknowledgement, sent after the trainer's own account of its checkpoint, with that checkpoint stored.
    (_, body), = azure.acks  # fmt: skip
    assert len(body["StartRequests"]) == 1
    said, checkpoint = azure.ack_snapshot
    assert "stopped at step" in said and checkpoint is not None and checkpoint.step == int(stopped.group(1))
