"""One run's trouble on a shared pool, seen from the other run: B's throughput and accounting while A's trainer
is killed, A publishes 10 versions in a second, and A's Redis keys are wiped (docs/pool.md, issue 23).

    .venv/bin/python bench/pool_isolation.py                 # 4 generators, 8 s per phase, prints JSON
    .venv/bin/python bench/pool_isolation.py --generators 8 --seconds 20

What it starts (and stops): a ``redis-server`` and the proxy app served by uvicorn on a thread of this process
(``tests/proxy/harness.py``), with a ``file://`` bucket in a temp dir; runs ``a`` and ``b`` with equal shares
and equal completion lengths, a trainer thread each, and generator threads leasing through ``POST
/v1/pool/lease``. As in ``bench/pool_share.py`` the sampling is faked (no GPU here): a generator sleeps
``--us-per-token`` per token, so the pool's capacity is tokens per second, as an engine's is.

Phases, each ``--seconds`` long, B's tokens per second measured in each:

- ``baseline``: both runs healthy (each gets half the pool);
- ``a_trainer_killed``: A's trainer stops claiming; A's queue fills to its admission limit and the pool passes
  A over, so B is expected to get MORE (the pool is work-conserving), never less;
- ``a_publishes_10_versions``: A's trainer (restarted, a new epoch) publishes v2..v11 within the first second,
  its generators move to v11;
- ``a_keys_wiped``: every ``brl:a:*`` key deleted (A is unknown to the proxy until its trainer puts the run again,
  which restores it from the bucket at the phase's end).

- ``a_trainer_back`` (measured between the two above): A's successor trainer drains A's backlog and A is leased
  again; it takes its share of what comes next, not the pool until its count has caught up with B's.

Target: B's rate in no phase below 90 % of its baseline (a phase where A cannot use its share gives B more), and
B's accounting exact throughout: the proxy's accepted groups and generated tokens for B equal what the
generators had accepted for B.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bucketrl import errors
from bucketrl.client import ProxyClient
from bucketrl.wire import RolloutBatch
from bucketrl.wire.pool import PoolLeaseRequest
from tests.proxy.harness import ProxyHarness, adapter_tar, make_spec, running
from tests.support.services import RedisServer

RUNS = ("a", "b")
GROUP, LENGTH = 4, 60  # completions per group, tokens per completion


class Trainer:
    """A run's trainer thread: claims and acks what is queued until stopped; survives its run being unknown."""

    def __init__(self, proxy: ProxyHarness, run: str) -> None:
        self.client = proxy.client(run, "trainer", retries=3)
        self.client.register_trainer("t-" + run)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, args=(run,), daemon=True)
        self.thread.start()

    def _loop(self, run: str) -> None:
        while not self.stop.is_set():
            try:
                got = self.client.claim("t-" + run, max_groups=16, wait_s=0.5)
                if got.deliveries:
                    self.client.ack([d.delivery_id for d in got.deliveries])
            except errors.BucketRLError:  # its run wiped: nothing to claim until it is put again
                self.stop.wait(0.2)

    def kill(self) -> None:
        self.stop.set()
        self.thread.join(10)


class Books:
    """What the generators had accepted per run (the other side of the proxy's counters), and the versions."""

    def __init__(self, proxy: ProxyHarness) -> None:
        self.lock = threading.Lock()
        self.groups = dict.fromkeys(RUNS, 0)
        self.tokens = dict.fromkeys(RUNS, 0)
        self.failed = dict.fromkeys(RUNS, 0)
        self.lease: dict[str, tuple[str, int]] = {}
        for run in RUNS:
            self.lease_latest(proxy, run)

    def lease_latest(self, proxy: ProxyHarness, run: str) -> None:
        lease = proxy.client(run, "generator").lease_version("pool", ttl_s=3600)
        with self.lock:
            self.lease[run] = (lease.lease_id, lease.version)


