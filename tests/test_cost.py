"""The run's cost as a pure function of measured totals and prices, checked against numbers worked by hand; bad
prices are refused naming the price."""

from __future__ import annotations

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
