"""The live terminal view of ``bucketrl up`` (rich): one renderable rebuilt from the watcher each second."""

from __future__ import annotations

import time

from rich.console import Group
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from bucketrl.up.watch import RunWatcher


def _f(v: float | None, fmt: str = ".3f", unit: str = "") -> str:
    return "–" if v is None else f"{v:{fmt}}{unit}"


def reward_errors(watcher: RunWatcher, prefix: str = "reward_error/") -> dict[str, str]:
    """The first message of each reward failure kind any worker reported (``reward_error/<kind>`` notes; with
    ``prefix="episode_error/"``, each episode failure kind's: the agent's, a timeout, the turn limit)."""
    out: dict[str, str] = {}
    for w in watcher.status.workers if watcher.status else []:
        for name, text in w.notes.items():
            if name.startswith(prefix):
                out.setdefault(name.removeprefix(prefix), text)
    return out


def render(
    watcher: RunWatcher,
    *,
    run: str,
    max_steps: int,
    started: float,
    dashboard: str,
    services: dict[str, str],
    note: str = "",
) -> Panel:
    """``services`` maps a service name to a short state ("running pid 123", "restarting", ...)."""
    s = watcher.status
    elapsed = time.monotonic() - started
    step = s.trainer.step if s else 0
    trainer = watcher.trainer_id()
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold cyan")
    head.add_column()
    head.add_column(style="bold cyan")
    head.add_column()
    bar = ProgressBar(total=max_steps, completed=min(step, max_steps), width=30)
    progress = Table.grid(padding=(0, 1))
    progress.add_row(bar, Text(f"{step}/{max_steps}"))
    head.add_row("step", progress, "policy version", str(s.latest_version) if s else "–")
    head.add_row(
        "reward (10-step mean)",
        _f(watcher.rolling_reward(10)),
        "staleness mean/max",
        f"{_f(watcher.latest(trainer or '', 'sample/staleness_mean'), '.2f')} / "
        f"{_f(watcher.latest(trainer or '', 'sample/staleness_max'), '.0f')}",
    )
    gens = [w for w in (s.workers if s else []) if w.role == "generator"]
    backpressure = sum(watcher.latest(w.worker_id, "rollout/backpressure_s") or 0.0 for w in gens)
    toks = sum(watcher.latest(w.worker_id, "rollout/generated_tok_s") or 0.0 for w in gens)
    head.add_row(
        "queue",
        f"{s.queue.groups}/{s.queue.capacity} groups, {s.prompts_inflight} prompts in flight" if s else "–",
        "rollout wait vs backpressure",
        f"{_f(watcher.latest(trainer or '', 'perf/rollout_wait_s'), '.2f', ' s')} vs {backpressure:.2f} s",
    )
    head.add_row(
        "step time",
        _f(watcher.latest(trainer or "", "perf/step_s"), ".2f", " s"),
        "generated tokens/s",
        f"{toks:,.0f}",
    )
    unscorable = watcher.latest(trainer or "", "reward/unscorable_frac")
    errors = reward_errors(watcher)
    if unscorable or errors:
        head.add_row(
            "unscorable rewards",
            Text(f"{_f(unscorable, '.0%')} of the last step", style="bold red" if unscorable else ""),
            "first errors",
            Text("; ".join(f"{k}: {m}" for k, m in errors.items())[:200], style="red"),
        )
    workers = Table(show_edge=False, box=None, header_style="dim")
    for col in ("service", "state", "phase", "loaded versions", "heartbeat", "tok/s"):
        workers.add_column(col)
    seen = {w.worker_id: w for w in (s.workers if s else [])}
    for name, state in services.items():
        w = seen.get(name)
        workers.add_row(
            name,
            state,
            (w.phase or "") if w else "",
            ", ".join(f"v{v}" for v in w.loaded_versions) if w and w.loaded_versions else "",
            f"{w.last_seen_s:.1f} s ago" if w else "",
            _f(watcher.latest(name, "rollout/generated_tok_s"), ",.0f") if w and w.role == "generator" else "",
        )
    # The panel is cropped to the terminal: a token there could not be copied whole. The full link was printed
    # above the live view (one line, never wrapped); here the address without it.
    base, _, fragment = dashboard.partition("#")
    # Short enough to stay whole in 80 columns (a default run's address is 44 characters).
    shown = f"dashboard {base}" + (" (link with token: above)" if fragment else "")
    footer = Text(shown, no_wrap=True, overflow="ellipsis", style="dim")
    hint = Text("Ctrl-C stops everything cleanly; run again with the same --dir to resume.", style="dim")
    parts: list = [head, Text(""), workers, Text("")]
    if note:
        parts.append(Text(note, style="yellow"))
    elif s is None:
        parts.append(Text(f"starting: {watcher.waiting_for()}", style="dim"))
    elif watcher.last_error:
        parts.append(Text(f"proxy: {watcher.last_error}", style="yellow"))
    parts += [footer, hint]
    return Panel(Group(*parts), title=f"bucketrl up · run {run} · {elapsed:,.0f} s", title_align="left")
