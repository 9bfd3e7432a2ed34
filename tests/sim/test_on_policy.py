"""Strict on-policy (``max_staleness`` 0) wastes under 5 % of the groups generated (issue 13): the real proxy's
admission control (slack ``min(BUCKETRL_PACE_SLACK_VERSIONS, max_staleness)``, bucketrl/proxy/state/prompt_lease.py)
against the real trainer worker around a simulated learner and simulated generators that sample far faster
than the trainer steps, so without the pace rule most of their groups would be dropped as stale.

``bench/on_policy_waste.py`` prints the same figure (and wall time) for real `bucketrl up` runs next to async.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bucketrl.sim.cluster import SimBackends, SimScale, run_scale_sim

pytestmark = pytest.mark.timeout(600)

TARGET_WASTE = 0.05


@pytest.mark.slow
@pytest.mark.alone  # the waste it bounds depends on how fast the processes run
def test_strict_on_policy_wastes_under_five_percent(tmp_path: Path) -> None:
    cfg = SimScale(
        generators=4,
        steps=12,
        warmup_steps=2,
        step_s=0.5,
        groups_per_step=8,
        max_staleness=0,
        prompts_per_request=2,
        max_new_tokens=64,
        adapter_bytes=64 * 1024,
        fleet_processes=1,
        gpu={"decode_step_s": 0.002, "length_median": 20},
        timeout_s=300,
    )
    with SimBackends(tmp_path / "backends", proxy_workers=1, s3_latency_ms=2, s3_jitter_ms=1) as backends:
        r = run_scale_sim(backends, cfg, "onpolicy", tmp_path / "onpolicy")
    assert r["errors"] == [] and r["steps"] == cfg.steps, r
    g = r["groups"]
    assert g["lost"] == 0 and r["accounting_ok"], g
    assert g["trained"] == cfg.steps * cfg.step_groups
    wasted = g["dropped_stale_at_claim"] + g["refused_stale_at_submit"]
    print(f"\n[on-policy sim] generated {g['generated']}, trained {g['trained']}, wasted {wasted}")
    assert wasted < TARGET_WASTE * g["generated"], g
