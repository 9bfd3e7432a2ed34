"""The end of ``bucketrl up``: summary figures, a table, and two PNG plots in the run directory.

- ``summary.json``: the figures below (what ``bench/demo_reward.py`` prints).
- ``reward.png``: reward per trainer step, its 10-step rolling mean and the eval reward per evaluated version.
- ``pipeline.png``: one x axis per row (as the dashboard): by trainer step, step time, staleness (per group and per
  trained token) and queue depth, completion length and the truncated / unscorable fractions, entropy, KL and the
  clipped fraction; by seconds, rollout wait vs backpressure and weight sync.

matplotlib is imported inside :func:`plot` with the Agg backend (no display needed).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from rich.table import Table

from bucketrl.up.live import reward_errors
from bucketrl.up.synclatency import SyncLatency
from bucketrl.up.watch import RunWatcher

WINDOW = 20  # the "first/last 20 steps" of the demo target
STARTUP_STEPS = 3  # left out of the summary's averages (start-up is not the steady state)


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def windows(values: list[float]) -> tuple[list[float], list[float]]:
    """The first and last ``WINDOW`` values; halves for a run shorter than two windows (never overlapping)."""
    n = len(values)
    w = min(WINDOW, n // 2) if n >= 2 else n
    return values[:w], values[n - w :] if w else []


def steady(series: list[tuple[int, float]]) -> list[float]:
    """Values without the start-up steps (model loads, generators' first adapter, the first claim wait)."""
    skip = min(STARTUP_STEPS, len(series) // 4)
    return [v for _, v in series[skip:]]


def summarize(watcher: RunWatcher, wall_s: float, sync: SyncLatency | None = None) -> dict[str, Any]:
    # Over the run's whole history (every session of a resumed run; the latest push of a repeated step).
    rewards = [v for _, v in watcher.trainer_series("reward")]
    head, tail = windows(rewards)
    first, last = _mean(head), _mean(tail)
    steps = {s for s, _ in watcher.trainer_series("perf/step_s")} | {s for s, _ in watcher.trainer_series("reward")}
    unscorable = [v for _, v in watcher.trainer_series("reward/unscorable_frac")]
    status = watcher.status
    gen_tokens = sum(
        counter_total([v for _, v in series])
        for series in watcher.timed_series("rollout/tokens_total", role="generator").values()
    )
    dropped = [v for _, v in watcher.trainer_series("sample/dropped_stale_total")]
    figures: dict[str, Any] = {
        "steps": len(steps),
        "window": len(head),
        "last_step": status.trainer.step if status else None,
        "latest_version": status.latest_version if status else None,
        "wall_s": round(wall_s, 1),
        "reward_first20": first,
        "reward_last20": last,
        "reward_ratio": (last / first) if first and last is not None else None,
        "step_s_mean": _mean(steady(watcher.trainer_series("perf/step_s"))),
        "rollout_wait_s_mean": _mean(steady(watcher.trainer_series("perf/rollout_wait_s"))),
        "weight_sync_s_mean": _mean(steady(watcher.trainer_series("perf/weight_sync_s"))),
        "unscorable_frac_mean": _mean(unscorable),
        "unscorable_frac_max": max(unscorable) if unscorable else None,
        "reward_errors": reward_errors(watcher),
        "episode_errors": reward_errors(watcher, "episode_error/"),
        "staleness_mean": _mean([v for _, v in watcher.trainer_series("sample/staleness_mean")]),
        "ratio_mean": _mean([v for _, v in watcher.trainer_series("ratio")]),
        # The proxy's counter (the trainer's restarts with the trainer).
        "dropped_stale_total": status.queue.dropped_stale_total if status else int(dropped[-1]) if dropped else 0,
        # Refused at submit (409, never queued): status' rejected_stale_total; the summary names both the same way.
        "rejected_stale_total": status.queue.rejected_stale_total if status else None,
        "generated_tokens": gen_tokens,
        "queue_accepted_total": status.queue.accepted_total if status else None,
        "sync_latency_p50_s": sync.p50 if sync else None,
        "sync_latency_max_s": sync.max if sync else None,
        "sync_latency_versions": sync.count if sync else 0,
    }
    figures.update(learning_figures(watcher))
    figures.update(token_figures(watcher))
    figures.update(eval_figures(watcher))
    # The run's latest sample completions with their rewards (newest first): what the model writes now.
    figures["samples"] = [x.model_dump() for x in (watcher.status.samples if watcher.status else [])[:5]]
    # What the run cost, from the proxy's last status (docs/cost.md): $ per step, per token, waste, the prices.
    figures["cost"] = status.cost.model_dump() if status is not None and status.cost is not None else None
    return figures


def _frac(figures: dict[str, Any]) -> str:
    mean, worst = figures.get("unscorable_frac_mean"), figures.get("unscorable_frac_max")
    return "–" if mean is None else f"{mean:.1%} / {worst:.1%}"


# What the policy does while it learns (summary name -> the trainer's metric), first and last window of steps.
LEARNING = {
    "completion_length": "completions/mean_length",
    "entropy": "entropy",
    "kl": "kl",  # logged only with loss.kl_coef > 0
    "clip_frac": "clip_ratio/region_mean",  # tokens whose ratio the objective clipped
    "truncated_frac": "completions/clipped_ratio",  # completions cut by max_new_tokens
}


def learning_figures(watcher: RunWatcher) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, metric in LEARNING.items():
        head, tail = windows([v for _, v in watcher.trainer_series(metric)])
        out[f"{name}_first"], out[f"{name}_last"] = _mean(head), _mean(tail)
    return out


def token_figures(watcher: RunWatcher) -> dict[str, Any]:
    """The trained tokens' versions (partial rollouts, issue 35; bucketrl/trainer/token_versions.py): the share from
    completions sampled by several versions and the spans per completion (means over steps), the tokens masked
    as too stale (total), the per-token staleness (median of the steps' p50, max of their max)."""
    series = {name: [v for _, v in watcher.trainer_series(f"tokens/{name}")] for name in _TOKEN_METRICS}
    p50s, maxes = series["staleness_p50"], series["staleness_max"]
    return {
        "mixed_version_token_frac": _mean(series["mixed_version_frac"]),
        "spans_per_completion_mean": _mean(series["spans_per_completion"]),
        "tokens_stale_masked_total": sum(series["stale_masked"]) if series["stale_masked"] else None,
        "token_staleness_p50": statistics.median(p50s) if p50s else None,
        "token_staleness_max": max(maxes) if maxes else None,
    }


_TOKEN_METRICS = ("mixed_version_frac", "spans_per_completion", "stale_masked", "staleness_p50", "staleness_max")


def _token_rows(f: dict[str, Any]) -> list[tuple[str, str]]:
    if f.get("mixed_version_token_frac") is None:
        return []
    return [
        ("trained tokens from mixed-version completions", f"{100 * f['mixed_version_token_frac']:.1f} %"),
        ("version spans per completion (mean)", f"{f['spans_per_completion_mean']:.2f}"),
        ("tokens masked as too stale (total)", f"{f['tokens_stale_masked_total']:.0f}"),
        ("token staleness p50 / max (versions)", f"{f['token_staleness_p50']:g} / {f['token_staleness_max']:g}"),
    ]


def eval_curve(watcher: RunWatcher) -> list[tuple[float, float]]:
    """(trainer step, eval mean reward) per evaluated version: the step at which the trainer reported that
    version as its policy (version 1 = step 0, before any training)."""
    status = watcher.status
    if status is None or not status.eval:
        return []
    step_of: dict[int, float] = {1: 0.0}
    for step, version in watcher.trainer_series("policy/version"):
        step_of.setdefault(int(version), float(step))
    return [
        (step_of.get(e.version, float(e.version - 1)), e.reward_mean) for e in status.eval if e.reward_mean is not None
    ]


def eval_figures(watcher: RunWatcher) -> dict[str, Any]:
    curve = eval_curve(watcher)
    return {
        "eval_versions": len(curve),
        "eval_reward_first": curve[0][1] if curve else None,
        "eval_reward_last": curve[-1][1] if curve else None,
        "eval_curve": [[x, y] for x, y in curve],
    }


def counter_total(values: list[float]) -> float:
    """The total of a per-process counter reported over time: a drop means the process restarted from 0."""
    total, prev = 0.0, 0.0
    for v in values:
        if v < prev:
            total += prev
        prev = v
    return total + prev


def summary_table(figures: dict[str, Any], title: str = "bucketrl up: summary") -> Table:
    def fmt(v: Any, unit: str = "", digits: int = 3) -> str:
        if v is None:
            return "–"
        if isinstance(v, float):
            return f"{v:.{digits}f}{unit}"
        return f"{v}{unit}"

    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column(justify="right")
    window = figures.get("window", WINDOW)
    rows = [
        ("trainer steps", fmt(figures["steps"])),
        ("policy versions published", fmt(figures["latest_version"])),
        ("wall time (this session)", fmt(figures["wall_s"], " s", 1)),
        (f"reward, first {window} steps", fmt(figures["reward_first20"])),
        (f"reward, last {window} steps", fmt(figures["reward_last20"])),
        ("improvement (last / first)", fmt(figures["reward_ratio"], "x", 2)),
        ("step time (mean, after start-up)", fmt(figures["step_s_mean"], " s")),
        ("rollout wait per step (mean)", fmt(figures["rollout_wait_s_mean"], " s")),
        ("adapter publish (mean)", fmt(figures["weight_sync_s_mean"], " s")),
        ("staleness (mean, versions)", fmt(figures["staleness_mean"], "", 2)),
        ("ratio π/π_behav (mean)", fmt(figures["ratio_mean"], "", 4)),
        (
            "groups dropped stale (at claim) / rejected stale (at submit)",
            f"{fmt(figures['dropped_stale_total'])} / {fmt(figures.get('rejected_stale_total'))}",
        ),
        ("groups accepted by the proxy", fmt(figures["queue_accepted_total"])),
        ("generated tokens", fmt(int(figures["generated_tokens"]))),
        ("completions without a reward (mean / worst step)", _frac(figures)),
    ]
    for name, label, unit, digits in (
        ("completion_length", "completion length", " tokens", 1),
        ("entropy", "entropy (per token)", "", 3),
        ("kl", "KL to the base model (per token)", "", 4),
        ("clip_frac", "clipped fraction (tokens)", "", 3),
        ("truncated_frac", "truncated completions (max_new_tokens)", "", 3),
    ):
        if figures.get(f"{name}_first") is not None:
            first, last = fmt(figures[f"{name}_first"], unit, digits), fmt(figures[f"{name}_last"], unit, digits)
            rows.append((f"{label}, first / last {window} steps", f"{first} / {last}"))
    for kind, message in (figures.get("reward_errors") or {}).items():
        rows.append((f"  first reward error: {kind}", message[:120]))
    for kind, message in (figures.get("episode_errors") or {}).items():  # the agent's, not the reward's
        rows.append((f"  first failed episode: {kind}", message[:120]))

    if figures.get("eval_versions"):
        rows.append(
            (
                f"eval reward, first / last of {figures['eval_versions']} evaluated versions",
                (f"{fmt(figures['eval_reward_first'])} / {fmt(figures['eval_reward_last'])}"),
            )
        )
    if figures.get("sync_latency_p50_s") is not None:
        rows.append(
            (
                f"weight sync publish→all generators (p50 / max, {figures['sync_latency_versions']} versions)",
                f"{figures['sync_latency_p50_s'] * 1000:.0f} / {figures['sync_latency_max_s'] * 1000:.0f} ms",
            )
        )
    rows += _token_rows(figures)
    if figures.get("cost"):
        rows.append(_cost_row(figures["cost"]))
    for smp in (figures.get("samples") or [])[:3]:
        reward = "–" if smp.get("reward") is None else f"{smp['reward']:.3f}"
        rows.append((f"  sample v{smp['version']}: {smp['prompt'][:30]!r}", f"{smp['completion'][:40]!r} → {reward}"))
    for k, v in rows:
        t.add_row(k, v)
    return t


def _cost_row(c: dict[str, Any]) -> tuple[str, str]:
    per_step = "–" if c.get("usd_per_step") is None else f"${c['usd_per_step']:.4g}"
    label = "cost: total / per step / waste" + (" (list-price estimates)" if c["prices"].get("estimate") else "")
    return label, f"${c['usd_total']:.4g} / {per_step} / {100 * c['waste_fraction']:.1f} %"


def _rolling(values: list[float], n: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= n:
            acc -= values[i - n]
        out.append(acc / min(i + 1, n))
    return out


def plot(watcher: RunWatcher, out_dir: Path, title: str = "") -> list[Path]:
    """Write ``reward.png`` and ``pipeline.png`` to ``out_dir``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    steps_rewards = watcher.trainer_series("reward")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if steps_rewards:
        xs, ys = zip(*steps_rewards, strict=True)
        ax.plot(xs, ys, lw=0.8, alpha=0.5, label="reward (batch mean)")
        ax.plot(xs, _rolling(list(ys), 10), lw=2.2, label="rolling mean (10 steps)")
    curve = eval_curve(watcher)
    if curve:
        ax.plot(*zip(*curve, strict=True), "o-", lw=1.8, color="tab:green", label="eval reward (held-out)")
    ax.set(xlabel="trainer step", ylabel="reward", ylim=(0, 1.02), title=f"Reward {title}".strip())
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    paths.append(out_dir / "reward.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, _ = pipeline_figure(watcher)
    fig.suptitle(f"Pipeline health {title}".strip())
    fig.tight_layout()
    paths.append(out_dir / "pipeline.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_summary(figures: dict[str, Any], out_dir: Path) -> Path:
    path = out_dir / "summary.json"
    path.write_text(json.dumps(figures, indent=2) + "\n")
    return path


def pipeline_figure(watcher: RunWatcher) -> tuple[Any, Any]:
    """``pipeline.png``'s figure and its 3 x 2 axes. One x axis per row, as in the dashboard: rows 0 and 1 by
    trainer step, row 2 by seconds since the run's first data point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(12, 10.5))
    t0 = min([p["ts"] for p in watcher.pushes[:1]] + [s["ts"] for s in watcher.status_history[:1]] or [0.0])

    def trainer(ax: Any, metric: str, label: str, **kw: Any) -> None:
        series = watcher.trainer_series(metric)
        if series:
            ax.plot(*zip(*series, strict=True), label=label, **kw)

    def timed(ax: Any, metric: str, role: str, label: str, fmt: str = ".-", **kw: Any) -> None:
        for worker, series in watcher.timed_series(metric, role=role).items():
            name = label if role == "trainer" else f"{label} {worker}"
            ax.plot([t - t0 for t, _ in series], [v for _, v in series], fmt, lw=0.8, label=name, **kw)

    ax = axes[0][0]
    trainer(ax, "perf/step_s", "step")
    trainer(ax, "perf/fwd_bwd_s", "forward + backward")
    trainer(ax, "perf/rollout_wait_s", "rollout wait")
    ax.set(title="Trainer step time", xlabel="trainer step", ylabel="seconds")

    ax = axes[0][1]
    trainer(ax, "sample/staleness_mean", "staleness mean")
    trainer(ax, "sample/staleness_max", "staleness max")
    trainer(ax, "tokens/staleness_p50", "token staleness p50", ls=":")
    trainer(ax, "tokens/staleness_max", "token staleness max", ls=":")
    ax.set(title="Staleness (versions) and queue depth (groups)", xlabel="trainer step", ylabel="versions")
    if watcher.status_history:
        by_step: dict[int, int] = {}
        for s in watcher.status_history:
            by_step[int(s["step"])] = int(s["queue"])
        ax2 = ax.twinx()
        ax2.plot(list(by_step), list(by_step.values()), color="gray", ls="--", label="queue depth")
        ax2.set_ylabel("queued groups")
        ax2.legend(loc="upper right", fontsize=8)

    ax = axes[1][0]
    trainer(ax, "completions/mean_length", "completion length (tokens)")
    ax.set(title="Completion length; truncated and unscorable fractions", xlabel="trainer step", ylabel="tokens")
    ax2 = ax.twinx()
    trainer(ax2, "completions/clipped_ratio", "truncated (max_new_tokens)", color="tab:red", ls="--")
    trainer(ax2, "reward/unscorable_frac", "without a reward", color="tab:purple", ls=":")
    ax2.set(ylabel="fraction", ylim=(0, 1.02))
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend(loc="upper right", fontsize=8)

    ax = axes[1][1]
    trainer(ax, "entropy", "entropy")
    trainer(ax, "kl", "KL to the base model")
    trainer(ax, "clip_ratio/region_mean", "clipped fraction")
    ax.set(title="Entropy, KL (per token) and clipped fraction", xlabel="trainer step")

    ax = axes[2][0]
    timed(ax, "rollout/backpressure_s", "generator", "backpressure")
    timed(ax, "perf/rollout_wait_s", "trainer", "trainer rollout wait", "k.", ms=4)
    ax.set(title="Rollout wait (trainer) vs backpressure (generators)", xlabel="seconds", ylabel="seconds")

    ax = axes[2][1]
    timed(ax, "perf/weight_sync_s", "trainer", "trainer publish", "k.-")
    timed(ax, "sync/adapter_load_s", "generator", "adapter load", ".")
    ax.set(title="Weight sync", xlabel="seconds", ylabel="seconds")

    for row in axes:
        for ax in row:
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8, loc="upper left")
    return fig, axes
