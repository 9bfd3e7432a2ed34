"""Proxy memory and event-loop latency under large or hostile bodies (issue 12).

    .venv/bin/python bench/proxy_memory.py            # prints one row per case, then the /healthz figure

A real ``bucketrl proxy`` process (real Redis, file bucket) receives, one at a time: rollout batches whose
``prompt_token_ids`` hold millions of strings (4 and 8 MB; the run need not exist), a metrics push with a
long ``loaded_versions`` list, and a well-formed JSON batch near the rollout limit; its RSS is sampled every
5 ms and the peak growth over the idle RSS is reported as a multiple of the body size, and the peak growth of
its children (the decoder process that parses bodies over 256 KiB) beside it. Then 8 large bodies are sent at
once while ``/healthz`` is polled every 10 ms (from its own process): its p50, p99 and slowest answer are
reported, beside the same figures for the idle proxy (what the machine itself adds). Last, 8 legal batches
that the proxy accepts, the same way, as JSON (~26 MB each) and as the packed msgpack workers send: decoding,
the semantic checks, the per-group encoding and the bucket write all happen while ``/healthz`` is polled.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.services import RedisServer, free_port, wait_port

TOKEN = "bench-admin-0123456789abcdef"


class Peak:
    """Samples a process's RSS every 5 ms in a thread; ``peak`` is the highest seen since ``reset``.
    ``child_peak``: the same for the sum of its children (the body decoder process, multiprocessing's tracker)."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak = 0
        self.child_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _children_rss(self) -> int:
        total = 0
        for child in self.proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):  # exited between the listing and the read (a recycled decoder)
                total += child.memory_info().rss
        return total

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            if n % 4 == 0:  # listing children costs more than one read: every 20 ms
                self.child_peak = max(self.child_peak, self._children_rss())
            n += 1
            time.sleep(0.005)

    def reset(self) -> tuple[int, int]:
        time.sleep(0.2)
        now, kids = self.proc.memory_info().rss, self._children_rss()
        self.peak, self.child_peak = now, kids
        return now, kids

    def stop(self) -> None:
        self._stop.set()


def bad_batch(n_strings: int) -> bytes:
    group = {"prompt_id": "0-0", "prompt_index": 0, "prompt_token_ids": ["ab"] * n_strings}
    return json.dumps({"worker_id": "g", "lease_id": "l1", "version": 1, "groups": [group]}).encode()