def _generator(proxy: ProxyHarness, name: str, books: Books, us: float, stop: threading.Event) -> None:
    pool = proxy.client("a", "generator", retries=3)
    clients = {run: proxy.client(run, "generator", retries=3) for run in RUNS}
    comp = {"token_ids": [7] * LENGTH, "logprobs": [-1.0] * LENGTH, "reward": 0.5, "finish_reason": "stop"}
    n = 0
    while not stop.is_set():
        try:
            lease = pool.pool_lease(PoolLeaseRequest(worker_id=name, n=2, wait_s=1.0))
        except errors.BucketRLError:
            continue
        time.sleep(len(lease.prompts) * GROUP * LENGTH * us / 1e6)  # the faked engine time
        groups = [
            {
                "prompt_id": p.prompt_id,
                "prompt_index": p.index,
                "prompt_token_ids": [1, 2, 3],
                "completions": [comp] * GROUP,
            }
            for p in lease.prompts
        ]
        lease_id, version = books.lease[lease.run]
        batch = {"worker_id": name, "lease_id": lease_id, "version": version, "groups": groups}
        n += 1
        try:
            got = clients[lease.run].submit_rollouts(RolloutBatch.model_validate(batch), f"{name}-{n}")
        except errors.BucketRLError:  # A wiped mid-call, or a version gone stale: A's loss, counted as such
            with books.lock:
                books.failed[lease.run] += len(groups)
            continue
        with books.lock:
            books.groups[lease.run] += got.accepted_groups
            books.tokens[lease.run] += got.accepted_groups * GROUP * LENGTH


def _b(viewer: ProxyClient) -> tuple[int, int]:
    st = {r.run: r for r in viewer.pool_status().runs}["b"]
    return st.tokens_generated, st.groups_accepted


def _measure(viewer: ProxyClient, seconds: float, during: Any = None) -> float:
    t0, _ = _b(viewer)
    start = time.monotonic()
    if during is not None:
        during()
    time.sleep(max(0.0, seconds - (time.monotonic() - start)))
    t1, _ = _b(viewer)
    return (t1 - t0) / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--generators", type=int, default=4)
    p.add_argument("--seconds", type=float, default=8.0, help="length of each phase")
    p.add_argument("--us-per-token", type=float, default=200.0, help="faked engine time per generated token")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bucketrl-pool-iso-"))
    server = RedisServer(tmp / "redis", persistent=False).start()
    stop = threading.Event()
    rates: dict[str, float] = {}
    try:
        with running(server.url, f"file://{tmp}/bucket") as proxy:
            spec = make_spec(
                group_size=GROUP,
                groups_per_step=16,
                max_staleness=4,
                queue_capacity_groups=256,
                sampling={"max_new_tokens": 512},
                dataset={"uri": "toy:digits", "size": 1_000_000},
            )
            trainers = {}
            for run in RUNS:
                admin = proxy.client(run, "trainer")
                admin.put_run(spec)
                trainers[run] = Trainer(proxy, run)
                trainers[run].client.publish_adapter(1, adapter_tar(1))
            books = Books(proxy)
            gens = [
                threading.Thread(target=_generator, args=(proxy, f"g{i}", books, args.us_per_token, stop))
                for i in range(args.generators)
            ]
            for th in gens:
                th.start()
            viewer = proxy.client("b", "viewer")
            time.sleep(3.0)  # warm-up
            rates["baseline"] = _measure(viewer, args.seconds)
            trainers["a"].kill()
            rates["a_trainer_killed"] = _measure(viewer, args.seconds)
            trainers["a"] = Trainer(proxy, "a")  # its successor: a new epoch
            rates["a_trainer_back"] = _measure(viewer, args.seconds)  # A's backlog drains, A is leased again

            def publish() -> None:
                for v in range(2, 12):
                    trainers["a"].client.publish_adapter(v, adapter_tar(v))
                books.lease_latest(proxy, "a")

            rates["a_publishes_10_versions"] = _measure(viewer, args.seconds, publish)

            def wipe() -> None:
                with redis.Redis.from_url(server.url) as r:
                    r.delete(*r.keys("brl:a:*"))
                    r.srem("brl:runs", "a")

            rates["a_keys_wiped"] = _measure(viewer, args.seconds, wipe)
            trainers["a"].client.put_run(spec)  # A's trainer comes back: restored from the bucket
            stop.set()
            for th in gens:
                th.join(30)
            b_tokens, b_groups = _b(viewer)
            for tr in trainers.values():
                tr.kill()
    finally:
        server.kill()
    base = rates["baseline"]
    out = {
        "generators": args.generators,
        "seconds_per_phase": args.seconds,
        "b_tokens_per_s": {k: round(v, 1) for k, v in rates.items()},
        "b_rate_vs_baseline": {k: round(v / base, 3) for k, v in rates.items() if k != "baseline"},
        "target": "B's rate in no phase below 90 % of its baseline (above it: capacity A left unused)",
        "within_target": all(v >= 0.9 * base for v in rates.values()),
        "b_accounting_exact": (b_tokens, b_groups) == (books.tokens["b"], books.groups["b"]),
        "b_groups_accepted": b_groups,
        "b_groups_refused": books.failed["b"],
        "a_groups_refused": books.failed["a"],
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
