"""One simulated deployment on this machine, run and measured: ``run_scale_sim(SimScale(...), workdir)``.

Real parts: ``redis-server`` (AOF on, as in production), ``bucketrl proxy --workers W`` (W processes behind
one port), a moto S3 server behind :mod:`bucketrl.sim.s3front` (per-request latency, request counts by
billing class), the real trainer worker with a simulated learner (:mod:`bucketrl.sim.trainer`), and N
simulated generators speaking the real protocol as asyncio workers over a few processes
(:mod:`bucketrl.sim.fleet`). Only the GPU is simulated (:mod:`bucketrl.sim.gpu`).

The trainer runs ``steps`` steps and exits; then the fleet is stopped (SIGTERM: in-flight batches are
submitted, held prompts released) and everything is measured:

- ``steps_per_s`` over the steps after ``warmup_steps`` (from the trainer's audit log), against
  ``ideal_steps_per_s`` = 1 / ``step_s`` (a trainer that never waits for rollouts);
- weight sync, per version published after the warm-up: from the trainer's publish call (its log line
  ``published vN ... in Ss``, minus S) until every generator that was serving before it had loaded it or a
  newer one (``sync_p50_s``/``sync_p99_s``); long-poll wake-up: a waiting generator's answer minus the
  publisher's answer (``wakeup_p50_ms``; both wall clocks of this machine);
- per step over the same window: Redis commands (``INFO stats``), bucket requests by class (the front's
  counts) and their price; proxy CPU (user+system of its processes, from ``/proc``) per accepted group;
  proxy CPU per request over the whole run (requests counted by the clients);
- groups: generated (by the engines), accepted, trained (acked), dropped as stale at claim, refused as
  stale at submit, released; ``stale_drop_rate`` = (dropped + refused as stale) / generated;
- ``accounting_ok``: the proxy's ``accepted == acked + dropped + lost + in the stream`` and the fleet's
  accepted count equals the proxy's, with nothing lost.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bucketrl.proxy import keys
from bucketrl.sim.backends import TOKENS, SimBackends, cpu_seconds
from bucketrl.sim.s3front import CLASSES, cost_usd
from bucketrl.up.processes import Service, wait_until
from bucketrl.up.synclatency import PUBLISHED, _ts

RUN = "sim"


@dataclass
class SimScale:
    """One scenario. Times are wall seconds on this machine; the GPU model is ``gpu`` (``BUCKETRL_SIM_*``)."""

    generators: int
    steps: int = 8
    warmup_steps: int = 2
    step_s: float = 4.0
    groups_per_step: int | None = None  # default: one group per generator
    max_staleness: int = 4
    group_size: int = 8
    prompts_per_request: int = 4
    prompt_tokens: int = 128
    max_new_tokens: int = 1024
    vocab_size: int = 32_000
    adapter_bytes: int = 1024 * 1024  # the float32 master weights; shipped as adapter_dtype says
    adapter_dtype: str = "float32"  # the run spec's (float32: every version is adapter_bytes, as before the field)
    staging: bool = False  # the fleet pulls each upload before its commit (BUCKETRL_STAGING; fleet.py)
    sync_every: int = 1
    checkpoint_every: int = 10
    fleet_processes: int | None = None  # default: one per 64 generators, at most 4
    gpu: dict[str, float] = field(default_factory=dict)  # SimGpu fields overriding its defaults
    timeout_s: float = 600.0
    # Stop the trainer (SIGTERM: it finishes its step, checkpoints, acks, exits 0) this long after the fleet
    # started, even if it has not reached ``steps``: bounds a scenario's wall time on a busy machine.
    max_train_s: float | None = None
    seed: int = 0

    @property
    def step_groups(self) -> int:
        return self.groups_per_step or self.generators

    @property
    def processes(self) -> int:
        return self.fleet_processes or max(1, min(4, math.ceil(self.generators / 64)))


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Scenario:
    """One run on the shared backends: the simulated trainer and the fleet processes."""

    def __init__(self, backends: SimBackends, cfg: SimScale, run: str, workdir: Path) -> None:
        self.b, self.cfg, self.run, self.dir = backends, cfg, run, workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.services: list[Service] = []

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> Service:
        svc = Service(name, argv, self.dir / "logs" / f"{name}.log", env=env).start()
        self.services.append(svc)
        return svc

    def run_spec(self) -> dict[str, Any]:
        c = self.cfg
        return {
            "base_model": "sim/no-model",
            "lora": {"r": 16},
            "adapter_dtype": c.adapter_dtype,
            "group_size": c.group_size,
            "max_staleness": c.max_staleness,
            "sampling": {"max_new_tokens": c.max_new_tokens},
            "reward": {"name": "toy"},
            "dataset": {"uri": "toy:sim", "size": 10_000_000},
            "vocab_size": c.vocab_size,
            "queue_capacity_groups": max(4 * c.step_groups, 256),
            "groups_per_step": c.step_groups,
        }

    def worker_env(self, role: str) -> dict[str, str]:
        env = {"BUCKETRL_PROXY_URL": self.b.proxy_url, "BUCKETRL_TOKEN": TOKENS[role], "BUCKETRL_RUN": self.run}
        env.update(self.b.client_env)
        env.update({f"BUCKETRL_SIM_{k.upper()}": str(v) for k, v in self.cfg.gpu.items()})
        return env

    def start_trainer(self) -> Service:
        c = self.cfg
        env = {
            **self.worker_env("trainer"),
            "BUCKETRL_WORKER_ID": "sim-trainer",
            "BUCKETRL_RUN_SPEC": json.dumps(self.run_spec()),
            "BUCKETRL_MAX_STEPS": str(c.steps),
            "BUCKETRL_SYNC_EVERY": str(c.sync_every),
            "BUCKETRL_CHECKPOINT_EVERY": str(c.checkpoint_every),
            "BUCKETRL_AUDIT_LOG": str(self.dir / "trainer-audit.jsonl"),
            "BUCKETRL_SIM_STEP_S": str(c.step_s),
            "BUCKETRL_SIM_ADAPTER_BYTES": str(c.adapter_bytes),
            "BUCKETRL_WORK_DIR": str(self.dir / "trainer-work"),
        }
        argv = [sys.executable, "-m", "bucketrl.sim.trainer", "--report", str(self.dir / "trainer-report.json")]
        self.trainer = self._start("trainer", argv, env)
        return self.trainer

    def start_fleet(self) -> list[Service]:
        c = self.cfg
        per = [c.generators // c.processes + (1 if i < c.generators % c.processes else 0) for i in range(c.processes)]
        self.fleets = []
        first = 0
        for i, count in enumerate(per):
            argv = [sys.executable, "-m", "bucketrl.sim.fleet", "--count", str(count), "--first", str(first)]
            argv += ["--prompts-per-request", str(c.prompts_per_request), "--prompt-tokens", str(c.prompt_tokens)]
            argv += ["--seed", str(c.seed), "--report", str(self.dir / f"fleet-{i}.json")]
            env = self.worker_env("generator") | ({"BUCKETRL_STAGING": "1"} if c.staging else {})
            self.fleets.append(self._start(f"fleet-{i}", argv, env))
            first += count
        return self.fleets

    def stop_all(self) -> None:
        for svc in reversed(self.services):
            svc.stop(timeout_s=20)


def _audit_steps(path: Path) -> tuple[float | None, dict[int, float]]:
    """(start time, step -> time) from the trainer's audit log."""
    start, steps = None, {}
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if rec.get("event") == "start" and start is None:
                    start = float(rec["t"])
                elif rec.get("event") == "step":
                    steps[int(rec["step"])] = float(rec["t"])
    return start, steps


