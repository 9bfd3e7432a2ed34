"""The whole system across an emulated slow link: generators in other "clouds" than the proxy (issue 24).

    sudo .venv/bin/python bench/wan.py --rtt-ms 0,50,150 --generators 8 --duration-s 45 --json /tmp/wan.json
    sudo .venv/bin/python bench/wan.py --rtt-ms 100 --drop-s 10            # drop region a's link for 10 s
    sudo .venv/bin/python bench/wan.py --rtt-ms 80 --mode direct,relay     # with one `bucketrl relay` per region
    sudo .venv/bin/python bench/wan.py --rtt-ms 0,80 --mode relay --tls --generators 2 --adapter-mb 37 --ablation

Root only: it builds a :class:`bucketrl.sim.netlab.Lab`. The scale simulation's parts (:mod:`bucketrl.sim.cluster`,
all real but the GPU: ``redis-server``, ``bucketrl proxy``, moto S3 behind the slow S3 front, the real trainer
worker with a simulated learner publishing ``--adapter-mb`` adapters) run in the lab's ``home`` namespace; the
simulated generators (real HTTP protocol) run in region namespaces (``--regions``, the fleet split evenly, one
fleet process per region) and reach the proxy only through the lab's delay relay over ``tbf`` links of ``--mbit``.
``--trainer-region`` puts the trainer behind a link too (its claims, acks and uploads then cross it).

For each RTT in ``--rtt-ms`` (a new delay relay per point; the backends, the lab and its links are shared, each
point is its own run) it prints what :func:`bucketrl.sim.cluster.run_scale_sim` measures: weight sync publish ->
every generator loaded (p50/p99), long-poll wake-up p50 (a generator's answer minus the publisher's: one one-way
delay at least), trainer steps/s against the ideal and against the sweep's RTT-0 point ("loopback": same links,
no delay) when there is one, the stale-drop rate and whether the proxy's accounting is exact (nothing lost,
nothing trained twice); plus the bytes that crossed the links (the kernel's veth counters, both directions, all
regions) per adapter version that crossed, next to ``adapter bytes x loads per version``, and the proxy's requests
per trained group. ``--drop-s N`` black-holes ``--drop-region``'s link for N s, ``--drop-at-s`` after the fleet
starts, in every point: the groups line then says what the outage cost.

The adapter is ``--adapter-mb`` of float32 master weights, published through the trainer's real cast to
``--adapter-dtype`` (default bfloat16: half those bytes cross the links). For each version it reports where the sync
time went, from the start of the trainer's upload: the publish (upload + commit), the first and last byte at each
region's relay, the first and last generator loaded, the link floor for the bytes shipped; and the fleet processes'
CPU per loaded adapter and share of the machine (``versions``, ``breakdown_p50_s``, ``fleet_cpu_*``).

``--mode relay`` starts one ``bucketrl relay`` per region, inside the region's namespace on its address, whose
upstream is the home proxy through that region's link; the region's generators talk to it instead (adapters
cross the link once per version per region, the rest is forwarded). ``--staging on`` (the default) gives each
relay a ``relay`` token, so it pulls every upload while the trainer still sends it (staged publish; the clock still
starts at the trainer's upload); ``off`` fetches each version after its commit, when a generator first asks.
``--ablation`` runs issue 32's four variants in relay mode, float32 and bfloat16 each with staging off and on
(``ablation`` in the JSON: ``fp32_in_series``, ``staging_only``, ``dtype_only``, ``both``), each its own run.
``--direct-staging on`` (default off, so earlier direct figures stay comparable) makes the generators of
``--mode direct`` pull each upload from the home proxy before its commit with their own token, as the real generator
does by default (``BUCKETRL_STAGING``; ``direct_staging`` in the JSON).
``by_mode`` in the JSON holds each mode's figures at the sweep's largest RTT (the last variant's: bfloat16 staged
under ``--ablation``).

What the delay relay does not emulate (TCP's own RTT, the handshake's) is in :mod:`bucketrl.sim.netlab.delay`; quote it
with the figures. This machine's cores are shared by every process here (the relay forwards every byte in Python).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import httpx

from bucketrl.sim.backends import TOKENS
from bucketrl.sim.cluster import Scenario, SimBackends, SimScale, _publishes, run_scale_sim
from bucketrl.sim.gpu import BENCH_GPU
from bucketrl.sim.netlab import HOME, Lab, LinkSpec, Relay
from bucketrl.sim.pki import Pki, make_pki

RELAY_PORT = 8701

GPU = BENCH_GPU


@dataclass
class Wiring:
    """Where one point's processes run and how they reach the proxy; what the point saw of the links."""

    lab: Lab
    regions: list[str]  # the fleet's regions, fleet process i in regions[i % len]
    urls: dict[str, str]  # region -> the proxy's address through that region's delay relay
    trainer_region: str | None
    drop: tuple[str, float, float] | None  # (region, after s, for s)
    link_bytes_before: dict[str, dict[str, int]] = field(default_factory=dict)
    fleet_started: float | None = None
    dropped_at: float | None = None
    timers: list[threading.Timer] = field(default_factory=list)

    def region_of(self, service: str) -> str | None:
        if service.startswith("fleet-"):
            return self.regions[int(service.removeprefix("fleet-")) % len(self.regions)]
        if service == "trainer":
            return self.trainer_region
        return None

    def link_bytes(self) -> dict[str, dict[str, int]]:
        return {r: self.lab.link_bytes(r) for r in self.lab.links}

    def start_drop(self, region: str, seconds: float) -> None:
        self.dropped_at = time.time()
        self.lab.drop_for(region, seconds)


