"""Spot preemption on a mixed fleet: work lost with notices honoured vs. plain SIGKILL vs. no preemption (issue 25).

    .venv/bin/python bench/preemption.py                                  # 4 generators, 60 s per mode
    .venv/bin/python bench/preemption.py --generators 6 --duration-s 90 --modes notice,kill

What it starts (and stops): a ``redis-server``, the proxy app on a thread of this process (``tests/proxy/harness.py``)
over a ``file://`` bucket, a trainer stand-in thread (claims ``groups_per_step`` groups with ``min_version`` =
latest - max_staleness, so stale groups are dropped and counted as the real trainer's claims do, "trains" for
``--step-s``, acks, publishes the next version) and ``--generators`` real generator processes (``bucketrl
generator``, ``BUCKETRL_ENGINE=sim``: the worker's own code, the GPU simulated) of mixed declared classes
(``BUCKETRL_GPU_CLASS``, ``BUCKETRL_USD_PER_HOUR``; the slower class decodes at a third of the speed).

Every ``--interval-s`` (the scaled-down "few minutes") a random 20 % of the fleet (at least one) is preempted and
replaced by a fresh process, as a spot fleet's autoscaler would. ``notice``: a drain with ``--notice-s`` (the
scaled-down 30 s; the worker hears of it by its drain long-poll), then SIGKILL if it is still alive when the notice
ends, as the cloud would; ``kill``: SIGKILL at once; ``none``: no preemption. At the end the generators are stopped
(SIGINT: they submit what they hold) and the trainer drains the queue.

Per mode it prints: tokens generated (what the simulated engines decoded, ``BUCKETRL_SIM_TOKENS_FILE``: a call cut
off by a kill or a notice counts its decoded part, accrued linearly over the call), tokens trained, the tokens lost
to preemption (generated, neither trained nor dropped stale; a stale group counted at the mean trained group's
tokens) as a fraction of those generated, stale drops (groups, at claim and at submit), groups lost or trained
twice (the proxy's counters: accepted = acked + dropped stale + queued; a prompt id trained twice; both must be 0),
trainer steps/s over the measured window and the run's cost per step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bucketrl import errors
from bucketrl.tasks.tiny_model import build_tiny_model
from bucketrl.wire import DatasetSpec, MetricsPush, RewardSpec, RunSpec, SamplingSpec
from tests.generator.helpers import run_spec
from tests.proxy.harness import TOKENS, ProxyHarness, adapter_tar, running
from tests.support.services import RedisServer

REPO = Path(__file__).resolve().parents[1]
RUN = "spot"
# (class, $/h: docs/cost.md's list prices, sim decode step s): the a10g decodes at a third of the h100's speed.
CLASSES = [("h100", 3.0, 0.015), ("a10g", 1.0, 0.045)]
GROUP, MAX_NEW, STALENESS = 4, 64, 2


@dataclass
class Stats:
    steps: int = 0
    trained_tokens: int = 0
    trained_prompts: list[str] = field(default_factory=list)
    trained_by_worker: dict[str, int] = field(default_factory=dict)  # tokens trained per generator (slow_class.py)
    step_times: list[float] = field(default_factory=list)


class Trainer(threading.Thread):
    """Claims a step's groups (stale ones dropped by the proxy), 'trains' ``step_s``, acks, publishes v+1."""

    def __init__(self, proxy: ProxyHarness, groups_per_step: int, step_s: float) -> None:
        super().__init__(daemon=True, name="trainer")
        self.client = proxy.client(RUN, "trainer", retries=3)
        self.client.register_trainer("trainer")
        self.client.publish_adapter(1, adapter_tar(1))
        self.groups_per_step, self.step_s = groups_per_step, step_s
        self.stats, self.stop, self.version = Stats(), threading.Event(), 1
        self.idle_since: float | None = None

    def run(self) -> None:
        while not self.stop.is_set():
            got, ids, by = [], [], []
            while len(got) < self.groups_per_step and not self.stop.is_set():
                want = self.groups_per_step - len(got)
                claim = self.client.claim("trainer", want, wait_s=0.5, min_version=max(1, self.version - STALENESS))
                self.idle_since = None if claim.deliveries else (self.idle_since or time.monotonic())
                for d in claim.deliveries:
                    got += d.groups
                    by += [d.worker_id] * len(d.groups)
                    ids.append(d.delivery_id)
            if not got:
                continue
            time.sleep(self.step_s)
            self.client.ack(ids)
            self.stats.trained_tokens += sum(len(c.token_ids) for g in got for c in g.completions)
            self.stats.trained_prompts += [g.prompt_id for g in got]
            for wid, g in zip(by, got, strict=True):
                n = sum(len(c.token_ids) for c in g.completions)
                self.stats.trained_by_worker[wid] = self.stats.trained_by_worker.get(wid, 0) + n
            self.version += 1
            self.client.publish_adapter(self.version, adapter_tar(self.version))
            self.stats.steps += 1
            # The trainer's step on its push: the run's cost per step (docs/cost.md).
            self.client.push_metrics(MetricsPush(worker_id="trainer", step=self.stats.steps, metrics={}))
            self.stats.step_times.append(time.monotonic())


