"""What the trainer reports beside its metrics: the eval results it pushes once per evaluated version, the watch
on completions without a reward, and the step's log line."""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

from bucketrl import errors, preflight
from bucketrl.client import ProxyClient
from bucketrl.wire import EPISODE_ERROR_PREFIX, Delivery, EvalVersionResult

# The worker's logger: these lines read as they did when this code was part of the worker.
log = logging.getLogger("bucketrl.trainer")

# Steps over which the share of completions without a reward is compared with max_unscorable_fraction (and the
# share of failed episodes with max_failed_episode_fraction).
UNSCORABLE_WINDOW = 3
# Over this share of failed episodes the trainer warns each step (the agents mostly fail), below the stop's limit.
FAILED_EPISODES_WARN = 0.5
# The checkpointed counter of the newest evaluated version the trainer has reported (new_eval_metrics).
EVAL_REPORTED = "eval/reported_version"


class EvalReports:
    """The eval results to report, each version once: the newest reported is ``counters[EVAL_REPORTED]`` (the
    trainer's checkpointed counters, shared with it)."""

    def __init__(self, counters: dict[str, float]) -> None:
        self.counters = counters

    def new_metrics(self, client: ProxyClient) -> dict[str, float]:
        """The oldest evaluated version not reported yet, once (uploader thread): pushed with this step's metrics,
        so it reaches the proxy's history and every tracker at the step it became known (``eval/version`` says
        which policy it measures). One per step, oldest first: when several versions finished since the last
        push (eval faster than training), each is reported at a step of its own; versions are published at most
        once per step, so the reports keep up. The newest version reported is a checkpointed counter (stored by
        the checkpoint job, after the pushes before it): a resumed trainer reports none of them again. A version
        whose evaluation finishes after a newer one was reported is not reported (it is in the bucket, the status
        and the dashboard's table)."""
        results = eval_results(client)
        return {} if results is None else self.report(results, newest=False)

    def report(self, results: list[EvalVersionResult], *, newest: bool) -> dict[str, float]:
        """The eval metrics of the oldest (or newest) version not reported yet, marked reported; {} if none."""
        done = self.counters.get(EVAL_REPORTED, 0.0)
        new = [e for e in results if e.version > done]
        if not new:
            return {}
        e = (max if newest else min)(new, key=lambda r: r.version)
        self.counters[EVAL_REPORTED] = float(e.version)
        out = {
            "eval/version": float(e.version),
            "eval/pass@1": e.pass_at_1,
            f"eval/pass@{e.k}": e.pass_at_k,
            "eval/mean_length": e.mean_length,
            "eval/unscorable_frac": e.unscorable_frac,
        }
        if e.reward_mean is not None:
            out["eval/reward"] = e.reward_mean
        return out

    def final_metrics(
        self, client: ProxyClient, final: int, wait_s: float, stop_requested: threading.Event
    ) -> dict[str, float]:
        """The newest version not reported yet, after waiting up to ``wait_s`` for ``final``'s evaluation."""
        if wait_s > 0:
            log.info("waiting up to %.0f s for the evaluation of the final version v%d", wait_s, final)
        deadline = time.monotonic() + wait_s
        while True:
            results = eval_results(client)
            if results is None:
                return {}
            if any(e.version == final for e in results) or time.monotonic() >= deadline:
                break
            if stop_requested.wait(1.0):
                break
        if wait_s > 0 and not any(e.version == final for e in results):
            log.warning("v%d was not evaluated within %.0f s (BUCKETRL_FINAL_EVAL_WAIT_S)", final, wait_s)
        return self.report(results, newest=True)


def eval_results(client: ProxyClient) -> list[EvalVersionResult] | None:
    try:
        return client.eval_results()
    except errors.BucketRLError as exc:
        log.warning("eval results not read: %s", exc.message)
        return None