class WanScenario(Scenario):
    """The scale simulation's scenario with the fleet (and optionally the trainer) behind the lab's links."""

    wiring: ClassVar[Wiring]

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> Any:
        region = self.wiring.region_of(name)
        if region is not None:
            # `ip netns exec` execs the command in place: the Service's pid is the worker's, as without it.
            argv = [*self.wiring.lab.exec_prefix(region), *argv]
            env = {**env, "BUCKETRL_PROXY_URL": self.wiring.urls[region], **insecure_env(self.wiring.urls[region])}
        return super()._start(name, argv, env)

    def start_fleet(self) -> Any:
        w = self.wiring
        w.link_bytes_before = w.link_bytes()
        w.fleet_started = time.time()
        fleets = super().start_fleet()
        if w.drop is not None:
            region, after_s, for_s = w.drop
            t = threading.Timer(after_s, w.start_drop, args=(region, for_s))
            t.daemon = True
            t.start()
            w.timers.append(t)
        return fleets


def insecure_env(url: str) -> dict[str, str]:
    """Without ``--tls``, plain HTTP between the lab's namespaces (an emulated private network), so the workers'
    refusal of http:// off loopback is waived on purpose; with it, workers verify against the lab's CA."""
    return {} if url.startswith("https://") else {"BUCKETRL_INSECURE_HTTP": "1"}


def scenario_for(wiring: Wiring) -> type[Scenario]:
    # run_scale_sim builds the scenario itself (backends, cfg, run, workdir): the wiring rides on a subclass.
    return type("WanScenario", (WanScenario,), {"wiring": wiring})


_PUBLISHED_BYTES = re.compile(r"published v\d+ \(step \d+, (\d+) bytes\)")


def published_bytes(workdir: Path, default: int) -> int:
    """The adapter's size as published (the simulated learner rounds ``--adapter-mb`` down to whole layers)."""
    log = workdir / "logs" / "trainer.log"
    sizes = _PUBLISHED_BYTES.findall(log.read_text(errors="replace")) if log.exists() else []
    return int(sizes[-1]) if sizes else default


