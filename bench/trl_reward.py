"""TRL's reward through bucketrl: its unmodified ``AsyncGRPOTrainer`` trains the built-in tiny model through
``bucketrl up --external-trainer --gateway-port 0`` for ``--steps`` steps; the reward per step is printed (docs/trl.md).

    PYTHONPATH=$PWD .venv/bin/python bench/trl_reward.py                 # 2 generators, 30 steps
    PYTHONPATH=$PWD .venv/bin/python bench/trl_reward.py --steps 60 --generators 1
    PYTHONPATH=$PWD .venv/bin/python bench/trl_reward.py --lr 0          # the control: nothing learns

The suite's test (``tests/gateway/test_trl_trainer.py``) runs 14 steps with a generator killed mid-run and asserts
the rise. This runs the same user setup with the test's settings (``LEARNS``: 4 groups of 8 completions of 8
tokens a step; ``up`` as a subprocess, TRL in this process on CPU with its two CUDA-only calls replaced:
``tests/gateway/trl_cpu.py``, the toy reward "the share of even token ids") for as long as asked, without the kill.
Printed: the reward of every step, the mean of the first and the last quarter of the steps, and TRL's weight sync
p50; one JSON line ends the output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=None, help="TRL's learning rate (default: the test's)")
    p.add_argument("--generators", type=int, default=2)
    args = p.parse_args()

    from tests.gateway.test_trl_trainer import LEARNS, bucketrl_up
    from tests.gateway.trl_cpu import patch_trl_for_cpu, trl_trainer

    patch_trl_for_cpu()
    tmp = Path(tempfile.mkdtemp(prefix="bucketrl-trl-reward-"))
    run_dir = tmp / "run"
    with bucketrl_up(run_dir, generators=args.generators) as url:
        learns = LEARNS | ({} if args.lr is None else {"learning_rate": args.lr})
        trainer = trl_trainer(run_dir / "model", url, tmp / "out", steps=args.steps, **learns)
        trainer.train()
    history = trainer.state.log_history
    rewards = [h["reward"] for h in history if "reward" in h]
    syncs = [h["perf/weight_sync_s"] for h in history if "perf/weight_sync_s" in h]
    q = max(1, len(rewards) // 4)
    out = {
        "steps": len(rewards),
        "generators": args.generators,
        "learning_rate": learns["learning_rate"],
        "reward_per_step": [round(r, 4) for r in rewards],
        "reward_first_quarter": round(statistics.fmean(rewards[:q]), 4),
        "reward_last_quarter": round(statistics.fmean(rewards[-q:]), 4),
        "weight_sync_p50_s": round(statistics.median(syncs), 3) if syncs else None,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