class RewardWatch:
    """Completions the reward could not score, and episodes that failed, over the last steps (each failure kind's
    first message kept). The two are apart: an aborted episode (the agent's error, a timeout, the turn limit) was
    never given to the reward, so it never counts against it."""

    def __init__(self, max_unscorable_fraction: float, max_failed_episode_fraction: float = 1.0) -> None:
        self.limit = max_unscorable_fraction
        self.episode_limit = max_failed_episode_fraction
        self.unscorable: list[tuple[int, int]] = []  # (completions given to the reward, without a reward) per step
        self.failed: list[tuple[int, int]] = []  # (episodes, aborted) per step
        self.reward_errors: dict[str, str] = {}  # the first message of each reward failure kind seen
        self.episode_errors: dict[str, str] = {}  # the first message of each episode failure kind seen

    def check(self, deliveries: list[Delivery], reward_name: str) -> None:
        """Count the step's completions the reward could not score and its failed episodes; stop the run (exit 2)
        when over the last UNSCORABLE_WINDOW steps (fewer at the start of a run) more than
        ``max_unscorable_fraction`` of the scored ones had no reward, or more than ``max_failed_episode_fraction``
        of the episodes failed."""
        scored = unscorable = episodes = failed = 0
        for d in deliveries:
            for g in d.groups:
                results = g.episode_results()  # a split episode counts once
                aborted = sum(c.finish_reason == "abort" for c in results)
                scored += len(results) - aborted
                unscorable += sum(c.reward is None and c.finish_reason != "abort" for c in results)
                if any(c.segments is not None for c in g.completions):
                    episodes, failed = episodes + len(results), failed + aborted
                for kind, message in g.reward_errors.items():
                    if kind.startswith(EPISODE_ERROR_PREFIX):
                        self.episode_errors.setdefault(kind.removeprefix(EPISODE_ERROR_PREFIX), message)
                    else:
                        self.reward_errors.setdefault(kind, message)
        self.unscorable = [*self.unscorable[-(UNSCORABLE_WINDOW - 1) :], (scored, unscorable)]
        self.failed = [*self.failed[-(UNSCORABLE_WINDOW - 1) :], (episodes, failed)]
        self._check_episodes()
        seen = sum(t for t, _ in self.unscorable)
        bad = sum(u for _, u in self.unscorable)
        if seen and bad / seen > self.limit:
            kinds = "; ".join(f"{k}: {m}" for k, m in self.reward_errors.items()) or "no message"
            raise preflight.ConfigError(
                f"the reward ({reward_name}) could not score {bad}/{seen} completions "
                f"of the last {len(self.unscorable)} step(s), over BUCKETRL_MAX_UNSCORABLE_FRACTION={self.limit:g}: "
                f"{kinds}"
            )

    def _check_episodes(self) -> None:
        seen = sum(t for t, _ in self.failed)
        bad = sum(u for _, u in self.failed)
        if not seen or bad / seen <= FAILED_EPISODES_WARN:
            return
        kinds = "; ".join(f"{k}: {m}" for k, m in self.episode_errors.items()) or "no message"
        what = f"{bad}/{seen} episodes of the last {len(self.failed)} step(s) failed before the reward saw them"
        if bad / seen > self.episode_limit:
            raise preflight.ConfigError(
                f"the agent (or environment) is failing: {what} (not trained), over "
                f"BUCKETRL_MAX_FAILED_EPISODE_FRACTION={self.episode_limit:g}: {kinds}. The reward is not at fault: "
                "fix the agent (or raise the limit)"
            )
        log.warning("most episodes fail in the agent (or environment), not the reward: %s: %s", what, kinds)

    def last_fraction(self) -> float:
        """The share of the last step's completions given to the reward that it could not score."""
        return self.unscorable[-1][1] / max(1, self.unscorable[-1][0])

    def last_failed_fraction(self) -> float | None:
        """The share of the last step's episodes that failed (None: no episodes)."""
        episodes, failed = self.failed[-1] if self.failed else (0, 0)
        return failed / episodes if episodes else None


def log_step(step: int, max_steps: int, stats: dict[str, float], wait_s: float) -> None:
    """The step's log line; multi-turn steps also say how many tokens were trained of those in context, and the
    turns per episode."""
    turns = stats.get("episodes/turns_mean")
    extra = ""
    if turns is not None:
        trained, context = stats.get("train/tokens", 0.0), stats.get("train/tokens_context", 0.0)
        extra = f" tokens trained {trained:.0f} of {context:.0f} in context, turns {turns:.2f}"
        calls = stats.get("episodes/tool_calls_mean")
        if calls is not None:
            extra += f", tool calls {calls:.2f} (errors {stats['episodes/tool_errors']:.0f})"
            frac = stats.get("episodes/env_time_frac")
            if frac is not None:
                extra += f", env time {frac:.0%}"
    log.info(
        "step %d/%d loss %.4f reward %.3f staleness %.2f wait %.2fs step %.2fs%s",
        step,
        max_steps,
        stats.get("train/loss", 0.0),
        stats.get("reward", math.nan),
        stats.get("sample/staleness_mean", math.nan),
        wait_s,
        stats["perf/step_s"],
        extra,
    )


def step_audit(stats: dict[str, float]) -> dict[str, Any]:
    """A step's figures in its audit record: its forward/backward time and, when the step reported them, the
    per-token version figures (partial rollouts, :mod:`bucketrl.trainer.token_versions`) under ``tokens``."""
    out: dict[str, Any] = {"fwd_bwd_s": stats["perf/fwd_bwd_s"]}
    tokens = {k.removeprefix("tokens/"): v for k, v in stats.items() if k.startswith("tokens/")}
    if tokens:
        out["tokens"] = tokens
    return out