def _publishes(log: Path) -> dict[int, tuple[float, float]]:
    """version -> (publish call started, publish answered) from the trainer's log."""
    out = {}
    with contextlib.suppress(FileNotFoundError):
        for line in log.read_text(errors="replace").splitlines():
            m = PUBLISHED.search(line)
            if m:
                end = _ts(m.group(1))
                out[int(m.group(2))] = (end - float(m.group(3)), end)
    return out


def run_scale_sim(
    backends: SimBackends,
    cfg: SimScale,
    run: str,
    workdir: Path,
    progress: Any = None,
    scenario: type[Scenario] | None = None,
) -> dict[str, Any]:
    """Run one scenario as run ``run`` on started backends and return its figures (see the module docstring).

    ``scenario``: a :class:`Scenario` subclass that starts the processes differently (``bench/wan.py`` puts the
    fleet in network namespaces behind slow links); the measuring is the same."""
    import redis as redis_lib

    say = progress or (lambda _msg: None)
    sc = (scenario or Scenario)(backends, cfg, run, workdir)
    r = redis_lib.Redis(port=backends.redis_port)
    counters_key = keys.run_key(run, keys.COUNTERS)

    def snapshot() -> dict[str, Any]:
        counters = {k.decode() if isinstance(k, bytes) else k: int(v) for k, v in r.hgetall(counters_key).items()}
        return {
            "t": time.time(),
            "redis_commands": int(r.info("stats")["total_commands_processed"]),
            "s3": backends.s3_counts(),
            "proxy_cpu": backends.proxy_cpu_s(),
            "accepted": counters.get("accepted_total", 0),
        }

    t_begin = time.monotonic()
    try:
        trainer = sc.start_trainer()
        audit = workdir / "trainer-audit.jsonl"
        wait_until(lambda: _audit_steps(audit)[0] is not None, 180, "the simulated trainer to start", trainer)
        cpu_run0 = backends.proxy_cpu_s()
        fleets = sc.start_fleet()
        others = {"redis": backends.redis, "moto": backends.moto, "s3front": backends.front}
        cpu0 = {k: cpu_seconds(v.pid or 0) for k, v in others.items()}
        say(f"{run}: N={cfg.generators}, {len(fleets)} fleet processes, {cfg.steps} steps of {cfg.step_s}s")
        started = time.monotonic()
        first, timed_out = _watch(trainer, fleets, cfg, run, audit, say, snapshot)
        last = snapshot()
        cpu_run1 = backends.proxy_cpu_s()
        # Where this machine's CPU went over the run (fleet start -> trainer exit): what limits it at large N.
        cpu_by = {k: round(cpu_seconds(v.pid or 0) - cpu0[k], 1) for k, v in others.items()}
        cpu_by["fleet"] = round(sum(cpu_seconds(f.pid or 0) for f in fleets), 1)
        cpu_by["proxy"] = round(cpu_run1 - cpu_run0, 1)
        cpu_by["wall_s"] = round(time.monotonic() - started, 1)
        for f in fleets:
            f.signal(signal.SIGTERM)
        for f in fleets:
            if f.wait(90) is None:
                f.kill()
        counters = {k.decode() if isinstance(k, bytes) else k: int(v) for k, v in r.hgetall(counters_key).items()}
        in_stream = int(r.xlen(keys.run_key(run, keys.QUEUE_STREAM)))
        trainer_rc = trainer.returncode
        if trainer_rc is None:  # stopped but not exited: its in-flight work is lost, so say it
            trainer.stop(30)
            trainer_rc = trainer.returncode
    finally:
        sc.stop_all()
        r.close()
    fleet_reports = []
    for i in range(cfg.processes):
        path = workdir / f"fleet-{i}.json"
        fleet_reports.append(json.loads(path.read_text()) if path.exists() else None)
    report = workdir / "trainer-report.json"
    trainer_report = json.loads(report.read_text()) if report.exists() else {"requests": {}}
    cpu_by["trainer"] = round(float(trainer_report.get("cpu_s", 0.0)), 1)  # its whole life, start-up included
    return summarize(
        cfg,
        fleet_reports=fleet_reports,
        trainer_report=trainer_report,
        trainer_rc=trainer_rc,
        audit=_audit_steps(audit),
        publishes=_publishes(trainer.log_path),
        first=first,
        last=last,
        counters=counters,
        in_stream=in_stream,
        proxy_cpu_run_s=cpu_run1 - cpu_run0,
        wall_s=time.monotonic() - t_begin,
        timed_out=timed_out,
        cpu_s=cpu_by,
    )


