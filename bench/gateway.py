"""The gateway's figures for a TRL user: weight sync, load -> first completion, and the latency it adds.

    PYTHONPATH=$PWD .venv/bin/python bench/gateway.py                       # 2 generators, 6 TRL steps
    PYTHONPATH=$PWD .venv/bin/python bench/gateway.py --generators 1 --steps 4 --loads 5 --requests 10

What it starts (and stops, by pid): ``redis-server`` and ``bucketrl proxy`` (processes, on free loopback ports,
a ``file://`` bucket in a temp dir), ``--generators`` generator processes serving completion jobs (transformers
engine, the tiny model) and ``bucketrl gateway``. Then, in order:

1. **TRL's own sync time.** TRL 1.16's ``AsyncGRPOTrainer`` (on CPU: ``tests/gateway/trl_cpu.py`` replaces its
   two CUDA-only calls) trains ``--steps`` steps through the gateway with a sync after every step. Printed: the
   p50 of TRL's ``perf/weight_sync_s`` (save the adapter, ``load_lora_adapter`` = pack, publish, commit in the
   bucket, answer).
2. **Load -> served.** ``--loads`` fresh adapters are loaded through the gateway, one at a time. For each:
   ``load_s`` (until the load is answered: the version is committed), ``first_completion_s`` (until the first
   completion naming it is answered, ``max_tokens`` 1) and ``every_generator_s`` (until every generator reports
   the version resident: the run's status, fed by their metric pushes every 0.2 s, so up to 0.2 s late).
3. **Added latency.** ``--requests`` single-prompt completions (8 tokens), one at a time, through the gateway, and
   the same prompt and settings on an engine in this process with the same adapter (the generator's own engine
   code, no proxy, no HTTP). Printed: both medians and their difference, the gateway's cost per request (HTTP in,
   a job through the proxy and Redis, a generator's lease long-poll, the result back).

The machine is whatever it is: on a shared 2-core box the engine figures jump. One JSON line ends the output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from generator_overhead import TOKENS, start_services, stop  # noqa: E402

RUN = "bench-gw"
PROMPT = [4, 40, 5, 43]  # "1+2=" in the tiny model's vocabulary


def env_for(url: str, role: str, **settings: object) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUCKETRL_")}
    env |= {"BUCKETRL_PROXY_URL": url, "BUCKETRL_TOKEN": TOKENS[role], "BUCKETRL_RUN": RUN, "PYTHONPATH": str(REPO)}
    env |= {f"BUCKETRL_{k.upper()}": str(v) for k, v in settings.items()}
    return env


GENERATOR = {"engine": "transformers", "serve_completion_jobs": 1, "reward_workers": 1, "version_wait_s": 2}


def start_generators(url: str, n: int, work: Path) -> list[subprocess.Popen]:
    return [
        subprocess.Popen(
            [sys.executable, "-m", "bucketrl.cli", "generator"],
            env=env_for(url, "generator", worker_id=f"gen-{i}", seed=i, metrics_interval_s=0.2, **GENERATOR),
            cwd=REPO,
            stdout=(work / f"gen-{i}.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        for i in range(n)
    ]


def start_gateway(url: str, work: Path) -> tuple[subprocess.Popen, str]:
    url_file = work / "gateway.url"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bucketrl.cli", "gateway", "--port", "0", "--url-file", str(url_file)],
        env=env_for(url, "trainer", gateway_state=work / "gateway-state.json"),
        cwd=REPO,
        stdout=(work / "gateway.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while not url_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"gateway did not start:\n{(work / 'gateway.log').read_text()[-2000:]}")
        time.sleep(0.1)
    return proc, url_file.read_text().strip()


def completion(gw: str, model: str, max_tokens: int, timeout: float = 300) -> dict[str, Any]:
    import requests

    payload = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 1.0}
    payload |= {"return_token_ids": True, "logprobs": 0}
    out = requests.post(f"{gw}/v1/completions", json=payload, timeout=timeout)
    out.raise_for_status()
    return dict(out.json()["choices"][0])


def trl_syncs(model_dir: Path, gw: str, work: Path, steps: int) -> list[float]:
    from tests.gateway.trl_cpu import patch_trl_for_cpu, trl_trainer

    patch_trl_for_cpu()
    trainer = trl_trainer(model_dir, gw, work / "trl-out", steps=steps)
    trainer.train()
    return [h["perf/weight_sync_s"] for h in trainer.state.log_history if "perf/weight_sync_s" in h]


def wait_all_loaded(url: str, version: int, n: int, timeout: float = 300) -> None:
    from bucketrl.client import ProxyClient

    with ProxyClient(url, RUN, TOKENS["viewer"]) as viewer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            holding = [w for w in viewer.status().workers if version in w.loaded_versions]
            if len(holding) >= n:
                return
            time.sleep(0.05)
    raise TimeoutError(f"not every generator loaded version {version} in {timeout}s")


def load_to_served(model_dir: Path, url: str, gw: str, work: Path, loads: int, n_gen: int) -> list[dict[str, float]]:
    import requests

    from bucketrl.client import ProxyClient
    from tests.generator.helpers import make_adapter

    rows = []
    with ProxyClient(url, RUN, TOKENS["generator"]) as gen:
        for i in range(loads):
            adapter = make_adapter(model_dir, work / f"bench-adapter-{i}", seed=100 + i)
            t0 = time.perf_counter()
            r = requests.post(f"{gw}/v1/load_lora_adapter", json={"lora_name": f"bench-{i}", "lora_path": str(adapter)})
            r.raise_for_status()
            t_load = time.perf_counter() - t0
            completion(gw, f"bench-{i}", 1)
            t_first = time.perf_counter() - t0
            latest = gen.wait_for_version(after=0, wait_s=0)
            assert latest is not None
            wait_all_loaded(url, latest.version, n_gen)
            t_all = time.perf_counter() - t0
            rows.append({"load_s": t_load, "first_completion_s": t_first, "every_generator_s": t_all})
    return rows


def added_latency(model_dir: Path, url: str, gw: str, work: Path, requests_n: int) -> dict[str, float]:
    """The last bench adapter, the same prompt and settings: through the gateway vs this process's own engine."""
    from bucketrl.generator.engines.factory import make_engine
    from bucketrl.generator.settings import GeneratorSettings
    from bucketrl.wire import SamplingSpec
    from tests.generator.helpers import run_spec

    spec = run_spec(model_dir, max_staleness=2)
    settings = GeneratorSettings(proxy_url=url, token=TOKENS["generator"], run=RUN, engine="transformers", seed=0)
    engine = make_engine(settings, spec)
    names = sorted(p.name for p in work.glob("bench-adapter-*"))
    engine.load_adapter("direct", 1, work / names[-1])
    sampling = SamplingSpec(temperature=1.0, max_new_tokens=8)
    direct, via = [], []
    model = f"bench-{len(names) - 1}"
    for _ in range(2):  # warm-up of both paths
        engine.generate([PROMPT], adapter="direct", n=1, sampling=sampling)
        completion(gw, model, 8)
    for _ in range(requests_n):  # alternated: both see the same (noisy, shared) machine
        t0 = time.perf_counter()
        engine.generate([PROMPT], adapter="direct", n=1, sampling=sampling)
        direct.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        completion(gw, model, 8)
        via.append(time.perf_counter() - t0)
    engine.close()
    d, g = statistics.median(direct), statistics.median(via)
    return {"direct_p50_s": d, "gateway_p50_s": g, "added_p50_s": g - d}


