"""Run the multi-turn toy task (`bucketrl up --dataset toy:tools`) and print its reward at the start vs the end, with
the model turns per episode (2 once the model calls the lookup tool and answers after its result; 1 when it
answers at once) from the trainer's step log.

    .venv/bin/python bench/toy_tools.py                   # a fresh run directory under /tmp
    .venv/bin/python bench/toy_tools.py --keep            # keep it (plots: <dir>/reward.png, pipeline.png)
    .venv/bin/python bench/toy_tools.py -- --max-steps 80 # extra `bucketrl up` options after --

Target (issue 14): the run, start to summary, within 10 minutes on a 2-core machine, with a clearly higher reward
at the end: the mean of its last 20 steps >= 2x that of its first 20 steps. Exit code 0 when met, 1 otherwise.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

from up_run import timed_up  # bench/up_run.py: run as `python bench/...`, its folder is on sys.path

TARGET_WALL_S = 600.0
TARGET_RATIO = 2.0
STEP = re.compile(r"step (\d+)/\d+ .*?reward ([-\d.]+).*?turns ([\d.]+)")


def step_log(trainer_log: Path) -> list[tuple[int, float, float]]:
    """(step, reward, model turns per episode) of every step the trainer logged."""
    return [(int(m[1]), float(m[2]), float(m[3])) for m in STEP.finditer(trainer_log.read_text())]


def main() -> int:
    args, run_dir, wall, s = timed_up(__doc__, "tools", ["--dataset", "toy:tools"])
    if s is None:
        return 1
    first, last = s["reward_first20"], s["reward_last20"]
    steps = step_log(run_dir / "logs" / "trainer.log")
    turns_first = sum(t for _, _, t in steps[:20]) / max(1, len(steps[:20]))
    turns_last = sum(t for _, _, t in steps[-20:]) / max(1, len(steps[-20:]))
    ok = wall <= TARGET_WALL_S and last >= TARGET_RATIO * first
    print()
    print(f"steps                         {s['steps']}  (policy versions {s['latest_version']})")
    print(f"wall time, whole run          {wall:.1f} s   (target <= {TARGET_WALL_S:.0f} s)")
    print(f"reward, first 20 steps        {first:.3f}")
    print(f"reward, last 20 steps         {last:.3f}   (target >= {TARGET_RATIO}x first)")
    print(f"improvement                   {last / first:.2f}x")
    print(f"model turns per episode       first 20 steps {turns_first:.2f} -> last 20 steps {turns_last:.2f}")
    print(f"step time mean                {s['step_s_mean']:.3f} s; staleness mean {s['staleness_mean']:.2f}")
    print(f"episodes without a reward     mean {100 * s['unscorable_frac_mean']:.1f} % of a step's")
    for sample in s.get("samples", [])[:3]:
        print(f"  sample v{sample['version']}: {sample['prompt']!r} -> {sample['completion']!r} ({sample['reward']})")
    print(f"target {'MET' if ok else 'MISSED'}")
    if args.keep or args.dir:
        print(f"run directory: {run_dir} (reward.png, pipeline.png, summary.json, logs/)")
    else:
        shutil.rmtree(run_dir.parent, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
