"""Prometheus metrics of one proxy app, on a per-app ``CollectorRegistry`` (served at ``GET /metrics``).

Who updates what:
- ``request_latency`` — the HTTP middleware in ``app.py``, labelled by route TEMPLATE (never the raw path,
  so run ids and versions do not explode cardinality).
- ``backpressure_rejections`` — the error-handler table (``errors.py``) counts every 429 it answers, so
  route code must NOT count them again.
- ``latest_version``, ``live_leases`` — refreshed from Redis at scrape time (``refresh``), so every replica
  reports the shared truth rather than what it happened to serve.
- ``gc_versions`` — the garbage collector (``gc.py``).
- ``queue_depth`` — the rollout queue (P3's ``state/queue.py``); scrape-time refreshers may be appended to
  ``Telemetry.scrape_hooks``.
- the run's lifetime group counters (``bucketrl_{accepted,acked,stale_dropped,stale_rejected,lost}_groups_total``)
  — read from the run's shared counters in Redis at scrape time (:class:`RunCounters`), so every replica
  reports the same run totals, and they continue across proxy restarts and Redis wipes (restored from the
  bucket's snapshot).
- ``bucketrl_tokens_generated_total``, ``bucketrl_pool_share``, ``bucketrl_pool_held`` — the generator pool
  (``state/pool.py``, docs/pool.md), from the same counters and the run's spec.
- ``bucketrl_cost_usd_total``, ``bucketrl_cost_usd_per_step``, ``bucketrl_cost_waste_fraction`` — the run's
  cost (``state/cost.py``, docs/cost.md), recomputed from Redis at scrape time.

Metric names carry the ``bucketrl_`` prefix; per-run series are labelled ``run``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, ClassVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from bucketrl.proxy import keys
from bucketrl.proxy.state import cost, leases, pool, runs, workers
from bucketrl.proxy.state.accounting import queue_status

if TYPE_CHECKING:
    from bucketrl.proxy.context import ProxyContext

# Latency buckets from 1 ms to 60 s: the API is mostly sub-10 ms, long-polls sit near their wait_s.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

ScrapeHook = Callable[["ProxyContext"], Awaitable[None]]


class RunCounters(Collector):
    """The runs' lifetime group counters as Prometheus counters, from the values of the last scrape's refresh."""

    FAMILIES: ClassVar[dict[str, tuple[str, str]]] = {
        "accepted_total": ("bucketrl_accepted_groups", "Rollout groups accepted over the run's life."),
        "acked_total": ("bucketrl_acked_groups", "Rollout groups trained and acked over the run's life."),
        "dropped_stale_total": ("bucketrl_stale_dropped_groups", "Groups dropped as too stale at claim time."),
        "rejected_stale_total": ("bucketrl_stale_rejected_groups", "Groups refused as too stale at submit (409)."),
        "lost_total": ("bucketrl_lost_groups", "Accepted groups whose batch object vanished from the bucket."),
        "tokens_generated_total": ("bucketrl_tokens_generated", "Generated tokens of the run's accepted groups."),
    }

    def __init__(self) -> None:
        self.values: dict[str, dict[str, int]] = {}

    def collect(self) -> Iterator[CounterMetricFamily]:
        for field, (name, doc) in self.FAMILIES.items():
            family = CounterMetricFamily(name, doc, labels=["run"])
            for run, counts in sorted(self.values.items()):
                family.add_metric([run], counts.get(field, 0))
            yield family


class Telemetry:
    """All metrics of one app. Build one per app; never share a registry between apps."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.request_latency = Histogram(
            "bucketrl_http_request_duration_seconds",
            "HTTP request latency by route template, method and status.",
            ["method", "route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "bucketrl_queue_depth_groups", "Rollout groups queued (not yet acked).", ["run"], registry=r
        )
        self.live_leases = Gauge(
            "bucketrl_version_leases_live", "Live version leases per adapter version.", ["run", "version"], registry=r
        )
        self.latest_version = Gauge("bucketrl_latest_version", "Latest published adapter version.", ["run"], registry=r)
        self.published_versions = Counter(
            "bucketrl_versions_published", "Adapter versions published through this replica.", ["run"], registry=r
        )
        self.gc_versions = Counter(
            "bucketrl_gc_versions", "Adapter versions garbage-collected by this replica.", ["run"], registry=r
        )
        self.run_counters = RunCounters()
        r.register(self.run_counters)
        self.backpressure_rejections = Counter(
            "bucketrl_backpressure_rejections", "Requests answered 429 (pipeline full).", ["route"], registry=r
        )
        self.fenced_writes = Counter(
            "bucketrl_fenced_writes", "Trainer writes refused because their epoch was old.", ["run"], registry=r
        )
        # The run's cost so far (docs/cost.md), recomputed at scrape time like the status's ``cost``.
        self.cost_usd = Gauge("bucketrl_cost_usd_total", "What the run has cost so far (USD).", ["run"], registry=r)
        self.cost_per_step = Gauge("bucketrl_cost_usd_per_step", "USD per trainer step so far.", ["run"], registry=r)
        self.cost_waste = Gauge(
            "bucketrl_cost_waste_fraction", "Share of the run's cost that trained nothing.", ["run"], registry=r
        )
        # The generator pool (docs/pool.md): each run's weight, and whether pool leases skip it.
        self.pool_share = Gauge("bucketrl_pool_share", "The run's fair-share weight on the pool.", ["run"], registry=r)
        self.pool_held = Gauge(
            "bucketrl_pool_held", "1 while pool leases skip the run (paused or budget spent).", ["run"], registry=r
        )
        self.scrape_hooks: list[ScrapeHook] = []

    async def refresh(self, ctx: ProxyContext) -> None:
        """Reset the Redis-derived gauges to the shared truth (called by ``GET /metrics``)."""
        self.live_leases.clear()
        counts: dict[str, dict[str, int]] = {}
        for run in await runs.list_runs(ctx.redis):
            raw = await ctx.redis.hgetall(keys.run_key(run, keys.COUNTERS))
            counts[run] = {(f.decode() if isinstance(f, bytes) else f): int(v) for f, v in raw.items()}
            latest = await runs.latest_version(ctx.redis, run)
            self.latest_version.labels(run=run).set(latest)
            for version, count in (await leases.live_counts(ctx.redis, run)).items():
                self.live_leases.labels(run=run, version=str(version)).set(count)
            await self._refresh_cost(ctx, run)
        self.run_counters.values = counts
        for hook in self.scrape_hooks:
            await hook(ctx)

    async def _refresh_cost(self, ctx: ProxyContext, run: str) -> None:
        spec = await runs.get_spec(ctx.redis, run)
        if spec is None:
            return
        live, metrics = await workers.live_workers(ctx.redis, run, ctx.settings.worker_ttl_s)
        state = await runs.get_state(ctx.redis, run)
        c = await cost.run_cost(
            ctx.redis,
            run,
            ctx.settings.price_table(),
            queue=await queue_status(ctx.redis, run, spec),
            trainer_step=state.trainer_step,
            live=live,
            metrics=metrics,
        )
        status = await pool.run_status(ctx.redis, run, spec)
        self.pool_share.labels(run=run).set(spec.share)
        self.pool_held.labels(run=run).set(0 if status.hold == "ok" else 1)
        self.cost_usd.labels(run=run).set(c.usd_total)
        self.cost_per_step.labels(run=run).set(c.usd_per_step or 0.0)
        self.cost_waste.labels(run=run).set(c.waste_fraction)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