def p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--generators", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="TRL steps (a sync after each)")
    ap.add_argument("--loads", type=int, default=8, help="adapters loaded for the load -> served timings")
    ap.add_argument("--requests", type=int, default=20, help="requests per path for the added latency")
    args = ap.parse_args()

    import logging

    from bucketrl.client import ProxyClient
    from bucketrl.tasks.tiny_model import build_tiny_model
    from tests.generator.helpers import run_spec

    logging.basicConfig(level=logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    procs: list[subprocess.Popen] = []
    try:
        model_dir = build_tiny_model(work / "tiny")
        procs, url = start_services(work)
        ProxyClient(url, RUN, TOKENS["trainer"]).put_run(run_spec(model_dir, max_staleness=2))
        procs += start_generators(url, args.generators, work)
        gw_proc, gw = start_gateway(url, work)
        procs.append(gw_proc)
        syncs = trl_syncs(model_dir, gw, work, args.steps)
        rows = load_to_served(model_dir, url, gw, work, args.loads, args.generators)
        lat = added_latency(model_dir, url, gw, work, args.requests)
    finally:
        for p in reversed(procs):
            stop(p)
    out = {
        "generators": args.generators,
        "trl_weight_sync_p50_s": p50(syncs),
        "trl_syncs": len(syncs),
        "load_p50_s": p50([r["load_s"] for r in rows]),
        "load_to_first_completion_p50_s": p50([r["first_completion_s"] for r in rows]),
        "load_to_every_generator_p50_s": p50([r["every_generator_s"] for r in rows]),
        **lat,
    }
    print(f"TRL perf/weight_sync_s p50 over {len(syncs)} syncs: {out['trl_weight_sync_p50_s']:.3f} s (blog: 6.2-8.5 s)")
    print(f"load_lora_adapter answered (committed) p50: {out['load_p50_s']:.3f} s")
    print(f"load -> first completion with that version p50: {out['load_to_first_completion_p50_s']:.3f} s")
    print(f"load -> resident on all {args.generators} generators p50: {out['load_to_every_generator_p50_s']:.3f} s")
    print(
        f"one 8-token completion p50: direct engine {lat['direct_p50_s'] * 1e3:.1f} ms, through the gateway "
        f"{lat['gateway_p50_s'] * 1e3:.1f} ms, added {lat['added_p50_s'] * 1e3:.1f} ms"
    )
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
