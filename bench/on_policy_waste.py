"""Strict on-policy (`--max-staleness 0`) next to the default asynchronous run: groups wasted and wall time.

    .venv/bin/python bench/on_policy_waste.py                      # the default demo size, both modes
    .venv/bin/python bench/on_policy_waste.py -- --max-steps 30    # extra `bucketrl up` options after --

Each mode is one fresh `bucketrl up --no-live` run. Waste = groups dropped as stale / groups accepted by the
proxy (every accepted group is either trained, dropped or still queued at the end). Target (issue 13): strict
on-policy wastes < 5 % of its groups. Exit code 0 when met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_WASTE = 0.05


def run(label: str, run_dir: Path, extra: list[str]) -> dict[str, float] | None:
    cmd = [sys.executable, "-m", "bucketrl.cli", "up", "--dir", str(run_dir), "--no-live", *extra]
    print(f"[{label}] $", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    wall = time.monotonic() - t0
    summary = run_dir / "summary.json"
    if proc.returncode != 0 or not summary.exists():
        print(f"[{label}] failed (exit {proc.returncode}); logs in {run_dir / 'logs'}\n{proc.stdout[-2000:]}")
        return None
    s = json.loads(summary.read_text())
    accepted = float(s.get("queue_accepted_total") or 0)
    dropped = float(s.get("dropped_stale_total") or 0)
    return {"wall_s": wall, "steps": s["steps"], "accepted": accepted, "dropped": dropped}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    parser.add_argument("up_args", nargs="*", help="extra `bucketrl up` options for both runs (after --)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bucketrl-onpolicy-"))
    results: dict[str, dict[str, float] | None] = {}
    try:
        results["on-policy (--max-staleness 0)"] = run(
            "on-policy", root / "strict", ["--max-staleness", "0", *args.up_args]
        )
        results["async (default)"] = run("async", root / "async", list(args.up_args))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"run directories kept under {root}")
    print()
    print(f"{'mode':32} {'steps':>5} {'accepted':>8} {'dropped':>7} {'waste':>7} {'wall s':>7}")
    for label, r in results.items():
        if r is None:
            print(f"{label:32} failed")
            continue
        waste = r["dropped"] / r["accepted"] if r["accepted"] else 0.0
        counts = f"{r['steps']:5.0f} {r['accepted']:8.0f} {r['dropped']:7.0f}"
        print(f"{label:32} {counts} {100 * waste:6.1f}% {r['wall_s']:7.1f}")
    strict = results["on-policy (--max-staleness 0)"]
    if strict is None or not strict["accepted"]:
        return 1
    ok = strict["dropped"] / strict["accepted"] < TARGET_WASTE
    verdict = "met" if ok else "NOT met"
    print(f"\nstrict on-policy waste {'<' if ok else '>='} {100 * TARGET_WASTE:.0f} % target: {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
