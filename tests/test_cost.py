"""The run's cost as a pure function of measured totals and prices, checked against numbers worked by hand; bad
prices are refused naming the price."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from bucketrl.cost import ClassTotals, RunTotals, compute, gpu_class_of, load_prices
from bucketrl.wire.cost import DEFAULT_GPU_USD_PER_HOUR, Prices


def test_cost_matches_hand_computed_figures() -> None:
    prices = Prices(gpu_usd_per_hour={"a10g": 1.2}, usd_per_1k_requests=0.005, usd_per_gb_egress=0.09)
    classes = [
        # An h100 generator declared $3.60/h for its 2 h (7.20 $), 0.5 h of it idle.
        ClassTotals(role="generator", gpu_class="h100", worker_s=7200, idle_s=1800, declared_usd=7.2),
        # Two a10g generators, 3 h in all, priced from the table at $1.20/h: 3.60 $, none idle.
        ClassTotals(
            role="generator",
            gpu_class="a10g",
            worker_s=10800,
            undeclared_s=10800,
            workers_live=2,
            live_up_s=100.0,
            live_tokens=5000,
            live_groups=20,
        ),
        # The trainer, 2 h on an h100 at the table's default price.
        ClassTotals(role="trainer", gpu_class="h100", worker_s=7200, undeclared_s=7200),
    ]
    run = RunTotals(
        trainer_steps=100,
        trained_tokens=1e6,
        accepted_groups=400,
        wasted_groups=50,
        produced_groups=500,
        bucket_requests=20_000,
        egress_bytes=10e9,
    )
    c = compute(prices, classes, run)
    trainer_usd = 2 * DEFAULT_GPU_USD_PER_HOUR["h100"]
    gpu = 7.2 + 3.6 + trainer_usd
    total = gpu + 20 * 0.005 + 10 * 0.09  # 20 thousand requests, 10 GB out
    assert math.isclose(c.usd_gpu, gpu) and math.isclose(c.usd_total, total)
    assert math.isclose(c.usd_requests, 0.1) and math.isclose(c.usd_egress, 0.9) and c.egress_gb == 10
    assert math.isclose(c.usd_per_step or 0, total / 100)
    assert math.isclose(c.usd_per_trained_token or 0, total / 1e6)
    assert math.isclose(c.usd_per_accepted_group or 0, total / 400)
    # Waste: the h100 generator's idle quarter (1.80 $), then 50 of 500 groups of the busy generator dollars
    # (7.20 - 1.80 + 3.60 = 9.00 $): 0.90 $.
    assert math.isclose(c.waste_usd, 1.8 + 0.9)
    assert math.isclose(c.waste_fraction, 2.7 / total)
    a10g = next(u for u in c.classes if u.gpu_class == "a10g")
    assert a10g.tokens_per_s == 50 and a10g.groups_per_s == 0.2 and a10g.workers_live == 2
    assert [(u.role, u.gpu_class) for u in c.classes] == [
        ("generator", "a10g"),
        ("generator", "h100"),
        ("trainer", "h100"),
    ]


def test_nothing_measured_yet_has_no_per_unit_figures() -> None:
    c = compute(Prices(), [], RunTotals())
    assert c.usd_total == 0 and c.waste_fraction == 0
    assert c.usd_per_step is None and c.usd_per_trained_token is None and c.usd_per_accepted_group is None


def test_overrides_merge_into_the_default_table(tmp_path: Path) -> None:
    p = load_prices('{"gpu_usd_per_hour": {"h100": 2.0, "mi300x": 3.5}, "estimate": false}')
    assert p.gpu_price("h100") == 2.0 and p.gpu_price("mi300x") == 3.5 and not p.estimate
    assert p.gpu_price("a10g") == DEFAULT_GPU_USD_PER_HOUR["a10g"]  # untouched classes keep their default
    assert p.gpu_price("never-heard-of") == DEFAULT_GPU_USD_PER_HOUR["unknown"]
    f = tmp_path / "prices.json"
    f.write_text('{"usd_per_gb_egress": 0.02}')
    assert load_prices(f"@{f}").usd_per_gb_egress == 0.02
    assert load_prices("") == Prices()


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ('{"gpu_usd_per_hour": {"h100": -1}}', "h100"),
        ('{"gpu_usd_per_hour": {"h100": NaN}}', "h100"),
        ('{"usd_per_1k_requests": -0.5}', "usd_per_1k_requests"),
        ('{"usd_per_gb_egres": 0.01}', "usd_per_gb_egres"),  # misspelt: refused, not ignored
        ('{"gpu_usd_per_hour": {"H 100": 1}}', "H 100"),
        ("{not json", "not JSON"),
        ("@/nonexistent/prices.json", "cannot read"),
    ],
)
def test_bad_prices_are_refused_naming_them(raw: str, says: str) -> None:
    with pytest.raises((ValueError, ValidationError)) as exc:
        load_prices(raw)
    assert says in str(exc.value)


def test_device_names_map_to_priced_classes() -> None:
    assert gpu_class_of("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_class_of("NVIDIA A10G") == "a10g"
    assert gpu_class_of("Tesla T4") == "t4"
    assert gpu_class_of("NVIDIA GeForce RTX 4090") == "geforce-rtx-4090"


def test_lora_parameter_count_matches_hand_computed_shapes() -> None:
    from bucketrl.cost import qwen2_lora_params

    # The built-in tiny model (hidden 128, MLP 256, 2 layers, 2 KV heads of 64), r=16: q 16*256, k/v 16*256 each,
    # o 16*256, gate/up 16*384 each, down 16*384 = 34,816 a layer; PEFT's own count is the same (checked by hand).
    assert qwen2_lora_params(hidden=128, intermediate=256, layers=2, kv_dim=128, r=16) == 69_632
    # Qwen2.5-0.5B (896, 4864, 24 layers, 2 KV heads of 64): q 28,672 + k,v 32,768 + o 28,672 + gate,up 184,320
    # + down 92,160 = 366,592 a layer.
    assert qwen2_lora_params(hidden=896, intermediate=4864, layers=24, kv_dim=128, r=16) == 8_798_208


def test_across_clouds_cost_matches_hand_computed_figures() -> None:
    from bucketrl.cost import AcrossClouds, across_clouds_cost

    prices = Prices(gpu_usd_per_hour={"h100": 3.0, "l4": 1.0, "cpu": 0.2}, usd_per_gb_egress=0.1)
    plan = AcrossClouds(
        generators=8, generators_behind_relays=4, relays=1, adapter_bytes=10_000_000, versions_per_hour=100,
        rollout_bytes_per_version=1_000_000,
    )  # fmt: skip
    cost = across_clouds_cost(prices, plan)
    # Leaving a cloud per version: 1 relay + 4 direct generators = 5 adapters (50 MB) + 1 MB of rollouts; 100 an
    # hour = 5.1 GB at $0.10. The 4 generators behind the relay get their 40 MB inside its region, unpriced.
    assert cost.adapter_bytes_per_version == {
        "proxy_to_relays": 10_000_000,
        "proxy_to_direct_generators": 40_000_000,
        "relays_to_generators": 40_000_000,
    }
    assert math.isclose(cost.egress_gb_per_hour, 5.1)
    expected = {"trainer_gpus": 3.0, "generator_gpus": 8.0, "control_plane": 0.2, "relays": 0.2,
                "skypilot_controller": 0.2, "egress": 0.51}  # fmt: skip
    assert cost.usd_per_hour.keys() == expected.keys()
    assert all(math.isclose(cost.usd_per_hour[k], v) for k, v in expected.items()), cost.usd_per_hour
    assert math.isclose(cost.total_usd_per_hour, 12.11)
    # Every generator behind a relay: only the relays' copies leave the home cloud.
    relayed = across_clouds_cost(prices, dataclasses.replace(plan, generators_behind_relays=8, relays=2))
    assert math.isclose(relayed.egress_gb_per_hour, (2 * 10_000_000 + 1_000_000) * 100 / 1e9)


def test_across_clouds_bench_prints_the_table_and_writes_json(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "cost.json"
    cmd = [sys.executable, str(root / "bench" / "across_clouds_cost.py"), "--no-relays", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin"})
    figures = json.loads(out.read_text())
    assert math.isclose(figures["total_usd_per_hour"], sum(figures["usd_per_hour"].values()))
    assert figures["usd_per_hour"]["relays"] == 0 and figures["adapter_bytes_per_version"]["proxy_to_relays"] == 0
    assert f"{figures['total_usd_per_hour']:8.2f} $/h" in proc.stdout