def link_figures(cfg: SimScale, workdir: Path, w: Wiring, after: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Bytes over the links per adapter version that crossed them (versions any generator loaded)."""
    adapter = published_bytes(workdir, cfg.adapter_bytes)
    loads: list[tuple[str, int, float]] = []
    retries = 0  # the fleet's requests that failed in transport (a dropped link's) and were sent again
    outages = 0  # its calls answered unavailable (the relay's 503 for a dead link...): retried or left to expire
    for i in range(cfg.processes):
        path = workdir / f"fleet-{i}.json"
        if path.exists():
            rep = json.loads(path.read_text())
            loads += [tuple(x) for x in rep["loads"]]
            retries += int(rep.get("transport_retries", 0))
            outages += len(rep.get("outages", []))
    versions = {v for _g, v, _t in loads}
    recovery = after_drop(w, loads, workdir, cfg.processes)
    delta = {r: {d: after[r][d] - w.link_bytes_before.get(r, {}).get(d, 0) for d in ("down", "up")} for r in after}
    total = sum(x["down"] + x["up"] for x in delta.values())
    n = max(len(versions), 1)
    loads_per_version = len(loads) / n
    return {
        "link_bytes": delta,
        "fleet_transport_retries": retries,
        "fleet_calls_unavailable": outages,
        "versions_crossed": len(versions),
        "loads_per_version": round(loads_per_version, 2),
        "wan_bytes_per_version": round(total / n) if versions else None,
        "wan_down_bytes_per_version_by_region": {r: round(x["down"] / n) for r, x in delta.items()},
        "adapter_bytes": adapter,
        "adapter_bytes_x_loads_per_version": round(adapter * loads_per_version),
        **recovery,
    }


def after_drop(w: Wiring, loads: list[tuple[str, int, float]], workdir: Path, processes: int) -> dict[str, Any]:
    """With a drop: each region's adapter loads once the link was back (its generators were fed again), and the
    groups each region's fleet had accepted."""
    if w.drop is None or w.dropped_at is None:
        return {}
    back = w.dropped_at + w.drop[2]
    region_of = {}
    groups: dict[str, int] = dict.fromkeys(w.regions, 0)
    for i in range(processes):
        region = w.regions[i % len(w.regions)]
        path = workdir / f"fleet-{i}.json"
        if path.exists():
            rep = json.loads(path.read_text())
            region_of.update({g: region for g, _v, _t in rep["loads"]})
            groups[region] += int(rep.get("groups_submitted", 0))
    after: dict[str, int] = dict.fromkeys(w.regions, 0)
    for g, _v, t in loads:
        if t >= back and g in region_of:
            after[region_of[g]] += 1
    steps = 0  # trainer steps logged once the link was back (its log's local-time stamps)
    log = workdir / "logs" / "trainer.log"
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        if _STEP.search(line):
            with contextlib.suppress(ValueError):
                steps += time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) >= back
    return {"loads_after_drop_by_region": after, "groups_submitted_by_region": groups, "steps_after_drop": steps}


_STEP = re.compile(r"step (\d+)/\d+ .* wait ([0-9.]+)s step")


def _fleet_reports(workdir: Path, processes: int) -> list[dict[str, Any]]:
    out = []
    for i in range(processes):
        path = workdir / f"fleet-{i}.json"
        if path.exists():
            out.append(json.loads(path.read_text()))
    return out