class Fleet:
    """The generator processes, each with a unique worker id, and the stale refusals each reported."""

    def __init__(
        self,
        proxy: ProxyHarness,
        model_dir: Path,
        logs: Path,
        args: argparse.Namespace,
        classes: list[tuple[str, float, float]] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.proxy, self.model_dir, self.logs, self.args = proxy, model_dir, logs, args
        self.classes, self.env = classes or CLASSES, env or {}
        self.metrics: dict[str, dict[str, float]] = {}  # each generator's latest pushed metrics
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stale_at_submit: dict[str, float] = {}
        self.serial = 0

    def start(self, slot: int) -> None:
        cls, usd, step_s = self.classes[slot % len(self.classes)]
        self.serial += 1
        wid = f"{cls}-{slot}-{self.serial}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("BUCKETRL_")}
        env |= {
            "BUCKETRL_PROXY_URL": self.proxy.url,
            "BUCKETRL_TOKEN": TOKENS["generator"],
            "BUCKETRL_RUN": RUN,
            "BUCKETRL_WORKER_ID": wid,
            "BUCKETRL_ENGINE": "sim",
            "BUCKETRL_MODEL_PATH": str(self.model_dir),
            "BUCKETRL_GPU_CLASS": cls,
            "BUCKETRL_USD_PER_HOUR": str(usd),
            "BUCKETRL_SIM_DECODE_STEP_S": str(step_s),
            "BUCKETRL_SIM_TOKENS_FILE": str(self.logs / f"{wid}.tokens"),
            "BUCKETRL_PROMPTS_PER_REQUEST": "2",
            "BUCKETRL_REWARD_WORKERS": "1",
            "BUCKETRL_VERSION_WAIT_S": "5",
            "BUCKETRL_METRICS_INTERVAL_S": str(self.args.metrics_interval_s),
            "BUCKETRL_PROMPT_LEASE_TTL_S": str(self.args.prompt_lease_ttl_s),
            "PYTHONPATH": str(REPO),
        } | self.env
        with (self.logs / f"{wid}.log").open("wb") as log:
            self.procs[wid] = subprocess.Popen(
                [sys.executable, "-m", "bucketrl.cli", "generator"], env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def observe(self) -> None:
        try:
            status = self.proxy.client(RUN, "viewer").status()
        except errors.BucketRLError:
            return
        for wid, m in status.metrics.items():
            if isinstance(m, dict) and wid in self.procs:
                self.metrics[wid] = {k: float(v) for k, v in m.items() if isinstance(v, int | float)}
                stale = float(m.get("rollout/dropped_stale_total", 0.0))
                self.stale_at_submit[wid] = max(self.stale_at_submit.get(wid, 0.0), stale)

    def tokens_decoded(self) -> float:
        """What the simulated engines decoded (``BUCKETRL_SIM_TOKENS_FILE``), calls cut off included."""
        return sum(float(f.read_text() or 0) for f in self.logs.glob("*.tokens"))

    def alive(self) -> list[str]:
        return [w for w, p in self.procs.items() if p.poll() is None]

    def stop_all(self, timeout_s: float) -> None:
        for w in self.alive():
            self.procs[w].send_signal(signal.SIGINT)
        deadline = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < deadline:
            self.observe()
            time.sleep(0.5)
        for w in self.alive():
            self.procs[w].kill()
        self.observe()


def preempt(fleet: Fleet, mode: str, rng: random.Random, notice_s: float, pending: list[tuple[float, str]]) -> int:
    """Preempt a random 20 % (at least one) of the live fleet and start their replacements; returns how many."""
    alive = fleet.alive()
    victims = rng.sample(alive, max(1, round(0.2 * len(alive))))
    admin = fleet.proxy.client(RUN, "generator", retries=2)
    for wid in victims:
        slot = int(wid.split("-")[1])
        if mode == "kill":
            fleet.procs[wid].kill()
        else:
            try:
                admin.drain_worker(wid, notice_s)
            except errors.NotFound:  # not started far enough to have pushed a heartbeat: the cloud kills it
                fleet.procs[wid].kill()
            pending.append((time.monotonic() + notice_s, wid))  # SIGKILLed at the notice's end if still alive
        fleet.start(slot)
    return len(victims)


def scenario(mode: str, args: argparse.Namespace, model_dir: Path, tmp: Path) -> dict[str, Any]:
    server = RedisServer(tmp / f"redis-{mode}", persistent=False).start()
    logs = tmp / f"logs-{mode}"
    logs.mkdir()
    rng = random.Random(args.seed)
    try:
        with running(server.url, f"file://{tmp}/bucket-{mode}") as proxy:
            trainer, fleet = _setup(proxy, model_dir, logs, args)
            preempted = _drive(fleet, trainer, mode, rng, args)
            fleet.stop_all(timeout_s=30)
            _drain_queue(trainer)
            status = proxy.client(RUN, "viewer").status()
    finally:
        server.kill()
    return _figures(mode, args, fleet, trainer, status, preempted)


def sim_run_spec(model_dir: Path, groups_per_step: int) -> RunSpec:
    """The benches' run on the simulated engine (this one's and bench/slow_class.py's)."""
    return run_spec(
        model_dir,
        group_size=GROUP,
        max_staleness=STALENESS,
        groups_per_step=groups_per_step,
        queue_capacity_groups=4 * groups_per_step,
        sampling=SamplingSpec(temperature=1.0, max_new_tokens=MAX_NEW),
        reward=RewardSpec(name="exact"),
        dataset=DatasetSpec(uri="toy:digits", size=20_000),
    )


def _setup(proxy: ProxyHarness, model_dir: Path, logs: Path, args: argparse.Namespace) -> tuple[Trainer, Fleet]:
    proxy.client(RUN, "trainer").put_run(sim_run_spec(model_dir, args.groups_per_step))
    trainer = Trainer(proxy, args.groups_per_step, args.step_s)
    fleet = Fleet(proxy, model_dir, logs, args)
    for slot in range(args.generators):
        fleet.start(slot)
    trainer.start()
    return trainer, fleet


def _drive(fleet: Fleet, trainer: Trainer, mode: str, rng: random.Random, args: argparse.Namespace) -> int:
    """Warm up until the trainer steps, then ``duration_s`` with preemptions every ``interval_s``."""
    deadline = time.monotonic() + 120
    while trainer.stats.steps < 1 and time.monotonic() < deadline:
        fleet.observe()
        time.sleep(0.5)
    t0 = time.monotonic()
    trainer.stats.step_times.clear()
    next_at, pending, preempted = t0 + args.interval_s, [], 0
    while time.monotonic() < t0 + args.duration_s:
        fleet.observe()
        now = time.monotonic()
        for due, wid in [p for p in pending if p[0] <= now]:
            pending.remove((due, wid))
            if fleet.procs[wid].poll() is None:
                fleet.procs[wid].kill()
        if mode != "none" and now >= next_at:
            preempted += preempt(fleet, mode, rng, args.notice_s, pending)
            next_at = now + args.interval_s * rng.uniform(0.5, 1.5)
        time.sleep(0.25)
    trainer.window_s = time.monotonic() - t0  # type: ignore[attr-defined]
    trainer.window_steps = len(trainer.stats.step_times)  # type: ignore[attr-defined]
    return preempted


def _drain_queue(trainer: Trainer) -> None:
    """Let the trainer take what is queued (a partial last step too), then stop it."""
    trainer.groups_per_step = 1
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (trainer.idle_since and time.monotonic() - trainer.idle_since > 3):
        time.sleep(0.2)
    trainer.stop.set()
    trainer.join(15)


def _figures(
    mode: str, args: argparse.Namespace, fleet: Fleet, trainer: Trainer, status: Any, preempted: int
) -> dict[str, Any]:
    q, s = status.queue, trainer.stats
    generated = fleet.tokens_decoded()
    per_group = s.trained_tokens / max(1, len(s.trained_prompts))
    stale_groups = q.dropped_stale_total + int(sum(fleet.stale_at_submit.values()))
    lost = max(0.0, generated - s.trained_tokens - stale_groups * per_group)
    cost = status.cost
    return {
        "mode": mode,
        "generators": args.generators,
        "preempted": preempted,
        "tokens_generated": int(generated),
        "tokens_trained": s.trained_tokens,
        "tokens_lost_to_preemption": int(lost),
        "lost_fraction": round(lost / generated, 4) if generated else None,
        "stale_groups": stale_groups,
        "groups_lost": q.accepted_total - (q.acked_total + q.dropped_stale_total + q.groups + q.pending),
        "groups_trained_twice": len(s.trained_prompts) - len(set(s.trained_prompts)),
        "steps_per_s": round(trainer.window_steps / trainer.window_s, 3),  # type: ignore[attr-defined]
        "usd_per_step": None if cost is None or cost.usd_per_step is None else round(cost.usd_per_step, 5),
        "waste_fraction": None if cost is None else round(cost.waste_fraction, 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--generators", type=int, default=4)
    p.add_argument("--duration-s", type=float, default=60.0, help="measured window per mode (after the warm-up)")
    p.add_argument("--interval-s", type=float, default=10.0, help="mean time between preemptions (scaled minutes)")
    p.add_argument("--notice-s", type=float, default=6.0, help="the drain's notice (the scaled-down 30 s)")
    p.add_argument("--modes", default="none,notice,kill")
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--step-s", type=float, default=0.5, help="the stand-in trainer's time per step")
    p.add_argument("--metrics-interval-s", type=float, default=0.5)
    p.add_argument("--prompt-lease-ttl-s", type=float, default=15.0, help="how long a killed worker's prompts wait")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bucketrl-preempt-"))
    model_dir = build_tiny_model(tmp / "model")
    results = []
    for mode in args.modes.split(","):
        r = scenario(mode, args, model_dir, tmp)
        print(json.dumps(r), flush=True)
        results.append(r)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
