"""Does a run with partial rollouts learn as well as one without (issue 35)? The demo run twice, same seed:
``partial_rollouts`` off, then on.

    .venv/bin/python bench/partial_learning.py                                   # the demo's 100 steps per run
    .venv/bin/python bench/partial_learning.py --plot docs/img/partial-learning.png --json /tmp/partial.json
    .venv/bin/python bench/partial_learning.py -- --max-new-tokens 16            # extra `bucketrl up` options

Each run is ``bucketrl up --no-live`` (proxy, Redis, trainer, 2 generators on the transformers engine, the built-in
tiny model on toy:digits, the demo's settings and lr; 16 prompts per engine call, the demo's 8 made too few calls see
a version come mid-call) with ``--max-steps`` steps and ``--seed``; the only difference
is the run spec's ``partial_rollouts``. With it a generator's call that sees a new version loaded mid-call stops at
the next decode step and goes on under it (``BUCKETRL_PARTIAL_SWITCH_LAG`` 1), so the comparison only means something
when continuations happen: the bench prints the share of trained tokens from mixed-version completions (the summary's
``mixed_version_token_frac``, a mean over steps) and the generators' continuations.

Per run it prints the reward's mean over the first and last 20 steps, the mixed-version share, continuations, tokens
masked as too stale, the token staleness p50/max and the wall time; ``--plot`` draws both reward curves (per step and
a 10-step rolling mean). Exit 0 when the partial run's mixed share is >= ``--min-mixed`` (0.3) and its last-20 reward
is within ``--tolerance`` (0.1) of the other run's or above it, 1 otherwise. The generators sample with fresh entropy
(an async run is not deterministic anyway): the seed fixes the trainer's (the adapter's initial weights, its order).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bucketrl.tasks.toy import DEMO_LR, DEMO_MAX_STEPS  # noqa: E402

ROLLING = 10


def run_once(name: str, partial: bool, args: argparse.Namespace, root: Path) -> dict[str, Any] | None:
    """One `bucketrl up` run; its summary plus the reward per step and the generators' continuations."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    spec_file = root / f"{name}.json"
    spec_file.write_text(json.dumps({"partial_rollouts": partial}))
    cmd = [
        sys.executable,
        "-m",
        "bucketrl.cli",
        "up",
        "--dir",
        str(run_dir),
        "--no-live",
        "--run-spec",
        str(spec_file),
        "--max-steps",
        str(args.max_steps),
        "--seed",
        str(args.seed),
        # Always given: the bench varies it (a --run-spec file on a toy task keeps the demo's lr by default).
        "--lr",
        repr(args.lr),
        *args.up_args,
    ]
    print("$", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    # Longer calls than the demo's 8 prompts (the generators inherit this environment): more of them see a version
    # come mid-call, so continuations carry a sizeable share of the trained tokens.
    env = os.environ | {"BUCKETRL_PROMPTS_PER_REQUEST": str(args.prompts_per_request)}
    proc = subprocess.run(cmd, check=False, cwd=REPO, stdout=subprocess.DEVNULL, env=env)
    wall = time.monotonic() - t0
    summary_path = run_dir / "summary.json"
    if proc.returncode != 0 or not summary_path.exists():
        print(f"{name}: run failed (exit {proc.returncode}); logs in {run_dir / 'logs'}", flush=True)
        return None
    summary = json.loads(summary_path.read_text())
    rewards: dict[int, float] = {}
    continuations: dict[str, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        push = json.loads(line)
        metrics = push.get("metrics", {})
        if push.get("role") == "trainer" and push.get("step") is not None and "reward" in metrics:
            rewards[int(push["step"])] = float(metrics["reward"])  # the latest push of a step wins, as the summary's
        if "rollout/continuations_total" in metrics:  # cumulative per generator: its latest
            continuations[push["worker_id"]] = float(metrics["rollout/continuations_total"])
    return {
        "partial_rollouts": partial,
        "wall_s": round(wall, 1),
        "steps": summary["steps"],
        "reward_first20": summary["reward_first20"],
        "reward_last20": summary["reward_last20"],
        "mixed_version_token_frac": summary.get("mixed_version_token_frac"),
        "spans_per_completion_mean": summary.get("spans_per_completion_mean"),
        "tokens_stale_masked_total": summary.get("tokens_stale_masked_total"),
        "token_staleness_p50": summary.get("token_staleness_p50"),
        "token_staleness_max": summary.get("token_staleness_max"),
        "continuations": int(sum(continuations.values())),
        "rewards": [rewards[s] for s in sorted(rewards)],
    }


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for (name, r), color in zip(results.items(), ("tab:blue", "tab:orange"), strict=False):
        y = np.asarray(r["rewards"])
        x = np.arange(1, len(y) + 1)
        ax.plot(x, y, color=color, alpha=0.3, lw=1)
        if len(y) >= ROLLING:
            roll = np.convolve(y, np.ones(ROLLING) / ROLLING, mode="valid")
            mixed = r["mixed_version_token_frac"] or 0.0
            label = f"{name} (last 20: {r['reward_last20']:.3f}; mixed-version tokens {100 * mixed:.0f} %)"
            ax.plot(x[ROLLING - 1 :], roll, color=color, lw=2, label=label)
    ax.set_xlabel("trainer step")
    ax.set_ylabel(f"reward (per step; {ROLLING}-step mean)")
    ax.set_title("toy:digits, tiny model: partial rollouts off vs on (same seed)")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--max-steps", type=int, default=DEMO_MAX_STEPS)
    p.add_argument("--lr", type=float, default=DEMO_LR)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prompts-per-request", type=int, default=16, help="BUCKETRL_PROMPTS_PER_REQUEST of the generators (demo: 8)"
    )
    p.add_argument("--min-mixed", type=float, default=0.3, help="the partial run's mixed-version share must reach it")
    p.add_argument("--tolerance", type=float, default=0.1, help="partial's last-20 reward at least off's minus this")
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    p.add_argument("up_args", nargs="*", help="extra `bucketrl up` options (after --), for both runs")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bucketrl-partial-learning-"))
    results: dict[str, dict[str, Any]] = {}
    for name, partial in (("off", False), ("partial", True)):
        r = run_once(name, partial, args, root)
        if r is None:
            return 1
        results[name] = r
        shown = {k: v for k, v in r.items() if k != "rewards"}
        print(json.dumps({"run": name} | shown), flush=True)
    off, on = results["off"], results["partial"]
    mixed = on["mixed_version_token_frac"] or 0.0
    ok = mixed >= args.min_mixed and on["reward_last20"] >= off["reward_last20"] - args.tolerance
    print()
    for name, r in results.items():
        print(
            f"{name:8s} reward first 20 {r['reward_first20']:.3f} -> last 20 {r['reward_last20']:.3f}; "
            f"mixed-version tokens {100 * (r['mixed_version_token_frac'] or 0.0):.1f} %; "
            f"continuations {r['continuations']}; masked {r['tokens_stale_masked_total'] or 0:.0f}; "
            f"staleness p50/max {r['token_staleness_p50']}/{r['token_staleness_max']}; wall {r['wall_s']:.0f} s"
        )
    print(f"target {'MET' if ok else 'MISSED'} (mixed >= {args.min_mixed}, last 20 >= off's - {args.tolerance})")
    if args.plot is not None:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"runs": results, "args": {k: str(v) for k, v in vars(args).items()}}, indent=2)
        )
    if args.keep:
        print(f"run directories: {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