def _p50(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def version_breakdown(
    workdir: Path, processes: int, relays: dict[str, Any] | None, mbit: float, cpu: dict[str, float] | None
) -> dict[str, Any]:
    """Where each version's sync time went, from the first byte of the trainer's upload (its publish call): the
    publish (upload + commit, until the proxy answered), the first and last byte at each region's relay, the
    first and last generator that loaded it; the link floor for the bytes shipped; and the CPU the fleet
    processes spent (per loaded adapter, and as a share of the machine) so the links' share of the sync time can
    be told from the emulation's cores."""
    publishes = _publishes(workdir / "logs" / "trainer.log")
    reports = _fleet_reports(workdir, processes)
    loads = [tuple(x) for rep in reports for x in rep["loads"]]
    fetches = [tuple(x) for rep in reports for x in rep.get("fetches", [])]
    sha_of = {int(v): str(sha) for _w, v, sha, _n, _a, _b in fetches}
    size_of = {int(v): int(n) for _w, v, _sha, n, _a, _b in fetches}
    per: dict[str, dict[str, Any]] = {}
    for v, (called, answered) in sorted(publishes.items()):
        mine = [t for _g, lv, t in loads if lv == v]
        if not mine:
            continue
        row: dict[str, Any] = {
            "bytes": size_of.get(v),
            "publish_s": round(answered - called, 3),
            "first_loaded_s": round(min(mine) - called, 3),
            "last_loaded_s": round(max(mine) - called, 3),
            "loads": len(mine),
        }
        for region, stats in (relays or {}).items():
            for f in stats.get("recent_fetches", []):
                if f.get("sha256") == sha_of.get(v):
                    row[f"relay_{region}_first_byte_s"] = round(float(f["first_byte"]) - called, 3)
                    row[f"relay_{region}_last_byte_s"] = round(float(f["last_byte"]) - called, 3)
        if row["bytes"]:
            row["link_floor_s"] = round(row["bytes"] * 8 / (mbit * 1e6), 3)
        per[str(v)] = row
    keys = sorted({k for row in per.values() for k in row if k.endswith("_s")})
    out: dict[str, Any] = {
        "versions": per,
        "breakdown_p50_s": {k: _p50([row[k] for row in per.values() if k in row]) for k in keys},
    }
    fleet_cpu, wall = (cpu or {}).get("fleet"), (cpu or {}).get("wall_s")
    if fleet_cpu is not None and loads:
        # Upper bound: the fleet process also simulates sampling and submits, but its work is mostly the adapter
        # downloads (TLS, hashing, the tar check); per process = the same ratio, each process loading its share.
        out["fleet_cpu_s_per_loaded_adapter"] = round(fleet_cpu / len(loads), 3)
        out["fleet_cpu_s_per_process"] = round(fleet_cpu / max(len(reports), 1), 2)
    if fleet_cpu is not None and wall:
        out["fleet_cpu_share"] = round(fleet_cpu / (wall * (os.cpu_count() or 1)), 3)
        out["machine_cores"] = os.cpu_count()
    return out


def trainer_figures(workdir: Path, warmup_steps: int) -> dict[str, Any]:
    """From the trainer's log: how long its publish calls took (an upload across the link when the trainer is
    in a region) and how long each step waited for its claim to fill (``wait``; after the warm-up)."""
    log = workdir / "logs" / "trainer.log"
    publish = [answered - called for called, answered in _publishes(log).values()]
    waits: list[float] = []
    if log.exists():
        for line in log.read_text(errors="replace").splitlines():
            m = _STEP.search(line)
            if m and int(m.group(1)) > warmup_steps:
                waits.append(float(m.group(2)))
    return {
        "publish_p50_s": round(statistics.median(publish), 3) if publish else None,
        "step_wait_p50_s": round(statistics.median(waits), 3) if waits else None,
        "step_wait_total_s": round(sum(waits), 2),
    }


FIELDS = (
    "sync_p50_s",
    "sync_p99_s",
    "sync_versions",
    "sync_after_commit_p50_s",
    "load_p50_s",
    "wakeup_p50_ms",
    "steps_per_s",
    "ideal_steps_per_s",
    "steps",
    "stale_drop_rate",
    "accounting_ok",
    "groups",
    "non_2xx",
    "backpressure_waits",
    "requests",
    "timed_out",
    "cpu_s",
    "errors",
)


def start_region_relays(
    lab: Lab, urls: dict[str, str], workdir: Path, backends: SimBackends, staging: bool = False
) -> dict[str, subprocess.Popen]:
    """One ``bucketrl relay`` per region, in the region's namespace on its link address (so this process, in home,
    can see it listen); its upstream is the home proxy through the region's delay relay. Replaces ``urls``. With
    ``--tls`` it serves HTTPS with the lab's certificate and verifies the home proxy with the lab's CA."""
    procs: dict[str, subprocess.Popen] = {}
    tls = backends.tls
    for r, upstream in list(urls.items()):
        addr = lab.links[r].region_addr
        argv = [*lab.exec_prefix(r), sys.executable, "-m", "bucketrl.cli", "relay", "--upstream", upstream]
        argv += ["--cache-dir", str(workdir / f"relay-{r}"), "--host", addr, "--port", str(RELAY_PORT)]
        if tls:
            argv += ["--tls-cert-file", str(tls.cert), "--tls-key-file", str(tls.key)]
        env = {**os.environ, **backends.client_env, **insecure_env(upstream)}
        if staging:  # staged publish: the relay pulls each upload while the trainer still sends it
            env["BUCKETRL_RELAY_STAGING_TOKEN"] = TOKENS["relay"]
        workdir.mkdir(parents=True, exist_ok=True)
        with (workdir / f"relay-{r}.log").open("wb") as log:
            procs[r] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        urls[r] = f"{'https' if tls else 'http'}://{addr}:{RELAY_PORT}"
    for r, proc in procs.items():
        wait_port_at(lab.links[r].region_addr, RELAY_PORT, proc)
    return procs


def wait_port_at(host: str, port: int, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"relay exited with {proc.returncode} before listening on {host}:{port}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"relay not listening on {host}:{port} after {timeout_s}s")


def relay_stats(urls: dict[str, str], backends: SimBackends) -> dict[str, Any]:
    verify = ssl.create_default_context(cafile=str(backends.tls.ca)) if backends.tls else True
    return {r: httpx.get(f"{u}/relay/stats", timeout=10, verify=verify).json() for r, u in urls.items()}


def point(
    args: argparse.Namespace,
    lab: Lab,
    backends: SimBackends,
    rtt_ms: float,
    workdir: Path,
    say: Any,
    mode: str,
    variant: tuple[str, bool],
) -> dict[str, Any]:
    """One run; ``variant``: the adapter dtype shipped and whether the relays stage (``--staging``)."""
    dtype, staging = variant
    regions = args.regions
    relays: list[Relay] = []
    region_relays: dict[str, subprocess.Popen] = {}
    try:
        urls = {}
        for r in lab.links:
            link = lab.links[r]
            relay = lab.start_relay(HOME, (link.home_addr, 0), ("127.0.0.1", backends.proxy_port), rtt_ms / 2.0)
            relays.append(relay)
            urls[r] = f"{'https' if backends.tls else 'http'}://{relay.address}"
        if mode == "relay":
            relayed = {r: urls[r] for r in regions}
            region_relays = start_region_relays(lab, relayed, workdir, backends, staging)
            urls.update(relayed)
        drop = (args.drop_region, args.drop_at_s, args.drop_s) if args.drop_s else None
        wiring = Wiring(lab, regions, urls, args.trainer_region, drop)
        cfg = SimScale(
            generators=args.generators,
            steps=10_000,  # bounded by max_train_s
            warmup_steps=1,
            step_s=args.step_s,
            groups_per_step=args.groups_per_step or args.generators * args.prompts_per_request,
            prompts_per_request=args.prompts_per_request,
            adapter_bytes=int(args.adapter_mb * 1024 * 1024),
            fleet_processes=len(regions),
            adapter_dtype=dtype,
            staging=args.direct_staging == "on" and mode == "direct",
            gpu=dict(GPU),
            timeout_s=args.duration_s + 180,
            max_train_s=args.duration_s,
        )
        name = workdir.name  # the point's key: each point (and each ablation variant) is a run of its own
        try:
            r = run_scale_sim(backends, cfg, name, workdir, progress=say, scenario=scenario_for(wiring))
        finally:
            for t in wiring.timers:
                t.cancel()
            for region in lab.links:
                lab.restore(region)
        out: dict[str, Any] = {
            "mode": mode,
            "rtt_ms": rtt_ms,
            "adapter_dtype": dtype,
            "staging": staging and mode == "relay",
            "direct_staging": args.direct_staging == "on" and mode == "direct",
            **{k: r.get(k) for k in FIELDS},
        }
        if region_relays:
            out["relay_stats"] = relay_stats({x: urls[x] for x in region_relays}, backends)
        out.update(link_figures(cfg, workdir, wiring, wiring.link_bytes()))
        # One tar as shipped (in adapter_dtype) over one link at the set rate: no sync through it can beat that.
        out["link_floor_s"] = round(out["adapter_bytes"] * 8 / (args.mbit * 1e6), 3)
        out.update(version_breakdown(workdir, cfg.processes, out.get("relay_stats"), args.mbit, r.get("cpu_s")))
        out.update(trainer_figures(workdir, cfg.warmup_steps))
        trained = (r.get("groups") or {}).get("trained") or 0
        out["requests_per_trained_group"] = round(r["requests"] / trained, 2) if trained else None
        if r.get("steps_per_s") and r.get("ideal_steps_per_s"):
            out["steps_per_s_vs_ideal"] = round(r["steps_per_s"] / r["ideal_steps_per_s"], 3)
        if drop is not None and wiring.dropped_at is not None and wiring.fleet_started is not None:
            at_s = round(wiring.dropped_at - wiring.fleet_started, 1)
            out["drop"] = {"region": drop[0], "seconds": drop[2], "at_s": at_s}
        return out
    finally:
        for proc in region_relays.values():
            proc.kill()
            proc.wait(10)
        for relay in relays:
            relay.proc.kill()
            relay.proc.wait(10)


def runs(args: argparse.Namespace) -> list[tuple[str, tuple[str, bool], float]]:
    """(mode, (dtype, staging), rtt) of every point; staging varies in relay mode only (direct has no relays)."""
    out = []
    for mode in args.modes:
        stagings = args.stagings if mode == "relay" else [False]
        for dtype in args.dtypes:
            for staging in stagings:
                out += [(mode, (dtype, staging), rtt) for rtt in args.rtts]
    return out


def point_key(args: argparse.Namespace, mode: str, variant: tuple[str, bool], rtt: float) -> str:
    """``80`` (direct), ``relay:80``, and the variant's name after them when the run has several."""
    key = f"{rtt:g}" if mode == "direct" else f"{mode}:{rtt:g}"
    if len(args.dtypes) > 1:
        key += f":{variant[0]}"
    if mode == "relay" and len(args.stagings) > 1:
        key += ":staged" if variant[1] else ":in-series"
    return key


ABLATION = {
    ("float32", False): "fp32_in_series",
    ("bfloat16", False): "dtype_only",
    ("float32", True): "staging_only",
    ("bfloat16", True): "both",
}
ABLATION_KEYS = (
    "sync_p50_s",
    "sync_p99_s",
    "publish_p50_s",
    "sync_after_commit_p50_s",
    "link_floor_s",
    "steps_per_s_vs_loopback",
    "fleet_cpu_share",
)


def ablation(points: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Issue 32's ablation from relay-mode points at their largest RTT: each variant's sync figures by name."""
    relay = [p for p in points.values() if p.get("mode") == "relay" and p.get("rtt_ms", 0) > 0]
    out: dict[str, dict[str, Any]] = {}
    for p in sorted(relay, key=lambda p: p["rtt_ms"]):
        name = ABLATION.get((str(p.get("adapter_dtype")), bool(p.get("staging"))))
        if name is not None:
            figures = {k: p.get(k) for k in ABLATION_KEYS}
            figures["breakdown_p50_s"] = p.get("breakdown_p50_s")
            out[name] = {"rtt_ms": p["rtt_ms"], "wan_bytes_per_version": p.get("wan_bytes_per_version"), **figures}
    return out


def row(p: dict[str, Any]) -> str:
    def f(key: str, fmt: str, scale: float = 1.0) -> str:
        v = p.get(key)
        return "-" if v is None else format(v * scale, fmt)

    g = p.get("groups") or {}
    return (
        f"{p.get('mode', 'direct'):>6} {p['rtt_ms']:>6g} {f('sync_p50_s', '.2f'):>7} {f('sync_p99_s', '.2f'):>7} "
        f"{f('wakeup_p50_ms', '.0f'):>7} "
        f"{f('publish_p50_s', '.2f'):>6} {f('sync_after_commit_p50_s', '.2f'):>8} {f('link_floor_s', '.2f'):>6} "
        f"{f('step_wait_p50_s', '.2f'):>6} "
        f"{f('steps_per_s', '.3f'):>7} {f('steps_per_s_vs_ideal', '.0%'):>6} {f('steps_per_s_vs_loopback', '.0%'):>6} "
        f"{f('wan_bytes_per_version', '.1f', 1e-6):>8} {f('adapter_bytes_x_loads_per_version', '.1f', 1e-6):>8} "
        f"{f('requests_per_trained_group', '.2f'):>7} {f('stale_drop_rate', '.1%'):>6} "
        f"{g.get('trained', '-')!s:>7} {g.get('lost', '-')!s:>4} {p.get('accounting_ok')!s:>5}"
    )


HEADER = (
    "  mode rtt_ms  sync50  sync99  wake50  pub50 commit50  floor wait50 steps/s  ideal  loopb  MB/vers  adMBxN  "
    "req/grp  stale trained lost    ok"
)


def lab_pki(lab: Lab, where: Path) -> Pki:
    """A CA and one certificate for every address the proxy and the relays listen on in the lab."""
    addrs = [a for link in lab.links.values() for a in (link.home_addr, link.region_addr)]
    return make_pki(where, ips=("127.0.0.1", *addrs))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--rtt-ms", default="100", help="round trip of every link; a comma-separated list sweeps")
    p.add_argument("--mode", default="direct", help="direct, relay (one bucketrl relay per region), or both: a,b")
    p.add_argument("--mbit", type=float, default=200.0, help="each link's rate, per direction")
    p.add_argument("--regions", default="a,b", help="the generators' regions (the fleet is split evenly)")
    p.add_argument("--generators", type=int, default=8, help="simulated generators, over all regions")
    p.add_argument("--duration-s", type=float, default=45.0, help="training time per point (the trainer's cap)")
    p.add_argument("--step-s", type=float, default=4.0, help="seconds of one simulated trainer step")
    p.add_argument("--prompts-per-request", type=int, default=1)
    p.add_argument("--groups-per-step", type=int, default=0, help="default: one call of every generator")
    p.add_argument(
        "--adapter-mb", type=float, default=4.0, help="the adapter's float32 master weights (MiB), before the cast"
    )
    p.add_argument(
        "--adapter-dtype",
        default="bfloat16",
        help="the run spec's adapter_dtype: what crosses the links (bfloat16: half of --adapter-mb); a comma list "
        "runs each",
    )
    p.add_argument(
        "--staging",
        default="on",
        help="relay mode: the relays pull each upload before its commit (staged publish): on, off, or off,on",
    )
    p.add_argument(
        "--direct-staging",
        choices=("off", "on"),
        default="off",
        help="direct mode: the generators pull each upload from the home proxy before its commit (staged publish)",
    )
    p.add_argument(
        "--ablation",
        action="store_true",
        help="issue 32's ablation in relay mode: float32 in series, dtype only, staging only, both "
        "(--adapter-dtype float32,bfloat16 --staging off,on)",
    )
    p.add_argument("--trainer-region", default=None, help="run the trainer behind a link too (a region's name)")
    p.add_argument("--proxy-workers", type=int, default=1)
    p.add_argument("--s3-latency-ms", type=float, default=20.0)
    p.add_argument("--drop-s", type=float, default=0.0, help="black-hole a link this long in each point")
    p.add_argument("--drop-region", default=None, help="the link to drop (default: the first region)")
    p.add_argument("--drop-at-s", type=float, default=None, help="seconds after the fleet starts (default: 1/4)")
    p.add_argument("--tls", action="store_true", help="HTTPS everywhere: proxy and relays, verified with a lab CA")
    p.add_argument("--keep", action="store_true", help="keep the logs directory")
    args = p.parse_args(argv)
    args.rtts = [float(x) for x in args.rtt_ms.split(",") if x.strip()]
    args.modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    if not args.modes or set(args.modes) - {"direct", "relay"}:
        p.error(f"--mode: direct, relay or direct,relay; got {args.mode!r}")
    if args.ablation:
        args.adapter_dtype, args.staging = "float32,bfloat16", "off,on"
    args.dtypes = [d.strip() for d in args.adapter_dtype.split(",") if d.strip()]
    if not args.dtypes or set(args.dtypes) - {"float32", "bfloat16", "float16"}:
        p.error(f"--adapter-dtype: float32, bfloat16 or float16 (comma list); got {args.adapter_dtype!r}")
    stagings = [x.strip() for x in args.staging.split(",") if x.strip()]
    if not stagings or set(stagings) - {"on", "off"}:
        p.error(f"--staging: on, off or off,on; got {args.staging!r}")
    args.stagings = [x == "on" for x in stagings]
    args.regions = [r.strip() for r in args.regions.split(",") if r.strip()]
    args.drop_region = args.drop_region or args.regions[0]
    if args.drop_at_s is None:
        args.drop_at_s = args.duration_s / 4
    if args.drop_s and args.drop_at_s + args.drop_s + 2 * args.step_s > args.duration_s:
        p.error("the drop must end at least two steps before --duration-s (the fleet drains after the trainer stops)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("bench/wan.py needs root (network namespaces, tc, nft)", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    say = lambda msg: print(f"[{time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    work = Path(tempfile.mkdtemp(prefix="bucketrl-wan-"))
    link_regions = list(dict.fromkeys([*args.regions, *([args.trainer_region] if args.trainer_region else [])]))
    points: dict[str, dict[str, Any]] = {}
    # Every lab link gets the point's delay through its relay; the rate (tbf) is the lab's, set once. The
    # backends' sockets (and this process's Redis and S3 front clients) must be in home: it is entered before
    # anything is started, so every child inherits it.
    lab = Lab({r: LinkSpec(rtt_ms=0.0, mbit=args.mbit) for r in link_regions})
    with (
        lab,
        lab.entered(HOME),
        SimBackends(
            work / "backends",
            proxy_workers=args.proxy_workers,
            s3_latency_ms=args.s3_latency_ms,
            tls=lab_pki(lab, work / "pki") if args.tls else None,  # built once the lab has its addresses
        ) as b,
    ):
        say(f"lab {lab.home_ns}: regions {link_regions} at {args.mbit:g} Mbit; backends up in home")
        for mode, variant, rtt in runs(args):
            key = point_key(args, mode, variant, rtt)
            where = work / key.replace(":", "-")
            try:
                points[key] = point(args, lab, b, rtt, where, say, mode, variant)
            except Exception as exc:  # a point that fails is a result; the next one still runs
                say(f"{key} failed: {exc}")
                points[key] = {"mode": mode, "rtt_ms": rtt, "errors": [f"{type(exc).__name__}: {exc}"]}
                points[key].update(adapter_dtype=variant[0], staging=variant[1] and mode == "relay")
            say(f"{key}: {row(points[key])}" if "groups" in points[key] else f"{key}: no figures")
    for p in points.values():
        mode = p.get("mode", "direct")
        zero = point_key(args, mode, (p.get("adapter_dtype", args.dtypes[0]), bool(p.get("staging"))), 0.0)
        base = points.get(zero, points.get("0", {})).get("steps_per_s")
        if base and p.get("steps_per_s"):
            p["steps_per_s_vs_loopback"] = round(p["steps_per_s"] / base, 3)
    print(
        f"\nwan: {args.generators} generators over {args.regions}, {args.mbit:g} Mbit links, adapter "
        f"{args.adapter_mb:g} MiB in float32 shipped in {args.adapter_dtype}, staging {args.staging}, "
        f"step {args.step_s:g}s, "
        f"{args.duration_s:g}s per point, trainer in "
        f"{args.trainer_region or 'home'}{f', link {args.drop_region} dropped {args.drop_s:g}s' if args.drop_s else ''}"
        f" ({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})"
    )
    print(HEADER)
    for p in points.values():
        if "groups" in p:
            print(row(p))
        else:
            print(f"{p['rtt_ms']:>6g} failed: {p['errors']}")
    by_mode = {}
    last = (args.dtypes[-1], args.stagings[-1])  # the variant the mode is quoted at (--ablation: both changes)
    for mode in args.modes:
        mine = [p for p in points.values() if p.get("mode", "direct") == mode and p["rtt_ms"] > 0]
        mine = [p for p in mine if (p.get("adapter_dtype"), bool(p.get("staging"))) == last] or mine
        if mine:  # the issue's key shape: each mode's figures at the sweep's largest RTT
            by_mode[mode] = max(mine, key=lambda p: p["rtt_ms"])
    out = {
        "by_rtt_ms": points,
        "by_mode": by_mode,
        "ablation": ablation(points),
        "config": {**vars(args), "json": str(args.json), "gpu": GPU},
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print(f"total wall {out['wall_s']}s")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    if args.keep:
        print(f"logs: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all("groups" in p for p in points.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
