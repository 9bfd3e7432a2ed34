"""The trainer's cost of one claim, client side: ``ProxyClient.claim`` of 32 groups (G=8 x 256 tokens each).

    .venv/bin/python bench/claim_cost.py                 # 12 claims, prints JSON
    .venv/bin/python bench/claim_cost.py --claims 30 --groups 64

What it starts (and stops): a ``redis-server`` and the proxy app served by uvicorn on a thread of this process
(``tests/proxy/harness.py``), with a ``file://`` bucket in a temp dir. It submits ``--claims x --groups``
groups as a generator does (``ProxyClient.submit_rollouts``), then times each ``claim`` of ``--groups``
groups and its ack: the calling thread's CPU (HTTP, decoding the answer, validating it into
``ClaimResponse`` with plain lists) and the wall time. The proxy runs on another thread, so the thread CPU is
the trainer's own cost; the wall time includes the proxy's answer. Medians over the claims after the first two.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bucketrl.wire import RolloutBatch
from tests.proxy.harness import adapter_tar, make_spec, running
from tests.support.services import RedisServer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--claims", type=int, default=12)
    p.add_argument("--groups", type=int, default=32, help="groups per claim")
    p.add_argument("--tokens", type=int, default=256, help="tokens per completion (G=8)")
    args = p.parse_args()
    rng = random.Random(0)
    tmp = Path(tempfile.mkdtemp(prefix="bucketrl-claim-"))
    server = RedisServer(tmp / "redis", persistent=False).start()
    try:
        with running(server.url, f"file://{tmp}/bucket") as proxy:
            total = args.claims * args.groups
            spec = make_spec(
                group_size=8,
                vocab_size=32_000,
                queue_capacity_groups=max(4096, total),
                groups_per_step=max(4096, total),
                max_staleness=64,
                sampling={"max_new_tokens": args.tokens},
                dataset={"uri": "toy:digits", "size": 10 * total},
            )
            trainer, gen = proxy.client("r", "trainer"), proxy.client("r", "generator")
            trainer.put_run(spec)
            trainer.register_trainer("t0")
            trainer.publish_adapter(1, adapter_tar(1))
            lease = gen.lease_version("g0").lease_id
            completions = [
                {
                    "token_ids": [rng.randrange(32_000) for _ in range(args.tokens)],
                    "logprobs": [-rng.random() * 5 for _ in range(args.tokens)],
                    "reward": 1.0,
                    "finish_reason": "length",
                }
                for _ in range(8)
            ]
            submitted = 0
            while submitted < total:
                items = gen.lease_prompts("g0", min(64, total - submitted)).prompts
                groups = [
                    {
                        "prompt_id": it.prompt_id,
                        "prompt_index": it.index,
                        "prompt_token_ids": list(range(1, 33)),
                        "completions": completions,
                    }
                    for it in items
                ]
                batch = RolloutBatch.model_validate(
                    {"worker_id": "g0", "lease_id": lease, "version": 1, "groups": groups}
                )
                gen.submit_rollouts(batch, f"k{submitted}")
                submitted += len(items)
            cpu, wall = [], []
            for _ in range(args.claims):
                t0, w0 = time.thread_time(), time.perf_counter()
                got = trainer.claim("t0", max_groups=args.groups)
                cpu.append(time.thread_time() - t0)
                wall.append(time.perf_counter() - w0)
                assert len(got.deliveries) == args.groups, len(got.deliveries)
                trainer.ack([d.delivery_id for d in got.deliveries])
    finally:
        server.kill()
    result = {
        "config": vars(args),
        "claim_client_cpu_ms_median": round(1000 * statistics.median(cpu[2:]), 2),
        "claim_wall_ms_median": round(1000 * statistics.median(wall[2:]), 2),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
