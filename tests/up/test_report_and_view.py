"""The end-of-run report and the live view, from a canned history (no services needed)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from rich.console import Console

from bucketrl.up.live import render
from bucketrl.up.report import counter_total, pipeline_figure, plot, summarize, summary_table, write_summary
from bucketrl.up.synclatency import SyncLatency
from bucketrl.up.watch import RunWatcher
from bucketrl.wire import EvalVersionResult, RunStatus, SampleCompletion


def _watcher(steps: int = 40) -> RunWatcher:
    w = RunWatcher("http://127.0.0.1:9", "demo", "tok")
    now = time.time()
    pushes = []
    for k in range(1, steps + 1):
        reward = 0.1 if k <= 20 else 0.8
        pushes.append(
            {
                "worker_id": "trainer",
                "role": "trainer",
                "ts": now + k,
                "step": k,
                "metrics": {
                    "reward": reward,
                    "perf/step_s": 0.5,
                    "perf/rollout_wait_s": 0.1,
                    "perf/weight_sync_s": 0.05,
                    "sample/staleness_mean": 1.0,
                    "sample/staleness_max": 2.0,
                    "ratio": 1.0,
                    "completions/mean_length": 12.0 if k <= 20 else 6.0,
                    "completions/clipped_ratio": 0.25,
                    "reward/unscorable_frac": 0.0,
                    "entropy": 2.0 if k <= 20 else 1.0,
                    "kl": 0.001 * k,
                    "clip_ratio/region_mean": 0.05,
                    # A partial-rollouts run: from step 21 on, 40 % of the trained tokens come from continued calls.
                    "tokens/mixed_version_frac": 0.0 if k <= 20 else 0.4,
                    "tokens/spans_per_completion": 1.0 if k <= 20 else 1.5,
                    "tokens/stale_masked": 0.0 if k <= 20 else 3.0,
                    "tokens/staleness_p50": 1.0,
                    "tokens/staleness_max": 2.0 if k != 33 else 4.0,
                },
            }
        )
        for g in ("gen-0", "gen-1"):
            tokens = 100.0 * k if k <= 30 or g == "gen-1" else 100.0 * (k - 30)  # gen-0 restarted at step 30
            pushes.append(
                {
                    "worker_id": g,
                    "role": "generator",
                    "ts": now + k + 0.5,
                    "step": None,
                    "metrics": {
                        "rollout/tokens_total": tokens,
                        "rollout/generated_tok_s": 200.0,
                        "rollout/backpressure_s": 0.2,
                        "sync/adapter_load_s": 0.1,
                        "sync/adapter_version": float(k),
                    },
                }
            )
    w._merge(pushes)
    w._merge(pushes[:5])  # a re-fetched window is not double counted
    w.status = RunStatus.model_validate(
        {
            "run": "demo",
            "latest_version": steps + 1,
            "versions": [{"version": steps + 1, "leases": 2, "published_at": now}],
            "queue": {
                "groups": 3,
                "capacity": 64,
                "accepted_total": 330,
                "dropped_stale_total": 2,
                "rejected_stale_total": 5,
            },
            "prompts_inflight": 8,
            "workers": [
                {
                    "worker_id": "gen-0",
                    "role": "generator",
                    "loaded_versions": [steps, steps + 1],
                    "last_seen_s": 0.4,
                    "notes": {"episode_error/agent": "the agent reported: boom"},
                },
                {"worker_id": "trainer", "role": "trainer", "loaded_versions": [], "last_seen_s": 0.1},
            ],
            "trainer": {"epoch": 1, "step": steps},
            "metrics": {
                "trainer": {"reward": 0.8, "sample/staleness_mean": 1.0},
                "gen-0": {"rollout/generated_tok_s": 200},
            },
            "cost": {"usd_total": 1.5, "usd_per_step": 0.0375, "waste_fraction": 0.125, "trainer_steps": steps},
        }
    )
    w.status_history = [
        {"ts": now + k, "queue": k % 5, "capacity": 64, "prompts_inflight": 8, "step": k} for k in range(40)
    ]
    return w


def test_summary_figures_and_table(tmp_path: Path) -> None:
    w = _watcher()
    assert len(w.pushes) == 120
    figures = summarize(w, 61.0, SyncLatency({2: 0.2, 3: 0.4, 4: 1.0}))
    assert figures["steps"] == 40 and figures["latest_version"] == 41
    assert figures["reward_first20"] == 0.1 and figures["reward_last20"] == 0.8
    assert abs(figures["reward_ratio"] - 8.0) < 1e-9
    assert figures["generated_tokens"] == 3000 + 1000 + 4000  # gen-0's counter restarted at step 30
    assert figures["dropped_stale_total"] == 2 and figures["sync_latency_p50_s"] == 0.4
    console = Console(record=True, width=120)
    console.print(summary_table(figures))
    text = console.export_text()
    assert "8.00x" in text and "400 / 1000 ms" in text
    # Stale groups counted as status counts them (dropped at claim / rejected at submit); an agent's failure is
    # shown as a failed episode, never as a reward error.
    assert "groups dropped stale (at claim) / rejected stale (at submit)" in text and "2 / 5" in text
    assert "first failed episode: agent" in text and "first reward error" not in text
    # What the policy does while it learns, first and last 20 steps (issue 13).
    assert (figures["completion_length_first"], figures["completion_length_last"]) == (12.0, 6.0)
    assert (figures["entropy_first"], figures["entropy_last"]) == (2.0, 1.0)
    assert figures["kl_last"] == pytest.approx(0.001 * 30.5) and figures["clip_frac_first"] == 0.05
    assert figures["truncated_frac_last"] == 0.25
    # The trained tokens' versions (partial rollouts, issue 35).
    assert figures["mixed_version_token_frac"] == pytest.approx(0.2) and figures["tokens_stale_masked_total"] == 60
    assert (figures["token_staleness_p50"], figures["token_staleness_max"]) == (1.0, 4.0)
    assert "trained tokens from mixed-version completions" in text and "20.0 %" in text and "1 / 4" in text
    for needle in ("completion length", "12.0 tokens / 6.0 tokens", "entropy", "2.000 / 1.000", "KL", "0.0305"):
        assert needle in text, needle
    assert "clipped fraction" in text and "truncated completions" in text
    assert figures["cost"]["usd_per_step"] == 0.0375 and figures["cost"]["prices"]["estimate"]
    assert "cost: total / per step / waste (list-price estimates)" in text and "$1.5 / $0.0375 / 12.5 %" in text
    assert write_summary(figures, tmp_path).exists()


def test_plots_are_written(tmp_path: Path) -> None:
    paths = plot(_watcher(), tmp_path, title="(test)")
    assert [p.name for p in paths] == ["reward.png", "pipeline.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)


def test_pipeline_plot_has_one_x_axis_per_row_and_the_learning_charts() -> None:
    import matplotlib.pyplot as plt

    fig, axes = pipeline_figure(_watcher())
    try:
        assert [{ax.get_xlabel() for ax in row} for row in axes] == [{"trainer step"}, {"trainer step"}, {"seconds"}]
        labels = {line.get_label() for ax in fig.axes for line in ax.get_lines()}
        for label in ("completion length (tokens)", "truncated (max_new_tokens)", "without a reward", "entropy"):
            assert label in labels, (label, labels)
        assert {"KL to the base model", "clipped fraction", "trainer publish", "adapter load gen-0"} <= labels
        assert {"token staleness p50", "token staleness max"} <= labels
        assert all(len(line.get_xdata()) > 0 for ax in fig.axes for line in ax.get_lines())
    finally:
        plt.close(fig)


def test_live_view_renders_state() -> None:
    w = _watcher()
    console = Console(record=True, width=140)
    console.print(
        render(
            w,
            run="demo",
            max_steps=100,
            started=time.monotonic() - 12,
            dashboard="http://127.0.0.1:1/ui?run=demo",
            services={"trainer": "running pid 1", "gen-0": "running pid 2", "gen-1": "exited -9"},
        )
    )
    text = console.export_text()
    needles = ("40/100", "policy version", "41", "0.800", "3/64 groups", "8 prompts in flight", "v40, v41", "exited -9")
    for needle in needles:
        assert needle in text, needle


def test_counter_total_handles_restarts() -> None:
    assert counter_total([]) == 0
    assert counter_total([1, 5, 9]) == 9
    assert counter_total([1, 5, 9, 2, 4, 1]) == 9 + 4 + 1


def test_summary_has_the_eval_curve_and_sample_completions(tmp_path: Path) -> None:
    w = _watcher()
    assert w.status is not None
    ev = {"prompts": 32, "samples": 32, "k": 1, "pass_at_1": 0.0, "pass_at_k": 0.0, "mean_length": 8.0}
    ev |= {"unscorable_frac": 0.0, "completed_at": 0.0}
    w.status = w.status.model_copy(
        update={
            "eval": [
                EvalVersionResult(version=1, reward_mean=0.05, **ev),
                EvalVersionResult(version=11, reward_mean=0.6, **ev),
            ],
            "samples": [SampleCompletion(version=40, prompt="even:", completion="2468", reward=1.0)],
        }
    )
    # The trainer reported v11 as its policy at step 10: v11's eval is drawn there (v1 at step 0).
    w._merge([{"worker_id": "trainer", "role": "trainer", "ts": 2e9, "step": 10, "metrics": {"policy/version": 11}}])
    figures = summarize(w, 61.0)
    assert figures["eval_curve"] == [[0.0, 0.05], [10.0, 0.6]]
    assert (figures["eval_reward_first"], figures["eval_reward_last"], figures["eval_versions"]) == (0.05, 0.6, 2)
    assert figures["samples"][0]["completion"] == "2468"
    console = Console(record=True, width=160)
    console.print(summary_table(figures))
    text = console.export_text()
    assert "0.050 / 0.600" in text and "'2468'" in text
    paths = plot(w, tmp_path)
    assert paths[0].stat().st_size > 10_000
