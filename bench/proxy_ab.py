"""Proxy CPU per group, A/B: this tree against an earlier commit, in the mixes of ``proxy_load.py``.

    .venv/bin/python bench/proxy_ab.py                       # A = c127a13 (issue 17's starting point), 5 pairs
    .venv/bin/python bench/proxy_ab.py --base REV --pairs 6 --mix submit-heavy
    .venv/bin/python bench/proxy_ab.py --base 17e621b --mix deployed     # issue 21: old requests vs folded ones

A is checked out with ``git worktree`` into a temp dir. Each pair runs A and B back to back in alternating order
(ABBA...), so a change of the machine's load hits both; the figure is the median of the per-pair ratios B/A,
with their range. ``default`` and ``submit-heavy``: A runs its own ``bench/proxy_load.py`` and proxy code, B this
tree's, the figure is ``proxy_cpu_ms_per_group`` (the proxy process's CPU seconds over the measured window per
accepted group). ``deployed`` (8 groups per submit, what generators send): both run this tree's bench client,
A against A's proxy with ``--a-requests`` (default old: a prompt lease per submit, an ack per claim, as workers
before issue 21 send), B against this tree's with ``--b-requests`` (default folded); the figure is
``proxy_cpu_ms_per_trained_group`` (per group acked in the window), and each side's requests per trained group
are printed.

A's bench needs one fix to measure anything: before 3277daf its run spec kept the default ``max_new_tokens``, so
every one of its 256-token submits was refused (422) since 0a96296; the fix below lets the run allow them, as
B's bench does. A run with any non-2xx answer stops the comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_SPEC_FIX = (
    '            "groups_per_step": 64,\n        }',
    '            "groups_per_step": 64,\n            "sampling": {"max_new_tokens": 256},\n        }',
)


def checkout(rev: str, into: Path) -> Path:
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(into), rev], check=True, capture_output=True
    )
    bench = into / "bench" / "proxy_load.py"
    text = bench.read_text()
    if '"sampling": {"max_new_tokens"' not in text:
        if _SPEC_FIX[0] not in text:
            sys.exit(f"{rev}: its bench/proxy_load.py has no run spec this script knows how to fix")
        bench.write_text(text.replace(_SPEC_FIX[0], _SPEC_FIX[1], 1))
    return into


def one(tree: Path, mix: str, duration: float, warmup: float, requests: str = "") -> dict:
    """One run of the bench; ``requests`` (the deployed mix): this tree's bench client against ``tree``'s proxy."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        bench = ROOT if mix == "deployed" else tree
        env = dict(os.environ, PYTHONPATH=str(bench))
        # (The deployed mix's wake-up measurement is left short: it is not what is compared.)
        extra = ["--requests", requests, "--proxy-path", str(tree), "--rounds", "3"] if mix == "deployed" else []
        cmd = [
            sys.executable,
            str(bench / "bench" / "proxy_load.py"),
            *extra,
            "--duration",
            str(duration),
            "--warmup",
            str(warmup),
            "--mix",
            mix,
            "--out",
            out.name,
        ]
        subprocess.run(
            cmd, env=env, cwd=bench, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600, check=True
        )
        result = json.loads(Path(out.name).read_text())
    if result["total"]["non_2xx"]:
        sys.exit(f"{tree}: {result['total']['non_2xx']} non-2xx answers in the {mix} mix; not a comparison")
    return result


def figure(result: dict) -> float:
    if result["config"]["mix"] == "deployed":
        return float(result["proxy_cpu_ms_per_trained_group"])
    return float(result["proxy_cpu_ms_per_group"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="c127a13", help="A: the commit to compare with")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--mix", action="append", choices=("default", "submit-heavy", "deployed"))
    parser.add_argument("--a-requests", choices=("old", "folded"), default="old", help="deployed mix: A's requests")
    parser.add_argument("--b-requests", choices=("old", "folded"), default="folded", help="deployed mix: B's")
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    args = parser.parse_args()
    summary: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="proxy-ab-") as tmp:
        base = checkout(args.base, Path(tmp) / "a")
        try:
            for mix in args.mix or ["default", "submit-heavy"]:
                a_ms, b_ms, ratios, a_req, b_req = [], [], [], [], []
                requests = {"A": args.a_requests, "B": args.b_requests}
                for i in range(args.pairs):
                    order = [("A", base), ("B", ROOT)] if i % 2 == 0 else [("B", ROOT), ("A", base)]
                    got = {name: one(tree, mix, args.duration, args.warmup, requests[name]) for name, tree in order}
                    a, b = figure(got["A"]), figure(got["B"])
                    a_ms.append(a)
                    b_ms.append(b)
                    ratios.append(b / a)
                    a_req.append(got["A"].get("requests_per_trained_group", float("nan")))
                    b_req.append(got["B"].get("requests_per_trained_group", float("nan")))
                    print(
                        f"{mix} pair {i}: A {a:.3f} ms  B {b:.3f} ms  B/A {ratios[-1]:.3f}  requests per trained "
                        f"group A {a_req[-1]:.3f} B {b_req[-1]:.3f}  load {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
                summary[mix] = {
                    "a_ms_per_group": statistics.median(a_ms),
                    "b_ms_per_group": statistics.median(b_ms),
                    "ratio_median": statistics.median(ratios),
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                    "a_requests_per_trained_group": statistics.median(a_req),
                    "b_requests_per_trained_group": statistics.median(b_req),
                }
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], capture_output=True)
    out = {"base": args.base, "pairs": args.pairs, "proxy_cpu_per_group": summary}
    if "deployed" in (args.mix or []):
        out["requests"] = {"A": args.a_requests, "B": args.b_requests}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
