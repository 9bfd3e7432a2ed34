"""Several runs on one ``bucketrl up`` (bucketrl.up.runs): the live view, the progress lines and the summary, each
showing every run side by side: its share, the tokens the pool generated for it, its groups, steps and reward.

The figures of one run are what a one-run ``up`` reports (:func:`bucketrl.up.report.summarize`), written to
``<dir>/runs/<run>/summary.json`` with that run's plots; ``<dir>/summary.json`` has them all under ``runs``, each
with its place on the pool (``share``, ``tokens_generated``, ``groups_accepted``, ``token_fraction``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from bucketrl.up import report
from bucketrl.up.synclatency import measure
from bucketrl.up.watch import RunWatcher
from bucketrl.wire.pool import RunPoolStatus

if TYPE_CHECKING:
    from bucketrl.up.cluster import LocalCluster


def _f(v: float | None, fmt: str = ".3f") -> str:
    return "–" if v is None else f"{v:{fmt}}"


def _pools(watchers: dict[str, RunWatcher]) -> dict[str, RunPoolStatus]:
    return {run: w.status.pool for run, w in watchers.items() if w.status is not None and w.status.pool is not None}


def snapshot_shares(watchers: dict[str, RunWatcher]) -> None:
    """Record each run's tokens while every run of the pool is still generating (``tokens_while_all_ran``)."""
    pools = _pools(watchers)
    if len(pools) == len(watchers) and all(p.hold == "ok" for p in pools.values()):
        for run, p in pools.items():
            watchers[run].tokens_while_all_ran = p.tokens_generated


def pool_figures(watchers: dict[str, RunWatcher]) -> dict[str, dict[str, Any]]:
    """Each run's place on the pool from its latest status: share, tokens generated, groups accepted, the fraction of
    all the runs' tokens it got, its hold."""
    pools = _pools(watchers)
    total = sum(p.tokens_generated for p in pools.values())
    shared = {run: w.tokens_while_all_ran for run, w in watchers.items() if w.tokens_while_all_ran is not None}
    shared_total = sum(shared.values())
    return {
        run: {
            "share": p.share,
            "tokens_generated": p.tokens_generated,
            "groups_accepted": p.groups_accepted,
            "token_fraction": p.tokens_generated / total if total else None,
            # Runs that train the same number of steps end with the same tokens whatever their shares: the
            # fraction while all of them ran is the one the shares set.
            "token_fraction_while_all_ran": shared[run] / shared_total if shared_total and run in shared else None,
            "hold": p.hold,
        }
        for run, p in pools.items()
    }


def runs_table(cluster: LocalCluster, watchers: dict[str, RunWatcher]) -> Table:
    table = Table(show_edge=False, box=None, header_style="dim")
    for col in ("run", "share", "tokens generated", "token fraction", "groups accepted", "step", "version"):
        table.add_column(col)
    table.add_column("reward (10-step mean)")
    table.add_column("queue")
    table.add_column("pool")
    pool = pool_figures(watchers)
    for run, w in watchers.items():
        s, p = w.status, pool.get(run, {})
        max_steps = cluster.run_cfgs[run].effective_max_steps()
        table.add_row(
            run,
            _f(p.get("share"), "g"),
            _f(p.get("tokens_generated"), ",d"),
            _f(p.get("token_fraction"), ".0%"),
            _f(p.get("groups_accepted"), ",d"),
            f"{s.trainer.step}/{max_steps}" if s else f"–/{max_steps}",
            f"v{s.latest_version}" if s else "–",
            _f(w.rolling_reward(10)),
            f"{s.queue.groups}/{s.queue.capacity}" if s else "–",
            p.get("hold", ""),
        )
    return table


def render_runs(
    cluster: LocalCluster, watchers: dict[str, RunWatcher], *, started: float, services: dict[str, str], note: str
) -> Panel:
    """The live view: the runs on the pool, then every service's state."""
    states = Table(show_edge=False, box=None, header_style="dim")
    states.add_column("service")
    states.add_column("state")
    for name, state in services.items():
        states.add_row(name, state)
    parts: list[Any] = [runs_table(cluster, watchers), Text(""), states, Text("")]
    waiting = next((w for w in watchers.values() if w.status is None), None)
    if note:
        parts.append(Text(note, style="yellow"))
    elif waiting is not None:
        parts.append(Text(f"starting {waiting.run}: {waiting.waiting_for()}", style="dim"))
    base = cluster.dashboard_url.partition("#")[0]
    parts.append(Text(f"dashboard {base} (link with token: above)", no_wrap=True, overflow="ellipsis", style="dim"))
    parts.append(Text("Ctrl-C stops everything cleanly; run again with the same --dir to resume.", style="dim"))
    elapsed = time.monotonic() - started
    title = f"bucketrl up · {len(watchers)} runs on one pool · {elapsed:,.0f} s"
    return Panel(Group(*parts), title=title, title_align="left")