def _watch(
    trainer: Service,
    fleets: list[Service],
    cfg: SimScale,
    run: str,
    audit: Path,
    say: Callable[[str], None],
    snapshot: Callable[[], dict[str, Any]],
) -> tuple[dict[str, Any] | None, bool]:
    """Wait for the trainer to exit: the snapshot after the warm-up steps, and whether it was stopped for taking
    too long. Stops it after ``max_train_s``; raises if a fleet process dies first."""
    deadline = time.monotonic() + cfg.timeout_s
    first: dict[str, Any] | None = None
    started = time.monotonic()
    capped = timed_out = False
    while trainer.alive:
        if cfg.max_train_s is not None and not capped and time.monotonic() - started > cfg.max_train_s:
            say(f"{run}: {cfg.max_train_s:.0f}s of training reached: stopping the trainer")
            trainer.signal(signal.SIGTERM)
            capped = True
        _, steps = _audit_steps(audit)
        if first is None and len(steps) >= cfg.warmup_steps:
            first = snapshot()
        dead = [f for f in fleets if not f.alive]
        if dead:
            raise RuntimeError(f"{[f.name for f in dead]} exited early:\n" + "\n".join(f.log_tail() for f in dead))
        if time.monotonic() > deadline and not timed_out:
            # A stalled pipeline is a result too (e.g. admission control never filling a step): stop the
            # trainer cleanly and report what was trained, flagged.
            say(f"{run}: the trainer did not finish {cfg.steps} steps in {cfg.timeout_s:.0f}s: stopping it")
            trainer.signal(signal.SIGTERM)
            timed_out = True
        time.sleep(0.1)
    return first, timed_out


