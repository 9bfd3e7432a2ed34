"""Scale by simulation: hundreds of generators, proxy replicas, S3 latency and costs, and the async speedup.

    .venv/bin/python bench/scale_sim.py --json /tmp/scale.json            # about 8-10 min on 2 cores
    .venv/bin/python bench/scale_sim.py --generators 8,32 --no-speedup    # a quick look

Everything is real except the GPU (``bucketrl/sim``): ``redis-server``, ``bucketrl proxy --workers W`` (W
processes behind one port), a moto S3 server behind a front adding ``--s3-latency-ms`` (+ exponential jitter)
to every request and counting requests by S3 billing class, the real trainer worker with a simulated
learner (each step takes ``--step-s``; versions and checkpoints are adapter-sized), and N simulated
generators (asyncio workers speaking the real protocol, over up to 4 processes) whose engine calls take
the time the GPU model gives (prefill, batched decode until the call's longest completion ends,
lognormal completion lengths capped at ``max_new_tokens``).

For each N in ``--generators`` it prints: trainer steps/s against the ideal (1 / step time), weight sync
publish -> all N loaded p50/p99, long-poll wake-up p50, proxy CPU per accepted group and per request,
Redis commands per step, bucket requests per step by class and their cost per 1,000 steps at S3 Standard
request prices, stale-drop rate. Then (unless ``--no-speedup``) the async speedup: the same workload at
``--speedup-generators`` with ``max_staleness`` 0 (strict on-policy, paced by admission control) and with
the default 4, wall time from the trainer's start to its last step (equal trained groups).

The JSON (``--json``) has top-level ``async_speedup``, ``strict_on_policy_waste``, ``stale_drop_rate`` (of
the async run), ``by_generators`` (N -> figures) and the raw scenario results; ``--plot`` (default: the
JSON's path with .png) draws sync latency and steps/s against N. This machine has 2 cores shared with other
work: every process of the simulation (the fleet's clients too) competes for them, so at large N the
figures say where CPU runs out here, and CPU per group / per request are the figures that carry over.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bucketrl.sim.cluster import SimBackends, SimScale, run_scale_sim
from bucketrl.sim.gpu import BENCH_GPU

GPU = BENCH_GPU


def scenario(args: argparse.Namespace, n: int, max_staleness: int, steps: int, capped: bool = True) -> SimScale:
    return SimScale(
        generators=n,
        steps=steps,
        warmup_steps=1,
        step_s=args.step_s,
        groups_per_step=n * args.prompts_per_request,  # each generator's one call per step, on average
        max_staleness=max_staleness,
        prompts_per_request=args.prompts_per_request,
        adapter_bytes=int(args.adapter_mb * 1024 * 1024),
        gpu=dict(GPU),
        timeout_s=args.scenario_timeout_s,
        max_train_s=args.max_train_s if capped else None,  # the speedup compares equal trained groups
    )


def row(n: int, r: dict[str, Any]) -> str:
    b = r.get("bucket_requests_per_step", {})
    eff = (r["steps_per_s"] or 0) / r["ideal_steps_per_s"] if r.get("ideal_steps_per_s") else 0

    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    return (
        f"{n:>5} {f(r['steps_per_s'], '.3f'):>7} {eff:>6.0%} {f(r['sync_p50_s'], '.2f'):>7} "
        f"{f(r['sync_p99_s'], '.2f'):>7} {f(r['wakeup_p50_ms'], '.1f'):>8} "
        f"{f(r.get('proxy_cpu_ms_per_group'), '.2f'):>9} "
        f"{r['proxy_cpu_ms_per_request']:>8.2f} {f(r.get('redis_commands_per_step'), '.0f'):>8} "
        f"{b.get('PUT', 0):>6.1f} {b.get('GET', 0):>6.1f} {b.get('LIST', 0):>5.1f} {b.get('DELETE', 0):>6.1f} "
        f"{f(r.get('bucket_cost_per_1000_steps_usd'), '.3f'):>8} {f(r['stale_drop_rate'], '.2%'):>6}"
    )


HEADER = (
    "    N steps/s  ideal  sync50  sync99  wake50ms  cpu/grp  cpu/req  redis/st    PUT    GET  LIST DELETE "
    "$/1k-st  stale"
)


def plot(by_n: dict[int, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted(by_n)

    def ys(key: str) -> list[float]:  # a scenario without the figure (e.g. too few steps) is a gap
        return [math.nan if by_n[n].get(key) is None else by_n[n][key] for n in ns]

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(ns, ys("sync_p50_s"), "o-", label="p50")
    a.plot(ns, ys("sync_p99_s"), "s--", label="p99")
    a.set(xscale="log", xlabel="simulated generators N", ylabel="s", title="weight sync: publish -> all N loaded")
    a.set_xticks(ns, [str(n) for n in ns])
    a.legend()
    b.plot(ns, ys("steps_per_s"), "o-", label="measured")
    b.plot(ns, ys("ideal_steps_per_s"), "k:", label="ideal (1 / step time)")
    b.set(xscale="log", xlabel="simulated generators N", ylabel="trainer steps/s", title="trainer steps/s")
    b.set_xticks(ns, [str(n) for n in ns])
    b.set_ylim(bottom=0)
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--plot", type=Path, help="sync latency and steps/s vs N (default: the --json path, .png)")
    p.add_argument("--generators", default="8,32,128,256", help="comma-separated N")
    p.add_argument("--steps", type=int, default=6, help="trainer steps per N (the first is warm-up)")
    p.add_argument("--step-s", type=float, default=5.0, help="seconds of one simulated trainer step")
    p.add_argument("--prompts-per-request", type=int, default=1)
    p.add_argument("--adapter-mb", type=float, default=1.0, help="published adapter size (bf16 LoRA tensors)")
    p.add_argument("--proxy-workers", type=int, default=2, help="proxy processes behind one port (1-4)")
    p.add_argument("--s3-latency-ms", type=float, default=20.0)
    p.add_argument("--s3-jitter-ms", type=float, default=10.0)
    p.add_argument("--speedup-generators", type=int, default=32)
    p.add_argument("--speedup-steps", type=int, default=5)
    p.add_argument("--no-speedup", action="store_true", help="skip the strict vs async comparison")
    p.add_argument("--scenario-timeout-s", type=float, default=240.0)
    p.add_argument(
        "--max-train-s",
        type=float,
        default=60.0,
        help="stop a scenario's trainer after this long (fewer steps are then measured): bounds the run's wall time",
    )
    p.add_argument("--keep", action="store_true", help="keep the logs directory")
    args = p.parse_args()
    ns = [int(x) for x in args.generators.split(",") if x.strip()]

    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="bucketrl-scale-"))
    say = lambda msg: print(f"[{time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    results: dict[str, Any] = {}
    by_n: dict[int, dict[str, Any]] = {}
    with SimBackends(
        work / "backends",
        proxy_workers=args.proxy_workers,
        s3_latency_ms=args.s3_latency_ms,
        s3_jitter_ms=args.s3_jitter_ms,
    ) as backends:
        say(f"backends up: redis, moto + S3 front ({args.s3_latency_ms:g} ms), proxy x{args.proxy_workers}")
        for n in ns:
            r = run_scale_sim(backends, scenario(args, n, 4, args.steps), f"n{n}", work / f"n{n}", progress=say)
            by_n[n] = r
            say(row(n, r))
        if not args.no_speedup:
            n = args.speedup_generators
            for name, ms in (("strict", 0), ("async", 4)):
                r = run_scale_sim(
                    backends,
                    scenario(args, n, ms, args.speedup_steps, capped=False),
                    f"{name}{n}",
                    work / name,
                    progress=say,
                )
                results[name] = r
                say(f"{name}: {r['train_wall_s']}s for {r['steps']} steps, stale {r['stale_drop_rate']}")
    print(f"\nscale simulation ({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}); proxy x{args.proxy_workers}")
    print(HEADER)
    for n in ns:
        print(row(n, by_n[n]))
    out: dict[str, Any] = {
        "by_generators": {
            str(n): {
                k: by_n[n].get(k)
                for k in (
                    "sync_p50_s",
                    "load_p50_s",
                    "sync_p99_s",
                    "steps_per_s",
                    "ideal_steps_per_s",
                    "proxy_cpu_ms_per_group",
                    "proxy_cpu_ms_per_request",
                    "wakeup_p50_ms",
                    "redis_commands_per_step",
                    "bucket_requests_per_step",
                    "bucket_cost_per_1000_steps_usd",
                    "stale_drop_rate",
                    "requests_per_step",
                    "accounting_ok",
                )
            }
            for n in ns
        },
        "errors": {str(n): by_n[n]["errors"] for n in ns if by_n[n]["errors"]},
    }
    if "async" in results:
        s, a = results["strict"], results["async"]
        # Equal trained groups: both ran speedup_steps steps of the same size (a stalled run has no figure).
        same = s["steps"] == a["steps"] == args.speedup_steps and not (s["timed_out"] or a["timed_out"])
        out["async_speedup"] = round(s["train_wall_s"] / a["train_wall_s"], 3) if same else None
        out["strict_on_policy_waste"] = s["stale_drop_rate"]
        out["stale_drop_rate"] = a["stale_drop_rate"]
        out["speedup_runs"] = {
            k: {
                f: results[k][f]
                for f in ("train_wall_s", "steps", "timed_out", "stale_drop_rate", "groups", "sync_p50_s", "errors")
            }
            for k in ("strict", "async")
        }
        print(
            f"\nasync speedup at N={args.speedup_generators}: {out['async_speedup']}x (strict {s['train_wall_s']}s"
            f"{' STALLED' if s['timed_out'] else ''} for {s['steps']} steps, "
            f"async {a['train_wall_s']}s for {a['steps']} steps); strict waste {(s['stale_drop_rate'] or 0):.2%}, "
            f"async stale drops {(a['stale_drop_rate'] or 0):.2%}"
        )
    out["config"] = {**vars(args), "json": str(args.json), "plot": str(args.plot), "gpu": GPU}
    out["scenarios"] = {str(n): by_n[n] for n in ns} | results
    out["wall_s"] = round(time.monotonic() - t0, 1)
    print(f"total wall {out['wall_s']}s")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
        plot(by_n, args.plot or args.json.with_suffix(".png"))
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"logs: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
