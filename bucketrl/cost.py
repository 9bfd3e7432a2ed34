"""The live cost of a run from what was measured and the prices (a pure function; docs/cost.md defines it).

The proxy accrues the measured part (worker seconds by role and GPU class, the dollars of workers that declared
their own price, idle generator seconds, trained tokens) and hands the totals here with the run's group counters.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from bucketrl.wire.cost import ClassUsage, Prices, RunCost

PRICES_ENV = "BUCKETRL_PRICES"
# Tokens of an accelerator's name (nvidia-smi) that name a priced class, most specific first.
_KNOWN = ("h200", "h100", "a100", "l40s", "a10g", "l4", "t4")


@dataclass(frozen=True)
class ClassTotals:
    """Accrued over the run for one (role, GPU class): seconds up, of which idle (generators), the dollars of the
    seconds whose worker declared its hourly price, and the seconds priced from the table instead."""

    role: str
    gpu_class: str
    worker_s: float = 0.0
    idle_s: float = 0.0
    declared_usd: float = 0.0
    undeclared_s: float = 0.0
    # The live workers of the class: how many, their up time and what they produced (throughput per worker).
    workers_live: int = 0
    live_up_s: float = 0.0
    live_tokens: float = 0.0
    live_groups: float = 0.0


@dataclass(frozen=True)
class RunTotals:
    trainer_steps: int = 0
    trained_tokens: float = 0.0
    accepted_groups: int = 0
    # Groups produced but never trained: dropped stale at claim, refused stale at submit, lost from the bucket.
    wasted_groups: int = 0
    # Groups generators finished: accepted ones plus those refused at submit.
    produced_groups: int = 0
    bucket_requests: int = 0
    bucket_reads: int = 0
    egress_bytes: float = 0.0
    bucket_egress_bytes: float = 0.0


def _per(usd: float, n: float) -> float | None:
    return usd / n if n > 0 else None


def class_usage(prices: Prices, c: ClassTotals) -> ClassUsage:
    usd = c.declared_usd + c.undeclared_s / 3600.0 * prices.gpu_price(c.gpu_class)
    return ClassUsage(
        gpu_class=c.gpu_class,
        role=c.role,
        workers_live=c.workers_live,
        worker_s=c.worker_s,
        idle_s=c.idle_s,
        usd=usd,
        tokens_per_s=c.live_tokens / c.live_up_s if c.live_up_s > 0 else None,
        groups_per_s=c.live_groups / c.live_up_s if c.live_up_s > 0 else None,
    )


def compute(prices: Prices, classes: list[ClassTotals], run: RunTotals) -> RunCost:
    """The run's cost. Waste: the generators' idle seconds (at their class's mean price) plus, of their busy
    dollars, the share of produced groups that were never trained."""
    usage = [class_usage(prices, c) for c in sorted(classes, key=lambda c: (c.role, c.gpu_class))]
    usd_gpu = sum(u.usd for u in usage)
    usd_requests = (
        run.bucket_requests / 1000.0 * prices.usd_per_1k_requests + run.bucket_reads / 1000.0 * prices.usd_per_1k_reads
    )
    egress_gb, bucket_egress_gb = run.egress_bytes / 1e9, run.bucket_egress_bytes / 1e9
    usd_egress = egress_gb * prices.usd_per_gb_egress + bucket_egress_gb * prices.usd_per_gb_bucket_egress
    total = usd_gpu + usd_requests + usd_egress
    gen = [u for u in usage if u.role == "generator"]
    idle_usd = sum(u.usd * min(u.idle_s / u.worker_s, 1.0) for u in gen if u.worker_s > 0)
    busy_usd = sum(u.usd for u in gen) - idle_usd
    wasted_share = min(run.wasted_groups / run.produced_groups, 1.0) if run.produced_groups > 0 else 0.0
    waste = idle_usd + busy_usd * wasted_share
    return RunCost(
        usd_total=total,
        usd_gpu=usd_gpu,
        usd_requests=usd_requests,
        usd_egress=usd_egress,
        usd_per_step=_per(total, run.trainer_steps),
        usd_per_trained_token=_per(total, run.trained_tokens),
        usd_per_accepted_group=_per(total, run.accepted_groups),
        waste_usd=waste,
        waste_fraction=waste / total if total > 0 else 0.0,
        trainer_steps=run.trainer_steps,
        trained_tokens=run.trained_tokens,
        accepted_groups=run.accepted_groups,
        wasted_groups=run.wasted_groups,
        bucket_requests=run.bucket_requests,
        bucket_reads=run.bucket_reads,
        egress_gb=egress_gb,
        bucket_egress_gb=bucket_egress_gb,
        classes=usage,
        prices=prices,
    )


def load_prices(raw: str | None = None) -> Prices:
    """Prices from ``BUCKETRL_PRICES`` (or ``raw``): JSON, or ``@path`` of a JSON file; unset: the defaults.
    Raises ``ValueError`` (pydantic's ``ValidationError`` is one) naming the bad price."""
    text = os.environ.get(PRICES_ENV, "") if raw is None else raw
    text = text.strip()
    if not text:
        return Prices()
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            raise ValueError(f"{PRICES_ENV}: cannot read {text[1:]!r} ({exc.strerror})") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{PRICES_ENV}: not JSON ({exc})") from exc
    return Prices.model_validate(data)


def gpu_class_of(device_name: str) -> str:
    """The class of a device name as nvidia-smi prints it ("NVIDIA H100 80GB HBM3" -> "h100")."""
    words = re.split(r"[^a-z0-9]+", device_name.lower())
    for known in _KNOWN:
        if known in words:
            return known
    name = "-".join(w for w in words if w and w not in ("nvidia", "tesla"))[:32].strip("-")
    return name or "unknown"


@functools.cache
def detect_gpu_class() -> str:
    """This machine's first GPU's class by nvidia-smi; "cpu" without one; "unknown" when nvidia-smi fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "cpu"
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    first = out.strip().splitlines()[0] if out.strip() else ""
    return gpu_class_of(first) if first else "cpu"


# ------------------------------------------------------------------------------------- across clouds ----

GB = 1e9  # clouds bill egress per decimal GB


def qwen2_lora_params(*, hidden: int, intermediate: int, layers: int, kv_dim: int, r: int) -> int:
    """LoRA parameters of a Qwen2/Llama-shaped model with ``target_modules="all-linear"``: each of q, k, v, o, gate,
    up, down gets A (r x in) and B (out x r), so r x (in + out) per projection per layer."""

    per_layer = (
        r * (hidden + hidden)  # q
        + 2 * r * (hidden + kv_dim)  # k, v
        + r * (hidden + hidden)  # o
        + 2 * r * (hidden + intermediate)  # gate, up
        + r * (intermediate + hidden)  # down
    )
    return layers * per_layer


@dataclass(frozen=True)
class AcrossClouds:
    """A run spread over clouds (docs/across-clouds.md): one trainer, spot generators in regions away from the
    control plane, each region behind a relay or not, SkyPilot's jobs controller. Machine counts by price class."""

    trainer_class: str = "h100"
    trainers: int = 1
    generator_class: str = "l4"
    generators: int = 8
    generators_behind_relays: int = 8  # fetch adapters from their region's relay; the others from the home proxy
    relays: int = 2
    control_machines: int = 1  # the control plane: Redis + proxy
    sky_controllers: int = 1  # SkyPilot's managed-jobs controller VM
    cpu_class: str = "cpu"  # what the control plane, relays and the controller are priced as
    adapter_bytes: int = 0  # one adapter version as published
    versions_per_hour: float = 0.0
    rollout_bytes_per_version: int = 0  # what generators upload per version (their clouds' egress too)


@dataclass(frozen=True)
class AcrossCloudsCost:
    usd_per_hour: dict[str, float]  # by line: trainer GPUs, generator GPUs, control plane, relays, controller, egress
    egress_gb_per_hour: float
    adapter_bytes_per_version: dict[str, int]  # by link: home proxy -> relays, -> direct generators, relay -> gens

    @property
    def total_usd_per_hour(self) -> float:
        return sum(self.usd_per_hour.values())


def across_clouds_cost(prices: Prices, plan: AcrossClouds) -> AcrossCloudsCost:
    """Dollars per hour of ``plan`` at ``prices`` (list prices: spot generators cost less than this says).

    Egress priced is what leaves a cloud: each adapter version from the home proxy to every relay and every
    generator not behind one, and the generators' rollouts to the proxy. A relay's copies to the generators of
    its own region stay in that region and are not priced here."""

    gpu = prices.gpu_usd_per_hour
    direct = plan.generators - plan.generators_behind_relays
    links = {
        "proxy_to_relays": plan.relays * plan.adapter_bytes,
        "proxy_to_direct_generators": direct * plan.adapter_bytes,
        "relays_to_generators": plan.generators_behind_relays * plan.adapter_bytes,
    }
    leaving = links["proxy_to_relays"] + links["proxy_to_direct_generators"] + plan.rollout_bytes_per_version
    egress_gb = leaving * plan.versions_per_hour / GB
    lines = {
        "trainer_gpus": plan.trainers * gpu.get(plan.trainer_class, 0.0),
        "generator_gpus": plan.generators * gpu.get(plan.generator_class, 0.0),
        "control_plane": plan.control_machines * gpu.get(plan.cpu_class, 0.0),
        "relays": plan.relays * gpu.get(plan.cpu_class, 0.0),
        "skypilot_controller": plan.sky_controllers * gpu.get(plan.cpu_class, 0.0),
        "egress": egress_gb * prices.usd_per_gb_egress,
    }
    return AcrossCloudsCost(usd_per_hour=lines, egress_gb_per_hour=egress_gb, adapter_bytes_per_version=links)