def summarize(
    cfg: SimScale,
    *,
    fleet_reports: list[dict[str, Any] | None],
    trainer_report: dict[str, Any],
    trainer_rc: int | None,
    audit: tuple[float | None, dict[int, float]],
    publishes: dict[int, tuple[float, float]],
    first: dict[str, Any] | None,
    last: dict[str, Any],
    counters: dict[str, int],
    in_stream: int,
    proxy_cpu_run_s: float,
    wall_s: float,
    timed_out: bool = False,
    cpu_s: dict[str, float] | None = None,
) -> dict[str, Any]:
    errors: list[str] = []
    if trainer_rc != 0:
        errors.append(f"trainer exited with {trainer_rc}")
    fleet, requests, loads, wakes, statuses = _fleet_totals(fleet_reports, errors)
    requests += sum(trainer_report["requests"].values())

    start, steps = audit
    k0, k1 = cfg.warmup_steps, max(steps) if steps else 0
    window_steps = k1 - k0
    steps_per_s = window_steps / (steps[k1] - steps[k0]) if window_steps > 0 and k0 in steps else None

    # weight sync: versions published after the warm-up step, before the last step
    t0 = steps.get(k0, math.inf)
    t1 = steps.get(k1, -math.inf)
    sync, committed, each, wake, by_gen = _sync_latencies(loads, wakes, publishes, t0, t1)

    out: dict[str, Any] = {"config": asdict(cfg)}
    if first is not None:
        n = max(window_steps, 1)
        groups = max(last["accepted"] - first["accepted"], 1)
        s3 = {c: (last["s3"].get(c, 0) - first["s3"].get(c, 0)) / n for c in CLASSES}
        out.update(
            redis_commands_per_step=round((last["redis_commands"] - first["redis_commands"]) / n, 1),
            bucket_requests_per_step={c: round(v, 2) for c, v in s3.items()},
            bucket_cost_per_1000_steps_usd=round(cost_usd(s3) * 1000, 4),
            proxy_cpu_ms_per_group=round(1000 * (last["proxy_cpu"] - first["proxy_cpu"]) / groups, 3),
        )
    generated = fleet["groups_generated"]
    stale = counters.get("dropped_stale_total", 0) + counters.get("rejected_stale_total", 0)
    accepted = counters.get("accepted_total", 0)
    settled = counters.get("acked_total", 0) + counters.get("dropped_stale_total", 0) + counters.get("lost_total", 0)
    out.update(
        generators=cfg.generators,
        steps=k1,
        timed_out=timed_out,
        cpu_s=cpu_s or {},
        wall_s=round(wall_s, 1),
        train_wall_s=round(steps[k1] - start, 2) if start is not None and k1 else None,
        steps_per_s=round(steps_per_s, 4) if steps_per_s else None,
        ideal_steps_per_s=round(1.0 / cfg.step_s, 4) if cfg.step_s else None,
        sync_p50_s=_r(statistics.median(sync) if sync else None),
        sync_p99_s=_r(pct(sync, 0.99)),
        sync_versions=len(sync),
        # the same, from the publish's answer (the version committed) rather than its call: the fan-out alone
        sync_after_commit_p50_s=_r(statistics.median(committed) if committed else None),
        load_p50_s=_r(statistics.median(each) if each else None),
        # the fewest distinct versions any generator loaded (every one of them followed the trainer if >= 2)
        min_versions_loaded=min((len({v for v, _ in vs}) for vs in by_gen.values()), default=0),
        generators_seen=len(by_gen),
        wakeup_p50_ms=_r(statistics.median(wake) if wake else None, 2),
        proxy_cpu_ms_per_request=round(1000 * proxy_cpu_run_s / max(requests, 1), 3),
        requests=requests,
        requests_per_step=round(requests / max(k1, 1), 1),
        groups={
            "generated": generated,
            "accepted": accepted,
            "trained": counters.get("acked_total", 0),
            "dropped_stale_at_claim": counters.get("dropped_stale_total", 0),
            "refused_stale_at_submit": counters.get("rejected_stale_total", 0),
            "lost": counters.get("lost_total", 0),
            "in_queue_at_end": in_stream,
            "released": fleet["groups_released"],
            "fleet_accepted": fleet["groups_submitted"],
        },
        stale_drop_rate=round(stale / generated, 4) if generated else None,
        backpressure_waits=fleet["backpressure_waits"],
        non_2xx=statuses,
        accounting_ok=accepted == settled + in_stream
        and fleet["groups_submitted"] == accepted
        and counters.get("lost_total", 0) == 0,
        errors=errors,
    )
    return out


