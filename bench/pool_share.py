"""Two runs with shares 2:1 on one generator pool: the ratio of the tokens each got (docs/pool.md).

    .venv/bin/python bench/pool_share.py                  # 4 generators, 20 s measured, prints JSON
    .venv/bin/python bench/pool_share.py --generators 8 --seconds 40

What it starts (and stops): a ``redis-server`` and the proxy app served by uvicorn on a thread of this process
(``tests/proxy/harness.py``), with a ``file://`` bucket in a temp dir; two runs, ``wide`` (share 2, completions
of ~40 tokens) and ``narrow`` (share 1, ~120 tokens: three times longer, so a fair share by requests would
give 6:1 in tokens, not 2:1), each with a trainer thread claiming and acking what is queued. Generator
threads lease through ``POST /v1/pool/lease`` (the proxy picks the run) and submit to the run it named. The
sampling itself is faked (the edge of what this machine has: no GPU): a generator sleeps ``--us-per-token``
per token it "generated", so the pool's capacity is tokens per second, as an engine's is.

It prints the tokens each run got over the measured window and their ratio (target 2.0 within 10 %), then,
with ``narrow`` paused, the fraction ``wide`` gets alone (target 1.0: one run alone gets the whole pool).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bucketrl import errors
from bucketrl.client import ProxyClient
from bucketrl.wire import RolloutBatch
from bucketrl.wire.pool import PoolLeaseRequest
from tests.proxy.harness import ProxyHarness, adapter_tar, make_spec, running
from tests.support.services import RedisServer

RUNS = {"wide": (2.0, 40), "narrow": (1.0, 120)}  # share, mean completion tokens
GROUP = 4


def _setup(proxy: ProxyHarness) -> dict[str, str]:
    lease_ids = {}
    for run, (share, _) in RUNS.items():
        spec = make_spec(
            share=share,
            group_size=GROUP,
            groups_per_step=16,
            max_staleness=4,
            queue_capacity_groups=256,
            sampling={"max_new_tokens": 512},
            dataset={"uri": "toy:digits", "size": 1_000_000},
        )
        t = proxy.client(run, "trainer")
        t.put_run(spec)
        t.register_trainer("t-" + run)
        t.publish_adapter(1, adapter_tar(1))
        lease_ids[run] = proxy.client(run, "generator").lease_version("pool").lease_id
    return lease_ids


def _trainer(proxy: ProxyHarness, run: str, stop: threading.Event) -> None:
    t = proxy.client(run, "trainer", retries=3)
    t.register_trainer("t-" + run)
    while not stop.is_set():
        got = t.claim("t-" + run, max_groups=16, wait_s=0.5)
        if got.deliveries:
            t.ack([d.delivery_id for d in got.deliveries])


def _generator(proxy: ProxyHarness, name: str, lease_ids: dict[str, str], us: float, stop: threading.Event) -> None:
    rng = random.Random(name)
    pool = proxy.client("wide", "generator", retries=3)
    clients = {run: proxy.client(run, "generator", retries=3) for run in RUNS}
    n = 0
    while not stop.is_set():
        try:
            lease = pool.pool_lease(PoolLeaseRequest(worker_id=name, n=2, wait_s=1.0))
        except errors.Backpressure:
            continue
        mean = RUNS[lease.run][1]
        groups = []
        for p in lease.prompts:
            lengths = [max(1, int(rng.gauss(mean, mean / 4))) for _ in range(GROUP)]
            comps = [
                {"token_ids": [7] * k, "logprobs": [-1.0] * k, "reward": rng.random(), "finish_reason": "stop"}
                for k in lengths
            ]
            groups.append({"prompt_id": p.prompt_id, "prompt_index": p.index, "prompt_token_ids": [1, 2, 3]})
            groups[-1]["completions"] = comps
            time.sleep(sum(lengths) * us / 1e6)  # the faked engine time
        batch = {"worker_id": name, "lease_id": lease_ids[lease.run], "version": 1, "groups": groups}
        n += 1
        clients[lease.run].submit_rollouts(RolloutBatch.model_validate(batch), f"{name}-{n}")


def _tokens(viewer: ProxyClient) -> dict[str, int]:
    return {r.run: r.tokens_generated for r in viewer.pool_status().runs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--generators", type=int, default=4)
    p.add_argument("--seconds", type=float, default=20.0, help="measured window (after a 3 s warm-up)")
    p.add_argument("--us-per-token", type=float, default=200.0, help="faked engine time per generated token")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bucketrl-pool-"))
    server = RedisServer(tmp / "redis", persistent=False).start()
    stop = threading.Event()
    try:
        with running(server.url, f"file://{tmp}/bucket") as proxy:
            lease_ids = _setup(proxy)
            threads = [threading.Thread(target=_trainer, args=(proxy, run, stop), daemon=True) for run in RUNS]
            threads += [
                threading.Thread(target=_generator, args=(proxy, f"g{i}", lease_ids, args.us_per_token, stop))
                for i in range(args.generators)
            ]
            for th in threads:
                th.start()
            viewer = proxy.client("wide", "viewer")
            time.sleep(3.0)
            t0 = _tokens(viewer)
            time.sleep(args.seconds)
            t1 = _tokens(viewer)
            proxy.client("narrow", "trainer").pause_generation()
            time.sleep(1.0)  # the leases already handed out are submitted
            t2 = _tokens(viewer)
            time.sleep(args.seconds / 2)
            t3 = _tokens(viewer)
            stop.set()
            for th in threads:
                th.join(10)
    finally:
        server.kill()
    got = {run: t1[run] - t0[run] for run in RUNS}
    alone = {run: t3[run] - t2[run] for run in RUNS}
    ratio = got["wide"] / max(1, got["narrow"])
    out = {
        "generators": args.generators,
        "seconds": args.seconds,
        "tokens": got,
        "ratio_wide_to_narrow": round(ratio, 3),
        "target": "2.0 +- 10 %",
        "within_target": abs(ratio - 2.0) <= 0.2,
        "wide_fraction_with_narrow_paused": round(alone["wide"] / max(1, sum(alone.values())), 3),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
