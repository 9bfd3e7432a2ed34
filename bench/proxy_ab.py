"""Proxy CPU per submitted group, A/B: this tree against an earlier commit, both mixes of ``proxy_load.py``.

    .venv/bin/python bench/proxy_ab.py                       # A = c127a13 (issue 17's starting point), 5 pairs
    .venv/bin/python bench/proxy_ab.py --base REV --pairs 6 --mix submit-heavy

A is checked out with ``git worktree`` into a temp dir and runs its own ``bench/proxy_load.py`` and proxy code;
B is this tree. Each pair runs A and B back to back in alternating order (ABBA...), so a change of the machine's
load hits both; the figure is the median of the per-pair ratios B/A of ``proxy_cpu_ms_per_group`` (the proxy
process's CPU seconds over the measured window per accepted group), with their range.

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


def one(tree: Path, mix: str, duration: float, warmup: float) -> float:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = dict(os.environ, PYTHONPATH=str(tree))
        cmd = [
            sys.executable,
            str(tree / "bench" / "proxy_load.py"),
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
            cmd, env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600, check=True
        )
        result = json.loads(Path(out.name).read_text())
    if result["total"]["non_2xx"]:
        sys.exit(f"{tree}: {result['total']['non_2xx']} non-2xx answers in the {mix} mix; not a comparison")
    return float(result["proxy_cpu_ms_per_group"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="c127a13", help="A: the commit to compare with")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--mix", action="append", choices=("default", "submit-heavy"))
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    args = parser.parse_args()
    summary: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="proxy-ab-") as tmp:
        base = checkout(args.base, Path(tmp) / "a")
        try:
            for mix in args.mix or ["default", "submit-heavy"]:
                a_ms, b_ms, ratios = [], [], []
                for i in range(args.pairs):
                    order = [("A", base), ("B", ROOT)] if i % 2 == 0 else [("B", ROOT), ("A", base)]
                    got = {name: one(tree, mix, args.duration, args.warmup) for name, tree in order}
                    a_ms.append(got["A"])
                    b_ms.append(got["B"])
                    ratios.append(got["B"] / got["A"])
                    print(
                        f"{mix} pair {i}: A {got['A']:.2f} ms  B {got['B']:.2f} ms  B/A {ratios[-1]:.3f}  "
                        f"load {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
                summary[mix] = {
                    "a_ms_per_group": statistics.median(a_ms),
                    "b_ms_per_group": statistics.median(b_ms),
                    "ratio_median": statistics.median(ratios),
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                }
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], capture_output=True)
    print(json.dumps({"base": args.base, "pairs": args.pairs, "proxy_cpu_per_group": summary}, indent=2))


if __name__ == "__main__":
    main()