def _fleet_totals(
    fleet_reports: list[dict[str, Any] | None], errors: list[str]
) -> tuple[dict[str, int], int, list[tuple[str, int, float]], list[tuple[str, int, float, float]], dict[str, int]]:
    """The fleet processes' reports summed: counts, requests, adapter loads, long-poll wake-ups, statuses (a
    missing report and each report's errors are appended to ``errors``)."""
    fleet = {
        k: 0
        for k in (
            "groups_generated",
            "groups_submitted",
            "groups_duplicate",
            "groups_stale",
            "groups_rejected",
            "groups_released",
            "prompts_leased",
            "backpressure_waits",
        )
    }
    requests = 0
    loads: list[tuple[str, int, float]] = []
    wakes: list[tuple[str, int, float, float]] = []
    statuses: dict[str, int] = {}
    for i, rep in enumerate(fleet_reports):
        if rep is None:
            errors.append(f"fleet process {i} wrote no report")
            continue
        for k in fleet:
            fleet[k] += int(rep[k])
        requests += sum(rep["requests"].values())
        loads += [tuple(x) for x in rep["loads"]]
        wakes += [tuple(x) for x in rep["wakes"]]
        errors += rep["errors"]
        for k, v in rep["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
    return fleet, requests, loads, wakes, statuses


def _sync_latencies(
    loads: list[tuple[str, int, float]],
    wakes: list[tuple[str, int, float, float]],
    publishes: dict[int, tuple[float, float]],
    t0: float,
    t1: float,
) -> tuple[list[float], list[float], list[float], list[float], dict[str, list[tuple[int, float]]]]:
    """Weight sync over the versions published in [t0, t1]: publish -> every serving generator loaded it, the
    same from the publish's answer, publish -> each one loaded it, the long-polls' wake-up after the publish
    (ms), and each generator's loads."""
    first_load: dict[str, float] = {}
    by_gen: dict[str, list[tuple[int, float]]] = {}
    for gen, version, t in loads:
        first_load[gen] = min(first_load.get(gen, math.inf), t)
        by_gen.setdefault(gen, []).append((version, t))
    sync: list[float] = []
    committed: list[float] = []
    each: list[float] = []  # publish -> one generator loaded, over (generator, version)
    for version, (called, answered) in sorted(publishes.items()):
        if not (t0 <= called <= t1):
            continue
        serving = [g for g, t in first_load.items() if t < called]
        done = [min((t for v, t in by_gen[g] if v >= version), default=math.inf) for g in serving]
        each += [d - called for d in done if math.isfinite(d)]
        if serving and all(math.isfinite(d) for d in done):
            sync.append(max(done) - called)
            committed.append(max(done) - answered)
    wake = [
        (answered - publishes[v][1]) * 1000
        for _g, v, asked, answered in wakes
        if v in publishes and asked < publishes[v][0] and t0 <= publishes[v][0] <= t1
    ]
    return sync, committed, each, wake, by_gen


def _r(v: float | None, digits: int = 3) -> float | None:
    return None if v is None else round(v, digits)
