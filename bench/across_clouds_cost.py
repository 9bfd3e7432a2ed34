"""What the reference's run costs per hour spread over two clouds (docs/across-clouds.md), from the list prices
of docs/cost.md: one trainer GPU, 8 spot generators in two regions of two clouds (each behind its region's relay,
or, with --no-relays, all fetching from the home proxy), the control plane, SkyPilot's jobs controller, egress.

    .venv/bin/python bench/across_clouds_cost.py                    # the table docs/across-clouds.md quotes
    .venv/bin/python bench/across_clouds_cost.py --no-relays --versions-per-hour 60 --json out.json

The adapter is the run spec's LoRA on its model's shape (deploy/skypilot/run-spec.json: r=16, all-linear on
Qwen2.5-0.5B: hidden 896, MLP 4864, 24 layers, 2 KV heads of 64; fp32 as the trainer publishes it). A rollout
version is what generators upload per version: --groups-per-version x G=8 completions of --tokens tokens, 8 bytes
a token (id + behaviour logprob) before msgpack. A computation, not a measurement: no machine is started.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bucketrl.cost import AcrossClouds, across_clouds_cost, load_prices, qwen2_lora_params

QWEN25_05B = {"hidden": 896, "intermediate": 4864, "layers": 24, "kv_dim": 2 * 64}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--generators", type=int, default=8)
    p.add_argument("--no-relays", action="store_true", help="every generator fetches from the home proxy")
    p.add_argument("--versions-per-hour", type=float, default=120.0, help="one version per 30 s step (sync_every 1)")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--groups-per-version", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128, help="prompt + completion tokens of one completion")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()

    adapter = qwen2_lora_params(**QWEN25_05B, r=args.lora_r) * 4
    relays = 0 if args.no_relays else 2
    plan = AcrossClouds(
        generators=args.generators,
        generators_behind_relays=0 if args.no_relays else args.generators,
        relays=relays,
        adapter_bytes=adapter,
        versions_per_hour=args.versions_per_hour,
        rollout_bytes_per_version=args.groups_per_version * 8 * args.tokens * 8,
    )
    cost = across_clouds_cost(load_prices(), plan)  # BUCKETRL_PRICES overrides them, as for the proxy
    for line, usd in cost.usd_per_hour.items():
        print(f"{line:22s} {usd:8.2f} $/h")
    print(f"{'total':22s} {cost.total_usd_per_hour:8.2f} $/h  (egress {cost.egress_gb_per_hour:.2f} GB/h)")
    for link, n in cost.adapter_bytes_per_version.items():
        print(f"adapter bytes per version, {link}: {n / 1e6:.1f} MB")
    if args.json:
        out = {"plan": dataclasses.asdict(plan), **dataclasses.asdict(cost)}
        out["total_usd_per_hour"] = cost.total_usd_per_hour
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
