"""``bucketrl status``: a run's state as tables, or as JSON for scripts.

    bucketrl status --proxy http://proxy:8000 --run demo --token $VIEWER_TOKEN
    bucketrl status --dir runs/demo            # a `bucketrl up` run: proxy address and token from the dir
    bucketrl status                            # the last `bucketrl up` started from this directory
    bucketrl status --json | jq .queue

Shows versions and their live leases, the rollout queue, prompts in flight, the workers with their loaded
adapter versions and heartbeat age, the trainer's epoch and step, and the last value of the key metrics
of each worker (``--all-metrics`` for every one). Options default to ``BUCKETRL_PROXY_URL``,
``BUCKETRL_RUN`` and ``BUCKETRL_TOKEN``. Exit codes: 0 ok, 1 proxy unreachable or error, 2 bad usage.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from bucketrl import errors
from bucketrl.client import ProxyClient
from bucketrl.settings import WorkerSettings
from bucketrl.wire.pool import PoolStatus, RunPoolStatus

KEY_METRICS = (
    "reward",
    "reward_std",
    "perf/step_s",
    "perf/rollout_wait_s",
    "perf/weight_sync_s",
    "sample/staleness_mean",
    "sample/staleness_max",
    "sample/dropped_stale_total",
    "ratio",
    "kl",
    "entropy",
    "train/loss",
    "train/lr",
    "train/tokens",
    "train/tokens_context",
    "episodes/turns_mean",
    "policy/version",
    "rollout/generated_tok_s",
    "rollout/backpressure_s",
    "rollout/inflight",
    "rollout/unscorable_total",
    "reward/unscorable_frac",
    "sync/adapter_load_s",
    # Multi-turn runs (generators): bucketrl/generator/metrics.py
    "episode/turns_mean",
    "episode/tool_calls_mean",
    "episode/env_time_frac",
    "episode/tool_errors_total",
    "episode/timeouts_total",
    "episode/failed_total",
)


def _from_run_dir(run_dir: Path, role: str = "viewer") -> tuple[str, str, str]:
    """(proxy_url, run, ``role``'s token) of a `bucketrl up` run directory."""
    endpoint = run_dir / "endpoint.json"
    if not endpoint.exists():
        raise ValueError(f"{run_dir} has no endpoint.json: is it a `bucketrl up` run directory?")
    info = json.loads(endpoint.read_text())
    tokens = dict(line.split(":", 1) for line in (run_dir / "tokens").read_text().split() if ":" in line)
    return info["proxy_url"], info["run"], tokens.get(role, "")


LAST_UP_FILE = "last-up.json"


def _state_dir() -> Path:

    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "bucketrl"


def record_last_up(run_dir: Path) -> None:
    """Remember ``run_dir`` as the last `bucketrl up` started from this working directory (best effort)."""

    path = _state_dir() / LAST_UP_FILE
    try:
        known = json.loads(path.read_text()) if path.exists() else {}
        known = known if isinstance(known, dict) else {}
        known[os.getcwd()] = str(run_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(known) + "\n")
        tmp.replace(path)
    except (OSError, ValueError):
        pass


def last_up_dir() -> Path | None:
    """The run directory of the last `bucketrl up` started from this working directory, if recorded."""

    try:
        known = json.loads((_state_dir() / LAST_UP_FILE).read_text())
        return Path(known[os.getcwd()])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _stopped_reason(run_dir: Path | None) -> str | None:
    """Why the run directory's last `bucketrl up` stopped on a configuration error (its stopped.json)."""
    if run_dir is None:
        return None
    try:
        info = json.loads((run_dir / "stopped.json").read_text())
        return f"{info['service']} stopped on a configuration error: {info['reason']}"
    except (OSError, ValueError, KeyError, TypeError):
        return None


def status_command(
    proxy: Annotated[str | None, typer.Option(help="Proxy base URL (BUCKETRL_PROXY_URL).")] = None,
    run: Annotated[str | None, typer.Option(help="Run id (BUCKETRL_RUN).")] = None,
    token: Annotated[str | None, typer.Option(help="A viewer (or any) token (BUCKETRL_TOKEN).")] = None,
    dir: Annotated[
        Path | None, typer.Option("--dir", help="A `bucketrl up` run directory (reads its address and token).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the status as JSON.")] = False,
    all_metrics: Annotated[bool, typer.Option("--all-metrics", help="Show every metric, not the key ones.")] = False,
    hold: Annotated[
        str | None,
        typer.Option(
            "--generation",
            help="pause or resume the run's generation first (pool and per-run leases skip a paused run; "
            "a trainer token of the run or admin; with --dir the directory's admin token).",
        ),
    ] = None,
) -> None:
    """Show a run's versions, leases, queue, workers and last metrics."""

    if dir is None and proxy is None and "BUCKETRL_PROXY_URL" not in os.environ:
        dir = last_up_dir()
        if dir is None:
            typer.echo(
                "bucketrl status: no `bucketrl up` was started from this directory: pass --dir <run directory> "
                "(or --proxy, --run and --token for a deployed proxy)",
                err=True,
            )
            raise typer.Exit(code=2)
    stopped = _stopped_reason(dir)
    try:
        if dir is not None:
            url, dir_run, dir_token = _from_run_dir(dir, "viewer" if hold is None else "admin")
            proxy, run, token = proxy or url, run or dir_run, token or dir_token
        overrides = {k: v for k, v in {"proxy_url": proxy, "run": run, "token": token}.items() if v is not None}
        settings = WorkerSettings(**overrides)  # type: ignore[arg-type]
    except (ValidationError, ValueError, OSError) as exc:
        typer.echo(f"bucketrl status: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    client = ProxyClient(settings.proxy_url, settings.run, settings.token, retries=1, timeout_s=10.0)
    try:
        _change_hold(client, hold)
        status = client.status()
        pool = _pool_or_none(client)
    except errors.Unauthorized as exc:
        typer.echo(f"bucketrl status: {exc.message} (pass --token or set BUCKETRL_TOKEN)", err=True)
        raise typer.Exit(code=1) from exc
    except errors.BucketRLError as exc:
        if stopped:
            typer.echo(f"bucketrl status: {dir}: {stopped}", err=True)
        typer.echo(f"bucketrl status: {settings.proxy_url}: {exc.code}: {exc.message}", err=True)
        raise typer.Exit(code=1) from exc
    finally:
        client.close()
    if stopped:
        typer.echo(f"bucketrl status: {dir}: {stopped}", err=True)
    if as_json:
        out = status.model_dump(mode="json")
        if pool is not None:  # every run the token reaches on this proxy (docs/pool.md)
            out["runs"] = [r.model_dump(mode="json") for r in pool.runs]
            out["token_fraction"] = pool.token_fraction
            out["recent_fraction"] = pool.recent_fraction
        typer.echo(json.dumps(out, indent=2))
        return

    Console().print(*render_status(status, all_metrics=all_metrics), *pool_tables(pool))


def _change_hold(client: ProxyClient, hold: str | None) -> None:
    """``--generation pause|resume``: the run's generation held or released before its status is read."""
    if hold is None:
        return
    if hold not in ("pause", "resume"):
        typer.echo(f"bucketrl status: --generation is pause or resume, not {hold!r}", err=True)
        raise typer.Exit(code=2)
    done = client.pause_generation() if hold == "pause" else client.resume_generation()
    typer.echo(f"bucketrl status: {done.run}: generation {hold}d (hold {done.hold})", err=True)


def _pool_or_none(client: ProxyClient) -> PoolStatus | None:
    """The proxy's runs with their shares (None from a proxy older than the pool: its 404)."""
    try:
        return client.pool_status()
    except errors.NotFound:
        return None


def pool_tables(pool: PoolStatus | None) -> list[Any]:
    """The runs sharing the generator pool: share, the fraction of the tokens they got, queue, live versions and
    LoRA slots, budget, hold."""
    if pool is None or len(pool.runs) < 2:
        return []
    table = Table(title="runs on the generator pool", title_justify="left")
    recent = f"last {pool.recent_window_s:.0f} s"
    cols = ("run", "share", "tokens generated", "token fraction", recent, "groups accepted", "queue", "in flight")
    for col in (*cols, "live versions", "adapters / slots", "budget", "hold"):
        table.add_column(col, justify="right")
    for r in pool.runs:
        frac = f"{100 * pool.token_fraction.get(r.run, 0.0):.1f} %"
        now = f"{100 * pool.recent_fraction.get(r.run, 0.0):.1f} %"
        queue = str(r.queue_groups) if r.queue_capacity is None else f"{r.queue_groups} / {r.queue_capacity}"
        table.add_row(
            r.run, _num(r.share), str(r.tokens_generated), frac, now, str(r.groups_accepted), queue,
            str(r.prompts_inflight), ", ".join(f"v{v}" for v in r.live_versions) or "–", _slots(r), _budget(r), r.hold,
        )  # fmt: skip
    return [table]


def _slots(r: RunPoolStatus) -> str:
    """The run's adapters loaded on its generators, out of the slots those generators give it."""
    if r.slots_per_generator is None:
        return "–"
    return f"{r.adapters_loaded} / {r.generators * r.slots_per_generator} ({r.generators} gen)"


def _budget(r: RunPoolStatus) -> str:
    if r.budget_tokens is None:
        return "–"
    used = r.budget_used if r.budget_used is not None else r.tokens_generated / r.budget_tokens
    return f"{r.tokens_generated} of {r.budget_tokens} ({100 * used:.0f} %)"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _num(v: Any) -> str:
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.3e}"
        return f"{v:.4g}"
    return str(v)


def render_status(status: Any, *, all_metrics: bool = False) -> list[Any]:
    """The rich renderables of a :class:`bucketrl.wire.RunStatus` (header, versions, workers, metrics)."""

    q = status.queue
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold cyan")
    head.add_column()
    head.add_row("run", status.run)
    head.add_row("latest version", str(status.latest_version))
    head.add_row("trainer", f"epoch {status.trainer.epoch}, step {status.trainer.step}")
    head.add_row(
        "queue",
        f"{q.groups}/{q.capacity} groups queued, {q.pending} delivered unacked; accepted {q.accepted_total}, "
        f"acked {q.acked_total}, dropped stale {q.dropped_stale_total}, lost {q.lost_total}, rejected stale "
        f"{q.rejected_stale_total}, backpressure {q.backpressure_total}",
    )
    head.add_row("prompts", f"{status.prompts_inflight} in flight, cursor {status.prompt_cursor}")
    head.add_row("garbage-collected versions", str(status.gc_versions_total))

    now = time.time()
    versions = Table(title="versions", title_justify="left")
    for col in ("version", "live leases", "published"):
        versions.add_column(col, justify="right")
    for v in sorted(status.versions, key=lambda v: v.version, reverse=True):
        versions.add_row(f"v{v.version}", str(v.leases), f"{_age(now - v.published_at)} ago")

    workers = Table(title="workers", title_justify="left")
    for col in ("worker", "role", "gpu class", "phase", "loaded versions", "heartbeat age", "step"):
        workers.add_column(col)
    notes = Table(title="notes (configuration errors, first reward error of each kind)", title_justify="left")
    notes.add_column("worker")
    notes.add_column("note")
    notes.add_column("message", overflow="fold")
    for w in status.workers:
        for name, text in sorted(w.notes.items()):
            notes.add_row(w.worker_id, name, text)
        step = status.metrics.get(w.worker_id, {}).get("_step")
        workers.add_row(
            w.worker_id,
            w.role,
            (w.gpu_class or "–") + ("" if w.usd_per_hour is None else f" (${w.usd_per_hour:g}/h)"),
            w.phase or "–",
            ", ".join(f"v{v}" for v in w.loaded_versions) or "–",
            _age(w.last_seen_s),
            "–" if step is None else str(int(step)),
        )

    ids = [w.worker_id for w in status.workers if status.metrics.get(w.worker_id)]
    metrics = Table(title="last metrics" + ("" if all_metrics else " (key ones; --all-metrics for every one)"))
    metrics.title_justify = "left"
    metrics.add_column("metric")
    for wid in ids:
        metrics.add_column(wid, justify="right")
    names = sorted({n for wid in ids for n in status.metrics[wid] if n != "_step"})
    if not all_metrics:
        names = [n for n in KEY_METRICS if n in names] + sorted(n for n in names if n.startswith("mismatch/"))
    for name in names:
        metrics.add_row(name, *(_num(status.metrics[wid][name]) if name in status.metrics[wid] else "" for wid in ids))
    out: list[Any] = [head, versions, workers, *([notes] if notes.row_count else []), metrics, *cost_tables(status)]
    if status.eval:
        evals = Table(title="evaluation (held-out, per version; newest 10)", title_justify="left")
        for col in ("version", "prompts", "mean reward", "pass@1", "pass@k", "mean length", "unscorable"):
            evals.add_column(col, justify="right")
        for e in status.eval[-10:]:
            evals.add_row(
                f"v{e.version}",
                str(e.prompts),
                _num(e.reward_mean) if e.reward_mean is not None else "–",
                _num(e.pass_at_1),
                f"{_num(e.pass_at_k)} (k={e.k})",
                _num(e.mean_length),
                f"{100 * e.unscorable_frac:.1f} %",
            )
        out.append(evals)
    return out


def cost_tables(status: Any) -> list[Any]:
    """The run's cost (docs/cost.md) and the throughput per GPU class; nothing from a proxy without them."""

    c = status.cost
    if c is None:
        return []

    def usd(v: float | None, digits: int = 4) -> str:
        return "–" if v is None else f"${v:.{digits}g}"

    head = Table(title="cost" + (" (list-price estimates)" if c.prices.estimate else ""), title_justify="left")
    for col in ("total", "$ per step", "$ per 1M trained tokens", "$ per accepted group", "waste"):
        head.add_column(col, justify="right")
    per_m = None if c.usd_per_trained_token is None else c.usd_per_trained_token * 1e6
    head.add_row(
        usd(c.usd_total),
        usd(c.usd_per_step),
        usd(per_m),
        usd(c.usd_per_accepted_group),
        f"{100 * c.waste_fraction:.1f} %",
    )
    classes = Table(title="GPU classes (throughput per live worker)", title_justify="left")
    for col in ("role", "class", "live", "hours", "idle", "$", "tokens/s", "groups/s"):
        classes.add_column(col, justify="right")
    for u in c.classes:
        classes.add_row(
            u.role,
            u.gpu_class,
            str(u.workers_live),
            f"{u.worker_s / 3600:.3g}",
            f"{100 * u.idle_s / u.worker_s:.0f} %" if u.worker_s > 0 else "–",
            usd(u.usd),
            "–" if u.tokens_per_s is None else _num(u.tokens_per_s),
            "–" if u.groups_per_s is None else _num(u.groups_per_s),
        )
    wire = Table(title="bucket and links", title_justify="left")
    for col in ("writes", "reads", "$ requests", "bucket -> proxy", "proxy -> workers", "$ egress"):
        wire.add_column(col, justify="right")
    wire.add_row(
        str(c.bucket_requests),
        str(c.bucket_reads),
        usd(c.usd_requests),
        f"{c.bucket_egress_gb:.3g} GB",
        f"{c.egress_gb:.3g} GB",
        usd(c.usd_egress),
    )
    return [head, *([classes] if c.classes else []), wire]
