"""Proxy memory and event-loop latency under large or hostile bodies (issue 12).

    .venv/bin/python bench/proxy_memory.py            # prints one row per case, then the /healthz figure

A real ``bucketrl proxy`` process (real Redis, file bucket) receives, one at a time: rollout batches whose
``prompt_token_ids`` hold millions of strings (4 and 8 MB; the run need not exist), a metrics push with a
long ``loaded_versions`` list, and a well-formed JSON batch near the rollout limit; its RSS is sampled every
5 ms and the peak growth over the idle RSS is reported as a multiple of the body size. Then 8 large bodies are
sent at once while ``/healthz`` is polled: the slowest answer is reported.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.services import RedisServer, free_port, wait_port

TOKEN = "bench-admin-0123456789abcdef"


class Peak:
    """Samples a process's RSS every 5 ms in a thread; ``peak`` is the highest seen since ``reset``."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def reset(self) -> int:
        time.sleep(0.2)
        now = self.proc.memory_info().rss
        self.peak = now
        return now

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
            print(f"{'case':58s} {'body MB':>8s} {'status':>6s} {'peak +RSS MB':>13s} {'x body':>7s}")
            for name, path, body in cases:
                base = peak.reset()
                r = http.post(path, content=body, headers={"Idempotency-Key": "k", "Content-Type": "application/json"})
                time.sleep(0.1)
                grow = max(0, peak.peak - base)
                print(
                    f"{name:58s} {len(body) / 1e6:8.1f} {r.status_code:6d} {grow / 1e6:13.0f} {grow / len(body):7.1f}"
                )
            # 8 large bodies at once; /healthz polled meanwhile.
            big = legal_batch(30 * 1024 * 1024)
            base = peak.reset()
            lat: list[float] = []
            done = threading.Event()

            def poll() -> None:
                with httpx.Client(base_url=url, timeout=60) as h:
                    while not done.is_set():
                        t0 = time.perf_counter()
                        h.get("/healthz").raise_for_status()
                        lat.append(time.perf_counter() - t0)
                        time.sleep(0.01)

            poller = threading.Thread(target=poll)
            poller.start()

            def send(i: int) -> int:
                with httpx.Client(base_url=url, headers=http.headers, timeout=300) as c:
                    return c.post("/v1/runs/r1/rollouts", content=big, headers={"Idempotency-Key": f"k{i}"}).status_code

            t0 = time.perf_counter()
            with ThreadPoolExecutor(8) as pool:
                statuses = list(pool.map(send, range(8)))
            took = time.perf_counter() - t0
            done.set()
            poller.join()
            grow = max(0, peak.peak - base)
            print(
                f"\n8 x {len(big) / 1e6:.0f} MB at once ({took:.1f} s, statuses {sorted(set(statuses))}): /healthz "
                f"max {max(lat) * 1000:.0f} ms, p50 {sorted(lat)[len(lat) // 2] * 1000:.0f} ms over {len(lat)} polls; "
                f"peak +RSS {grow / 1e6:.0f} MB = {grow / len(big):.1f} x one body"
            )
            peak.stop()
        finally:
            proxy.terminate()
            proxy.wait(30)
            redis.kill()


if __name__ == "__main__":
    main()