def legal_batch(target_bytes: int) -> bytes:
    rng = random.Random(0)
    comp = {"token_ids": [rng.randrange(50_000) for _ in range(512)], "logprobs": [-rng.random() for _ in range(512)]}
    comp["reward"] = 1.0
    one = len(json.dumps(comp))
    per_group = 8
    groups = max(1, target_bytes // (one * per_group))
    body = {
        "worker_id": "g",
        "lease_id": "l1",
        "version": 1,
        "groups": [
            {"prompt_id": f"0-{i}", "prompt_index": i, "prompt_token_ids": list(range(64)), "completions": [comp] * 8}
            for i in range(groups)
        ],
    }
    return json.dumps(body).encode()


def legal_submits(url: str) -> dict[str, tuple[list[bytes], str]]:
    """Batches the proxy accepts, 8 as JSON (~26 MB each) and 8 as packed msgpack (what workers send): run ``big``
    (G=16, 1,024-token completions), adapter v1 published, 64 prompts leased per batch."""
    from bucketrl.client import ProxyClient
    from bucketrl.wire import RolloutBatch, RunSpec, packed
    from tests.proxy.harness import adapter_tar

    spec = {
        "base_model": "tiny",
        "reward": {"name": "toy"},
        "dataset": {"uri": "toy:add", "size": 4096},
        "vocab_size": 64,
        "group_size": 16,
        "sampling": {"max_new_tokens": 1024},
        "queue_capacity_groups": 2048,
        "groups_per_step": 512,
    }
    c = ProxyClient(url, "big", TOKEN, retries=0)
    c.put_run(RunSpec.model_validate(spec))
    c.register_trainer("t0")
    c.publish_adapter(1, adapter_tar(1))
    lease = c.lease_version("g", 1, ttl_s=3600)
    rng = random.Random(1)
    out: dict[str, tuple[list[bytes], str]] = {"JSON": ([], "application/json"), "msgpack": ([], "application/msgpack")}
    for kind, (bodies, _) in out.items():
        for _ in range(8):
            groups = []
            for p in c.lease_prompts("g", 64, ttl_s=3600, version=1).prompts:
                comps = [
                    {
                        "token_ids": [rng.randrange(64) for _ in range(1024)],
                        "logprobs": [-rng.random() for _ in range(1024)],
                        "reward": 1.0,
                        "finish_reason": "length",
                    }
                    for _ in range(16)
                ]
                ids = {"prompt_id": p.prompt_id, "prompt_index": p.index}
                groups.append({**ids, "prompt_token_ids": [1] * 64, "completions": comps})
            body = {"worker_id": "g", "lease_id": lease.lease_id, "version": 1, "groups": groups}
            raw = json.dumps(body).encode()
            bodies.append(raw if kind == "JSON" else packed.packb(RolloutBatch.model_validate_json(raw)))
    c.close()
    return out


# /healthz every 10 ms until a line arrives on stdin; prints the latencies (s) as JSON.
POLLER = """
import json, sys, threading, time
import httpx
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
lat = []
with httpx.Client(base_url=sys.argv[1], timeout=60) as h:
    while not stop.is_set():
        t0 = time.perf_counter()
        h.get("/healthz").raise_for_status()
        lat.append(time.perf_counter() - t0)
        time.sleep(0.01)
print(json.dumps(lat))
"""


def _poll(url: str, during: Callable[[], None]) -> list[float]:
    """/healthz latencies (s) from a poller process while ``during()`` runs."""
    poller = subprocess.Popen(
        [sys.executable, "-c", POLLER, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    time.sleep(1.0)  # its imports
    try:
        during()
    finally:
        out, _ = poller.communicate("stop\n", timeout=60)
    return sorted(json.loads(out))


def _percentiles(lat: list[float]) -> str:
    return (
        f"p50 {lat[len(lat) // 2] * 1000:.0f} ms, p99 {lat[int(len(lat) * 0.99)] * 1000:.0f} ms, "
        f"max {lat[-1] * 1000:.0f} ms over {len(lat)} polls"
    )


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bucketrl-mem-") as tmp:
        redis = RedisServer(Path(tmp) / "redis").start()
        port = free_port()
        env = {
            **os.environ,
            "BUCKETRL_REDIS_URL": redis.url,
            "BUCKETRL_BUCKET_URL": f"file://{tmp}/bucket",
            "BUCKETRL_TOKENS": f"admin:{TOKEN}",
            "BUCKETRL_LOG_LEVEL": "warning",
        }
        cmd = [sys.executable, "-m", "bucketrl.cli", "proxy", "--host", "127.0.0.1", "--port", str(port)]
        proxy = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_port(port, timeout_s=60, proc=proxy)
            url = f"http://127.0.0.1:{port}"
            http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=300)
            spec = {
                "base_model": "tiny",
                "reward": {"name": "toy"},
                "dataset": {"uri": "toy:add", "size": 64},
                "vocab_size": 64,
            }
            http.put("/v1/runs/r1", json=spec).raise_for_status()
            peak = Peak(proxy.pid)
            cases = [
                (
                    "rollouts: 2 M strings in prompt_token_ids (unknown run)",
                    "/v1/runs/nope/rollouts",
                    bad_batch(666_000),
                ),
                ("rollouts: 2.7 M strings, 8 MB (unknown run)", "/v1/runs/nope/rollouts", bad_batch(1_333_000)),
                (
                    "metrics: 1 M loaded_versions",
                    "/v1/runs/r1/metrics",
                    json.dumps({"worker_id": "g", "loaded_versions": list(range(1, 800_000))}).encode(),
                ),
                ("rollouts: well-formed 60 MB batch", "/v1/runs/r1/rollouts", legal_batch(60 * 1024 * 1024)),
            ]
            # The decoder child starts with the proxy (decode_pool.warm); give it time to import before measuring.
            time.sleep(3)
            print(
                f"{'case':58s} {'body MB':>8s} {'status':>6s} {'peak +RSS MB':>13s} {'x body':>7s} "
                f"{'decoder peak +RSS MB':>21s}"
            )
            for name, path, body in cases:
                base, kids = peak.reset()
                r = http.post(path, content=body, headers={"Idempotency-Key": "k", "Content-Type": "application/json"})
                time.sleep(0.1)
                grow, kgrow = max(0, peak.peak - base), max(0, peak.child_peak - kids)
                print(
                    f"{name:58s} {len(body) / 1e6:8.1f} {r.status_code:6d} {grow / 1e6:13.0f} {grow / len(body):7.1f} "
                    f"{kgrow / 1e6:21.0f}"
                )
            time.sleep(0.3)
            print(f"children of the proxy (the decoder) hold {peak._children_rss() / 1e6:.0f} MB after these")
            # 8 large bodies at once; /healthz polled meanwhile.
            big = legal_batch(30 * 1024 * 1024)
            base, kids = peak.reset()
            # The poller is its own process: in this one, 8 threads sending 32 MB each share its GIL and would
            # delay its clock, not the proxy's answer. First 3 s of an idle proxy: what this machine adds.
            idle = _poll(url, lambda: time.sleep(3))
            print(f"\n/healthz, idle proxy: {_percentiles(idle)}")

            def send(i: int) -> int:
                with httpx.Client(base_url=url, headers=http.headers, timeout=300) as c:
                    return c.post("/v1/runs/r1/rollouts", content=big, headers={"Idempotency-Key": f"k{i}"}).status_code

            statuses: list[int] = []

            def send_all() -> None:
                with ThreadPoolExecutor(8) as pool:
                    statuses.extend(pool.map(send, range(8)))

            t0 = time.perf_counter()
            lat = _poll(url, send_all)
            took = time.perf_counter() - t0
            grow, kgrow = max(0, peak.peak - base), max(0, peak.child_peak - kids)
            print(
                f"8 x {len(big) / 1e6:.0f} MB at once ({took:.1f} s, statuses {sorted(set(statuses))}): /healthz "
                f"{_percentiles(lat)}; proxy peak +RSS {grow / 1e6:.0f} MB = {grow / len(big):.1f} x one body; "
                f"decoder peak +RSS {kgrow / 1e6:.0f} MB"
            )
            # 8 legal batches at once, accepted (202): decoded, validated, encoded per group, written, enqueued;
            # as JSON, then as the packed msgpack workers send (wire/packed.py).
            for kind, (bodies, ctype) in legal_submits(url).items():
                base, kids = peak.reset()
                statuses.clear()

                def submit(i: int, bodies: list[bytes] = bodies, ctype: str = ctype, kind: str = kind) -> int:
                    with httpx.Client(base_url=url, headers=http.headers, timeout=300) as c:
                        headers = {"Idempotency-Key": f"{kind}{i}", "Content-Type": ctype}
                        return c.post("/v1/runs/big/rollouts", content=bodies[i], headers=headers).status_code

                def submit_all(submit: Callable[[int], int] = submit) -> None:
                    with ThreadPoolExecutor(8) as pool:
                        statuses.extend(pool.map(submit, range(8)))

                t0 = time.perf_counter()
                lat = _poll(url, submit_all)
                took = time.perf_counter() - t0
                grow, kgrow = max(0, peak.peak - base), max(0, peak.child_peak - kids)
                size = max(len(b) for b in bodies)
                print(
                    f"8 x {size / 1e6:.0f} MB legal {kind} batches at once ({took:.1f} s, statuses "
                    f"{sorted(set(statuses))}): /healthz {_percentiles(lat)}; proxy peak +RSS {grow / 1e6:.0f} MB = "
                    f"{grow / size:.1f} x one body; decoder peak +RSS {kgrow / 1e6:.0f} MB"
                )
            peak.stop()
        finally:
            proxy.terminate()
            proxy.wait(30)
            redis.kill()


if __name__ == "__main__":
    main()
