"""Dr.GRPO trains: oat's recipe (Dr.GRPO with truncated IS: ``objective: decoupled``, ``aggregation: constant``,
``scale_rewards: none``) given as ``bucketrl up --run-spec``, through real processes, learns the toy task.

    .venv/bin/python -m pytest -q -s tests/e2e/test_dr_grpo_run.py
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import reward_curve, running_cluster, series

pytestmark = pytest.mark.slow

STEPS = 30


def test_dr_grpo_with_truncated_is_learns_the_toy_task(tmp_path: Path) -> None:
    spec_file = tmp_path / "dr_grpo.json"
    spec_file.write_text(
        json.dumps({"loss": {"objective": "decoupled", "aggregation": "constant", "scale_rewards": "none"}})
    )
    t0 = time.monotonic()
    with running_cluster(tmp_path, max_steps=STEPS, generators=2, run_spec=spec_file) as cluster:
        trainer = cluster.services["trainer"]
        deadline = time.monotonic() + 420
        while trainer.alive and time.monotonic() < deadline:
            for name in cluster.generator_names:
                assert cluster.services[name].alive, f"{name} died: {cluster.services[name].log_tail()}"
            time.sleep(1.0)
        assert trainer.wait(5) == 0, trainer.log_tail()
        # What the proxy holds (and the trainer trained with): the constant is the run's generation budget.
        with cluster.client() as client:
            loss = client.get_run().spec.loss
            budget = client.get_run().spec.sampling.max_new_tokens
        rewards = [r for _, r in reward_curve(cluster)]
        is_weight = [v for _, v in series(cluster, "is_weight_mean")]
    assert (loss.objective, loss.aggregation, loss.scale_rewards) == ("decoupled", "constant", "none")
    assert loss.constant_normalizer == budget
    assert is_weight, "the decoupled objective's importance weight was never reported"
    assert len(rewards) == STEPS
    first, last = statistics.fmean(rewards[:8]), statistics.fmean(rewards[-8:])
    took = time.monotonic() - t0
    print(f"\nDr.GRPO + TIS: {STEPS} steps in {took:.0f}s; reward first 8 {first:.3f} -> last 8 {last:.3f}")
    assert last >= 2 * first and last - first >= 0.15, (first, last)