def print_lines(console: Console, cluster: LocalCluster, watchers: dict[str, RunWatcher]) -> None:
    """One progress line per run (--no-live)."""
    pool = pool_figures(watchers)
    for run, w in watchers.items():
        s, p = w.status, pool.get(run, {})
        if s is None:
            console.print(f"{run}: starting: {w.waiting_for()}", soft_wrap=True)
            continue
        max_steps = cluster.run_cfgs[run].effective_max_steps()
        console.print(
            f"{run}: step {s.trainer.step}/{max_steps}  v{s.latest_version}  reward {_f(w.rolling_reward(10))}  "
            f"share {_f(p.get('share'), 'g')}  tokens {_f(p.get('tokens_generated'), ',d')} "
            f"({_f(p.get('token_fraction'), '.0%')})  groups {_f(p.get('groups_accepted'), ',d')}  "
            f"queue {s.queue.groups}/{s.queue.capacity}  {p.get('hold', '')}",
            soft_wrap=True,
        )


def adapter_location(cluster: LocalCluster, run: str, version: int | None) -> str | None:
    """Where a run's latest adapter is, and the command that copies it out as a PEFT folder."""
    if not version:
        return None
    where = f"in the bucket {cluster.bucket_url}"
    if cluster.bucket_url.startswith("file://"):
        where = f"at {cluster.bucket_url.removeprefix('file://')}/runs/{run}/adapters/v{version}/files"
    run_option = f" --run {run}" if cluster.cfg.runs is not None else ""
    return f"v{version} {where}; as a PEFT folder: bucketrl export adapter-v{version} --dir {cluster.dir}{run_option}"


def run_figures(cluster: LocalCluster, run: str, watcher: RunWatcher, wall_s: float) -> dict[str, Any] | None:
    """One run's summary (None: its trainer took no step), its summary.json and plots under its own directory."""
    if not watcher.trainer_series("perf/step_s"):
        return None
    home = cluster.run_home(run)
    figures = report.summarize(watcher, wall_s, measure(cluster.logs, run, trainer=cluster.trainer_name(run)))
    figures["adapter"] = adapter_location(cluster, run, figures.get("latest_version"))
    watcher.save(home)
    report.write_summary(figures, home)
    try:
        report.plot(watcher, home, title=f"(run {run})")
    except Exception as exc:  # a plot must never hide the summary
        figures["plot_error"] = str(exc)
    return figures


SUMMARY_ROWS = (
    ("share", "share", "g"),
    ("tokens generated (pool)", "tokens_generated", ",d"),
    ("token fraction", "token_fraction", ".1%"),
    ("token fraction, all running", "token_fraction_while_all_ran", ".1%"),
    ("groups accepted", "groups_accepted", ",d"),
    ("trainer steps", "steps", "d"),
    ("policy versions", "latest_version", "d"),
    ("reward, first window", "reward_first20", ".3f"),
    ("reward, last window", "reward_last20", ".3f"),
    ("step time (mean)", "step_s_mean", ".2f"),
    ("staleness (mean)", "staleness_mean", ".2f"),
)


def final_report(
    cluster: LocalCluster, watchers: dict[str, RunWatcher], console: Console, wall_s: float, resume: str
) -> None:
    """Every run's figures side by side, ``<dir>/summary.json`` with a section per run, each run's own files."""
    pool = pool_figures(watchers)
    runs: dict[str, Any] = {}
    for run, w in watchers.items():
        figures = run_figures(cluster, run, w, wall_s)
        runs[run] = {**pool.get(run, {}), **(figures or {"steps": 0})}
        # The run's group accounting at the end (the workers stopped, so the counters are still): accepted ==
        # acked + dropped_stale + lost + queued (groups) + pending.
        runs[run]["queue"] = w.status.queue.model_dump() if w.status is not None else None
    report.write_summary({"wall_s": round(wall_s, 1), "runs": runs}, cluster.dir)
    table = Table(title=f"bucketrl up · {len(runs)} runs on one pool", title_justify="left")
    table.add_column("", style="bold")
    for run in runs:
        table.add_column(run, justify="right")
    for label, key, fmt in SUMMARY_ROWS:
        table.add_row(label, *(_f(figs.get(key), fmt) for figs in runs.values()))
    console.print(table)
    for run, figs in runs.items():
        if figs.get("adapter"):
            console.print(f"{run}: final adapter {figs['adapter']}", soft_wrap=True)
    console.print(f"summary: {cluster.dir / 'summary.json'} (each run's: runs/<run>/)   {resume}", soft_wrap=True)
