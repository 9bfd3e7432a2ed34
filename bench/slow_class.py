"""A slow GPU class in a fast fleet: groups refused stale and prompts held past their window, guard off vs. on.

    .venv/bin/python bench/slow_class.py                        # 3 fast + 1 slow generator, 40 s per mode
    .venv/bin/python bench/slow_class.py --slow 2 --slowdown 8 --duration-s 60 --modes off,on

Built from ``bench/preemption.py``'s pieces (its trainer stand-in, fleet of real ``bucketrl generator`` processes
on the simulated engine, proxy thread and ``redis-server``), with no preemption: ``--fast`` generators of class
``h100`` and ``--slow`` of class ``t4`` whose decode step is ``--slowdown`` times longer, so one of its calls spans
more trainer versions than ``max_staleness`` (2) allows. Mode ``off`` runs the fleet with
``BUCKETRL_STALENESS_GUARD=false`` (what every generator did before the guard: it samples, the submit is refused
stale), ``on`` with the guard (bucketrl/generator/staleness_guard.py).

Per mode and class it prints: groups submitted (accepted by the proxy), groups refused stale at submit, groups
whose call the guard abandoned, tokens decoded (the simulated engines' count, abandoned calls' decoded part
included), tokens trained, tokens wasted (decoded, never trained), and prompt-seconds held past the window (a
call holding its prompts after this worker saw a version that put the call's version out of the window, to the
call's end or its abandon; the submit's scoring comes on top). For the run: trainer steps/s over the measured
window, groups dropped stale at the trainer's claim, groups lost or trained twice (both must be 0).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.preemption import RUN, Fleet, Trainer, _drain_queue, _drive, sim_run_spec
from bucketrl.tasks.tiny_model import build_tiny_model
from tests.proxy.harness import running
from tests.support.services import RedisServer

FAST_STEP_S = 0.015  # the h100's simulated decode step (bench/preemption.py's)
COUNTERS = {
    "submitted": "rollout/groups_submitted_total",
    "stale_at_submit": "rollout/dropped_stale_total",
    "abandoned": "rollout/stale_abandoned_total",
    "held_past_window_prompt_s": "rollout/stale_held_prompt_s_total",
}


def classes(args: argparse.Namespace) -> list[tuple[str, float, float]]:
    fast, slow = ("h100", 3.0, FAST_STEP_S), ("t4", 0.35, FAST_STEP_S * args.slowdown)
    return [fast] * args.fast + [slow] * args.slow


def scenario(mode: str, args: argparse.Namespace, model_dir: Path, tmp: Path) -> dict[str, Any]:
    server = RedisServer(tmp / f"redis-{mode}", persistent=False).start()
    logs = tmp / f"logs-{mode}"
    logs.mkdir()
    env = {"BUCKETRL_STALENESS_GUARD": "true" if mode == "on" else "false"}
    try:
        with running(server.url, f"file://{tmp}/bucket-{mode}") as proxy:
            proxy.client(RUN, "trainer").put_run(sim_run_spec(model_dir, args.groups_per_step))
            trainer = Trainer(proxy, args.groups_per_step, args.step_s)
            fleet = Fleet(proxy, model_dir, logs, args, classes=classes(args), env=env)
            for slot in range(args.fast + args.slow):
                fleet.start(slot)
            trainer.start()
            _drive(fleet, trainer, "none", random.Random(0), args)
            fleet.stop_all(timeout_s=30)
            _drain_queue(trainer)
            status = proxy.client(RUN, "viewer").status()
    finally:
        server.kill()
    return figures(mode, fleet, trainer, status, logs)


def figures(mode: str, fleet: Fleet, trainer: Trainer, status: Any, logs: Path) -> dict[str, Any]:
    q, s = status.queue, trainer.stats
    per_class: dict[str, dict[str, float]] = {}
    for wid in fleet.procs:
        c = per_class.setdefault(wid.split("-")[0], dict.fromkeys([*COUNTERS, "decoded", "trained"], 0.0))
        m = fleet.metrics.get(wid, {})
        for name, metric in COUNTERS.items():
            c[name] += m.get(metric, 0.0)
        tokens = logs / f"{wid}.tokens"
        c["decoded"] += float(tokens.read_text() or 0) if tokens.exists() else 0.0
        c["trained"] += s.trained_by_worker.get(wid, 0)
    for c in per_class.values():
        c["wasted"] = max(0.0, c["decoded"] - c["trained"])
        c["wasted_fraction"] = round(c["wasted"] / c["decoded"], 3) if c["decoded"] else 0.0
    return {
        "mode": mode,
        "classes": {k: {n: round(v, 1) for n, v in c.items()} for k, c in per_class.items()},
        "steps_per_s": round(trainer.window_steps / trainer.window_s, 3),  # type: ignore[attr-defined]
        "stale_at_claim": q.dropped_stale_total,
        "groups_lost": q.accepted_total - (q.acked_total + q.dropped_stale_total + q.groups + q.pending),
        "groups_trained_twice": len(s.trained_prompts) - len(set(s.trained_prompts)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fast", type=int, default=3)
    p.add_argument("--slow", type=int, default=1)
    p.add_argument("--slowdown", type=float, default=7.0, help="the slow class's decode step / the fast one's")
    p.add_argument("--duration-s", type=float, default=40.0, help="measured window per mode (after the warm-up)")
    p.add_argument("--modes", default="off,on")
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--step-s", type=float, default=0.5, help="the stand-in trainer's time per step")
    p.add_argument("--metrics-interval-s", type=float, default=0.5)
    p.add_argument("--prompt-lease-ttl-s", type=float, default=15.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    args.interval_s, args.notice_s = 1e9, 0.0  # _drive's preemption knobs: no preemption here
    tmp = Path(tempfile.mkdtemp(prefix="bucketrl-slow-class-"))
    model_dir = build_tiny_model(tmp / "model")
    results = []
    for mode in args.modes.split(","):
        t0 = time.monotonic()
        r = scenario(mode, args, model_dir, tmp)
        r["wall_s"] = round(time.monotonic() - t0, 1)
        print(json.dumps(r), flush=True)
        results.append(r)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
