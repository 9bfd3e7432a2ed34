"""The production engine end to end: a generator on vLLM (the CPU build here, the same code on GPUs) feeds
the trainer through the proxy; its behaviour logprobs agree with the trainer's (docs/design.md invariant 6).

    .venv/bin/python -m pytest -q -s tests/e2e/test_vllm_run.py
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import (
    Watch,
    check_invariants,
    print_sync_latency,
    running_cluster,
    series,
    status,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

STEPS = 10


def test_vllm_generator_behaviour_logprobs_match_the_trainer(tmp_path: Path) -> None:
    t0 = time.monotonic()
    # One vLLM generator next to one transformers generator: both engines feed the same trainer. The vLLM one
    # starts first and serves alone until it has loaded v1 (its engine takes ~30-50 s to start on CPU).
    with running_cluster(
        tmp_path, start=False, max_steps=STEPS, generators=2, generator_engines=["vllm", "transformers"], lr=3e-4
    ) as cluster:
        cluster.start_redis()
        cluster.start_proxy()
        cluster.start_trainer()
        cluster.start_generator(0)
        watch = Watch(cluster)
        wait_for(
            lambda: watch.poll() and any(w.worker_id == "gen-0" and w.loaded_versions for w in watch.last.workers),
            240,
            "the vLLM generator to serve v1",
        )
        cluster.start_generator(1)
        trainer = cluster.services["trainer"]
        deadline = time.monotonic() + 480
        while trainer.alive and time.monotonic() < deadline:
            watch.poll()
            for name in cluster.generator_names:
                assert cluster.services[name].alive, f"{name} died: {cluster.services[name].log_tail()}"
            time.sleep(1.0)
        assert trainer.wait(5) == 0, trainer.log_tail()
        cluster.stop_workers()  # generators release their prompts; the queue is still from here on
        report = check_invariants(cluster, watch)
        ratio = [v for _, v in series(cluster, "ratio")]
        vllm_gap = [v for _, v in series(cluster, "mismatch/logprob_abs_diff/gen-0")]
        hf_gap = [v for _, v in series(cluster, "mismatch/logprob_abs_diff/gen-1")]
        vllm_loaded = next(w.loaded_versions for w in status(cluster).workers if w.worker_id == "gen-0")
        print(f"\n[vllm] {report}; {time.monotonic() - t0:.0f}s")
        print(
            f"[vllm] ratio mean {statistics.fmean(ratio):.5f} over {len(ratio)} steps; |logprob gap| vLLM "
            f"mean {statistics.fmean(vllm_gap) if vllm_gap else float('nan'):.2e} ({len(vllm_gap)} steps), "
            f"transformers mean {statistics.fmean(hf_gap) if hf_gap else float('nan'):.2e}; vLLM loaded {vllm_loaded}"
        )
        print_sync_latency(cluster)
    assert len(ratio) == STEPS
    assert abs(statistics.fmean(ratio) - 1.0) <= 0.01
    # The vLLM generator really fed the trainer, under the trainer's weights, and agreed with them.
    assert vllm_gap, "no group of the vLLM generator was trained on"
    assert max(vllm_gap) < 1e-3, vllm_gap
    assert report.latest_version >= 5
