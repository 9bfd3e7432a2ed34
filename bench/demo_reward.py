"""Run the default demo (`bucketrl up`, nothing else) and print its reward figures and wall time.

    .venv/bin/python bench/demo_reward.py                 # a fresh run directory under /tmp
    .venv/bin/python bench/demo_reward.py --keep          # keep it (plots: <dir>/reward.png, pipeline.png)
    .venv/bin/python bench/demo_reward.py -- --generators 3   # extra `bucketrl up` options after --

Target (issue 5): the whole demo, start to summary, within 10 minutes on a 2-core machine; the mean reward
of its last 20 steps >= 0.6 and >= 2x that of its first 20 steps. Exit code 0 when met, 1 otherwise.
"""

from __future__ import annotations

import shutil
import sys

from up_run import timed_up  # bench/up_run.py: run as `python bench/...`, its folder is on sys.path

TARGET_WALL_S = 600.0
TARGET_LAST20 = 0.6
TARGET_RATIO = 2.0


def main() -> int:
    args, run_dir, wall, s = timed_up(__doc__, "demo", [])
    if s is None:
        return 1
    first, last = s["reward_first20"], s["reward_last20"]
    ok = wall <= TARGET_WALL_S and last >= TARGET_LAST20 and last >= TARGET_RATIO * first
    print()
    print(f"steps                      {s['steps']}  (policy versions {s['latest_version']})")
    print(f"wall time, whole demo      {wall:.1f} s   (target <= {TARGET_WALL_S:.0f} s)")
    print(f"reward, first 20 steps     {first:.3f}")
    print(f"reward, last 20 steps      {last:.3f}   (target >= {TARGET_LAST20} and >= {TARGET_RATIO}x first)")
    print(f"improvement                {last / first:.2f}x")
    print(f"step time mean             {s['step_s_mean']:.3f} s; staleness mean {s['staleness_mean']:.2f}")
    if s.get("queue_accepted_total"):
        print(
            f"dropped as stale           {s['dropped_stale_total']} of {s['queue_accepted_total']} accepted groups "
            f"({100 * s['dropped_stale_total'] / s['queue_accepted_total']:.1f} %)"
        )
    if s.get("sync_latency_p50_s") is not None:
        print(
            f"weight sync (publish -> all generators loaded) p50 {s['sync_latency_p50_s'] * 1000:.0f} ms, "
            f"max {s['sync_latency_max_s'] * 1000:.0f} ms over {s['sync_latency_versions']} versions"
        )
    if s.get("eval_versions"):
        print(
            f"eval reward (held-out)     first {s['eval_reward_first']:.3f} -> last {s['eval_reward_last']:.3f} over "
            f"{s['eval_versions']} evaluated versions"
        )
    print(f"target {'MET' if ok else 'MISSED'}")
    if args.keep or args.dir:
        print(f"run directory: {run_dir} (reward.png, pipeline.png, summary.json, logs/)")
    else:
        shutil.rmtree(run_dir.parent, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
