"""Generator overhead: the worker loop against a live proxy vs the bare engine on the same prompts.

    .venv/bin/python bench/generator_overhead.py                          # transformers engine
    .venv/bin/python bench/generator_overhead.py --engine vllm --groups 256
    .venv/bin/python bench/generator_overhead.py --max-new-tokens 8       # the demo's (shortest) completions

What it starts (and stops, by pid): ``redis-server`` and ``bucketrl proxy`` (its own process) on free loopback
ports with a ``file://`` bucket in a temp dir, and a trainer stand-in process that claims and acks every group
(so admission control keeps granting prompts, as a real trainer would). It builds the tiny model and a LoRA
adapter, creates the demo run (toy ``digits`` task, G=8, toy reward) and publishes the adapter as v1.

One engine serves both measurements (same weights, same adapter, warmed up):

- bare:   ``engine.generate`` on prompts 0..N-1, ``--prompts-per-request`` prompts per call, n=G: no proxy,
          no leases, no rewards, no submission.
- worker: :class:`bucketrl.generator.worker.GeneratorWorker` with ``max_groups=N``: it leases the same prompts
          (the proxy hands out 0..N-1 in order), samples, scores in its reward pool, submits msgpack batches,
          renews leases and pushes metrics, until N groups are accepted.

tokens/s = completion tokens sampled / wall time, from the first engine call to the last one (bare) or to the
last group accepted (worker). ``--repeats`` bare/worker pairs run alternately on fresh prompt slices (the machine
may be shared and noisy); prints the medians and the median per-pair ratio = worker / bare (target >= 0.90), then
one JSON line. ``engine_duty`` (the share of the worker's wall time spent inside ``engine.generate``) is the loop's
own overhead measured within one run, so it holds even when other processes make the tok/s figures jumpy.
``colocated_cpu_share``: CPU seconds the proxy, Redis and the trainer stand-in used during the worker run, per
second (1.0 = one core): on a small machine that is taken from the engine, in a deployment it is not.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RUN = "bench-gen"
# Tokens must be 16+ characters (the proxy refuses shorter ones at start).
TOKENS = {
    "admin": "b-admin-0123456789abcdef",
    "trainer": "b-trainer-0123456789abcdef",
    "generator": "b-gen-0123456789abcdef",
    "viewer": "b-view-0123456789abcdef",
}


def start_services(work: Path) -> tuple[list[subprocess.Popen], str]:
    from tests.support.services import free_port, redis_server_binary, wait_port

    rport, pport = free_port(), free_port()
    redis = subprocess.Popen(
        [redis_server_binary(), "--port", str(rport), "--bind", "127.0.0.1", "--dir", str(work), "--save", ""],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_port(rport, timeout_s=60.0, proc=redis)
    env = {
        **os.environ,
        "BUCKETRL_REDIS_URL": f"redis://127.0.0.1:{rport}/0",
        "BUCKETRL_BUCKET_URL": f"file://{work / 'bucket'}",
        "BUCKETRL_TOKENS": ",".join(f"{r}:{t}" for r, t in TOKENS.items()),
    }
    proxy = subprocess.Popen(
        [sys.executable, "-m", "bucketrl.cli", "proxy", "--host", "127.0.0.1", "--port", str(pport)],
        env=env,
        stdout=(work / "proxy.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    wait_port(pport, timeout_s=60.0, proc=proxy)
    return [proxy, redis], f"http://127.0.0.1:{pport}"


def cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def consume(url: str, stop_flag: Any) -> None:
    """Trainer stand-in (its own process): claim and ack everything."""
    from bucketrl.client import ProxyClient

    with ProxyClient(url, RUN, TOKENS["trainer"]) as c:
        c.register_trainer("bench-trainer")
        while not stop_flag.is_set():
            got = c.claim("bench-trainer", max_groups=64, wait_s=0.5)
            if got.deliveries:
                c.ack([d.delivery_id for d in got.deliveries])


class TimedEngine:
    """Delegates to an engine and records when sampling started and how many tokens it produced."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.first_call: float | None = None
        self.tokens = 0
        self.busy_s = 0.0
        self.close_calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def generate(self, prompts: list[list[int]], **kw: Any) -> Any:
        t0 = time.perf_counter()
        if self.first_call is None:
            self.first_call = t0
        out = self.engine.generate(prompts, **kw)
        self.busy_s += time.perf_counter() - t0
        self.tokens += sum(len(s.token_ids) for g in out for s in g)
        return out

    def close(self) -> None:  # the benchmark closes the engine itself
        self.close_calls += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    ap.add_argument("--groups", type=int, default=96, help="groups (prompts) per measurement")
    ap.add_argument("--prompts-per-request", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--reward-workers", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="bare/worker pairs, alternated; medians reported")
    args = ap.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import logging

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bucketrl.client import ProxyClient
    from bucketrl.datasets import load_examples, prompt_token_ids
    from bucketrl.generator.engines.factory import make_engine
    from bucketrl.generator.settings import GeneratorSettings
    from bucketrl.generator.worker import GeneratorWorker
    from bucketrl.tarball import pack_dir
    from bucketrl.tasks.tiny_model import build_tiny_model
    from bucketrl.tasks.toy import default_run_spec

    logging.basicConfig(level=logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="bench-gen-"))
    procs: list[subprocess.Popen] = []
    consumer = None
    engine = None
    try:
        model_dir = build_tiny_model(work / "tiny")
        import torch

        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        lcfg = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
        get_peft_model(base, lcfg).save_pretrained(work / "adapter")

        spec = default_run_spec(model_dir)
        spec = spec.model_copy(
            update={"sampling": spec.sampling.model_copy(update={"max_new_tokens": args.max_new_tokens})}
        )
        procs, url = start_services(work)
        admin = ProxyClient(url, RUN, TOKENS["trainer"])
        admin.put_run(spec)
        admin.register_trainer("bench-setup")
        admin.publish_adapter(1, pack_dir(work / "adapter"))

        settings = GeneratorSettings(
            proxy_url=url,
            token=TOKENS["generator"],
            run=RUN,
            worker_id="bench-gen",
            engine=args.engine,
            seed=0,
            prompts_per_request=args.prompts_per_request,
            reward_workers=args.reward_workers,
            max_groups=args.groups,
            max_model_len=256,
            metrics_interval_s=2.0,
        )
        engine = make_engine(settings, spec)
        engine.load_adapter(f"{RUN}-v1", 1, work / "adapter")
        tok = AutoTokenizer.from_pretrained(model_dir)
        examples = load_examples(spec.dataset)
        prompts = [prompt_token_ids(tok, ex.prompt, raw=ex.raw) for ex in examples[: args.groups * args.repeats]]
        G = spec.group_size
        for _ in range(2):  # warm-up: kernels, allocator
            engine.generate(prompts[: args.prompts_per_request], adapter=f"{RUN}-v1", n=G, sampling=spec.sampling)

        stop_flag = mp.get_context("spawn").Event()
        consumer = mp.get_context("spawn").Process(target=consume, args=(url, stop_flag), daemon=True)
        consumer.start()
        runs = []
        for r in range(args.repeats):  # alternate, so both see the same (noisy, shared) machine
            chunk = prompts[r * args.groups : (r + 1) * args.groups]
            tokens = 0
            t0 = time.perf_counter()
            for i in range(0, len(chunk), args.prompts_per_request):
                out = engine.generate(
                    chunk[i : i + args.prompts_per_request], adapter=f"{RUN}-v1", n=G, sampling=spec.sampling
                )
                tokens += sum(len(s.token_ids) for g in out for s in g)
            bare_s = time.perf_counter() - t0

            others = [p.pid for p in procs] + [consumer.pid]  # proxy, redis, trainer stand-in
            others_cpu0 = sum(cpu_s(pid) for pid in others)
            timed = TimedEngine(engine)
            worker = GeneratorWorker(
                settings.model_copy(update={"worker_id": f"bench-gen-{r}"}),
                engine=timed,  # type: ignore[arg-type]
            )
            worker.run()
            assert timed.first_call is not None and worker.submitter is not None
            worker_s = (worker.submitter.last_accepted_at or time.perf_counter()) - timed.first_call
            others_cpu = sum(cpu_s(pid) for pid in others) - others_cpu0
            runs.append(
                {
                    "bare_tok_s": round(tokens / bare_s, 1),
                    "worker_tok_s": round(timed.tokens / worker_s, 1),
                    "bare_tokens": tokens,
                    "worker_tokens": timed.tokens,
                    "worker_groups": worker.submitter.groups_submitted,
                    "ratio": round((timed.tokens / worker_s) / (tokens / bare_s), 3),
                    # Robust to a noisy machine: the share of the worker's wall time the engine was sampling.
                    "engine_duty": round(timed.busy_s / worker_s, 3),
                    # CPU the co-located proxy + Redis + trainer stand-in took from this machine meanwhile
                    # (in a deployment they run elsewhere), as a share of one core.
                    "colocated_cpu_share": round(others_cpu / worker_s, 3),
                }
            )
            print(json.dumps(runs[-1]), file=sys.stderr)
        stop_flag.set()
        bare_tok_s = statistics.median(x["bare_tok_s"] for x in runs)
        worker_tok_s = statistics.median(x["worker_tok_s"] for x in runs)
        ratio = statistics.median(x["ratio"] for x in runs)
        duty = statistics.median(x["engine_duty"] for x in runs)
        result = {
            "config": {
                "engine": args.engine,
                "groups": args.groups,
                "repeats": args.repeats,
                "group_size": G,
                "prompts_per_request": args.prompts_per_request,
                "max_new_tokens": args.max_new_tokens,
                "reward_workers": args.reward_workers,
                "cpus": os.cpu_count(),
            },
            "runs": runs,
            "bare_tok_s": bare_tok_s,
            "worker_tok_s": worker_tok_s,
            "ratio": ratio,
            "engine_duty": duty,
            "target_met": ratio >= 0.9,
        }
        print(f"bare engine : {bare_tok_s:10.1f} tok/s (median of {args.repeats})")
        print(f"worker loop : {worker_tok_s:10.1f} tok/s (median of {args.repeats})")
        print(f"ratio       : {ratio:10.3f} (median of per-repeat ratios; target >= 0.90)")
        print(f"engine duty : {duty:10.3f} (share of the worker's wall time spent inside engine.generate)")
        print(json.dumps(result))
    finally:
        if consumer is not None:
            consumer.join(5)
            if consumer.is_alive():
                consumer.kill()
        if engine is not None:
            engine.close()
        for p in procs:
            stop(p)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
