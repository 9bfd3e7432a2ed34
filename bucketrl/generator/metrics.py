"""The generator's metrics: thread-safe counters, turned into one flat push every ``metrics_interval_s``.

Names follow TRL's AsyncGRPOTrainer where one exists (TEAM.md):

    rollout/generated_tok_s      completion tokens sampled per second of wall time since the last push
    rollout/backpressure_s       seconds spent waiting on 429 Retry-After (prompt leases and submits) since
                                 the last push
    rollout/inflight             groups being generated, scored or submitted right now
    reward                       mean reward of the completions submitted since the last push (scored ones)
    rollout/unscorable_total     completions whose reward raised, hung or returned garbage (cumulative);
                                 rollout/unscorable_<kind>_total per kind (bucketrl.rollout.reward_kinds.FAILURE_KINDS),
                                 and the first message of each kind in ``reward_errors`` (pushed as notes)
    sync/adapter_load_s          download + verify + engine load time of the latest adapter version
    sync/adapter_version         that version
    policy/version               the version new prompts are sampled with
    rollout/groups_submitted_total, rollout/dropped_stale_total, rollout/rejected_groups_total,
    rollout/released_prompts_total, rollout/truncated_prompts_total, rollout/tokens_total,
    sync/adapter_failures_total (versions that could not be fetched or loaded and were skipped) (cumulative)
    sync/staged_fetches_total    versions taken from their staged upload, pulled before the commit (not downloaded)
    rollout/stale_abandoned_total, rollout/stale_held_prompt_s_total (cumulative), rollout/stale_guard_declining,
    rollout/call_s_max           the staleness guard's (bucketrl/generator/staleness_guard.py)

Multi-turn runs (run spec ``env``), per episode closed (bucketrl.envs):

    episode/turns_mean, episode/tool_calls_mean     model turns, tool calls per episode (since the last push)
    episode/gen_s_mean, episode/env_s_mean          seconds per episode waiting for the engine (queue and
                                                    sampling) and everything else (environment, tools, agent)
    episode/env_time_frac                           env_s / (env_s + gen_s) over those episodes
    episode/episodes_total, episode/turns_total, episode/tool_calls_total, episode/tool_errors_total (failed
    calls: unknown tool, bad arguments, the tool raised, a malformed call), episode/timeouts_total,
    episode/failed_total and episode/failed_<kind>_total (bucketrl.rollout.episodes.EPISODE_FAILURES and the reward
    kinds), episode/samples_total, episode/split_episodes_total, episode/tokens_trained_total (model tokens),
    episode/tokens_context_total (environment tokens between turns) (cumulative); the first message of each
    failure kind in ``episode_errors`` (pushed as notes ``episode_error/<kind>``);
    episode/admission_refused_total (agents answered 429 admission) and the gauges admission/step_s,
    admission/own_share (from the proxy's counts; absent until measured), admission/pending_groups, and per source
    (env, agent, agent:<name>) admission/<source>/admitted_total, refused_total, wait_s_mean, wait_s_max,
    group_life_s (bucketrl.generator.admission)
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from bucketrl.rollout.reward_kinds import Scored

if TYPE_CHECKING:
    from bucketrl.rollout.episodes import Episode
from bucketrl.wire import SampleCompletion

# Sample completions carried by one push (the newest; the proxy keeps the run's latest few dozen).
SAMPLES_PER_PUSH = 3


# MetricsPush.notes' cap.
MAX_NOTES = 16


class GeneratorMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._window_start = time.monotonic()
        self._window_tokens = 0
        self._window_backpressure_s = 0.0
        self._window_reward_sum = 0.0
        self._window_reward_n = 0
        self.inflight_groups = 0
        self.totals: dict[str, float] = {
            "rollout/groups_submitted_total": 0,
            "rollout/dropped_stale_total": 0,
            "rollout/rejected_groups_total": 0,
            "rollout/released_prompts_total": 0,
            "rollout/truncated_prompts_total": 0,
            "rollout/unscorable_total": 0,
            "rollout/tokens_total": 0,
            "sync/adapter_failures_total": 0,
        }
        self.gauges: dict[str, float] = {}
        # The first message of each reward failure kind (what status and the dashboard show).
        self.reward_errors: dict[str, str] = {}
        self._samples: deque[SampleCompletion] = deque(maxlen=SAMPLES_PER_PUSH)
        self.episode_errors: dict[str, str] = {}
        self._window_episodes = [0, 0, 0, 0.0, 0.0]  # episodes, turns, tool calls, gen_s, env_s

    def add(self, name: str, value: float = 1.0) -> None:
        with self._lock:
            self.totals[name] = self.totals.get(name, 0.0) + value

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self.gauges[name] = value

    def inflight(self, delta: int) -> None:
        with self._lock:
            self.inflight_groups += delta

    def generated(self, tokens: int) -> None:
        with self._lock:
            self._window_tokens += tokens
            self.totals["rollout/tokens_total"] += tokens

    def backpressure(self, seconds: float) -> None:
        with self._lock:
            self._window_backpressure_s += seconds

    def unscorable(self, scored: list[Scored]) -> None:
        """Count the completions without a reward, by kind, keeping each kind's first message."""
        with self._lock:
            for r in scored:
                if r.kind is None:
                    continue
                self.totals["rollout/unscorable_total"] += 1
                name = f"rollout/unscorable_{r.kind}_total"
                self.totals[name] = self.totals.get(name, 0.0) + 1
                self.reward_errors.setdefault(r.kind, r.message or r.kind)

    def reward_error(self, scored: Scored) -> None:
        """Keep the first message of a failure kind as soon as the pool sees it (counted later, by
        :meth:`unscorable`): the next heartbeat shows it while the batch is still being scored."""
        if scored.kind is None:
            return
        with self._lock:
            self.reward_errors.setdefault(scored.kind, scored.message or scored.kind)

    def episode(self, ep: Episode) -> None:
        """Count a closed episode (called from the episodes' thread)."""
        samples = ep.samples()
        trained = sum(len(ids) for s in samples for kind, ids, _ in s.segments if kind == "model")
        context = sum(len(ids) for s in samples for kind, ids, _ in s.segments if kind == "env")
        st = ep.stats
        with self._lock:
            t = self.totals
            for name, value in (
                ("episode/episodes_total", 1),
                ("episode/turns_total", st.turns),
                ("episode/tool_calls_total", st.tool_calls),
                ("episode/tool_errors_total", st.tool_errors),
                ("episode/timeouts_total", int(ep.timed_out)),
                ("episode/failed_total", int(ep.error is not None)),
                ("episode/samples_total", len(samples)),
                ("episode/split_episodes_total", int(len(samples) > 1)),
                ("episode/tokens_trained_total", trained),
                ("episode/tokens_context_total", context),
            ):
                t[name] = t.get(name, 0.0) + value
            if ep.error is not None:
                kind, message = ep.error
                t[f"episode/failed_{kind}_total"] = t.get(f"episode/failed_{kind}_total", 0.0) + 1
                self.episode_errors.setdefault(kind, message)
            w = self._window_episodes
            w[0] += 1
            w[1] += st.turns
            w[2] += st.tool_calls
            w[3] += st.gen_s
            w[4] += st.env_s

    def rewards(self, values: list[float | None]) -> None:
        scored = [v for v in values if v is not None]
        with self._lock:
            self._window_reward_sum += sum(scored)
            self._window_reward_n += len(scored)

    def sample(self, version: int, prompt: str, completion: str, reward: float | None) -> None:
        """Remember a completion (text) with its reward for the next push."""
        item = SampleCompletion(version=version, prompt=prompt[:2000], completion=completion[:4000], reward=reward)
        with self._lock:
            self._samples.append(item)

    def take_samples(self) -> list[SampleCompletion]:
        with self._lock:
            out = list(self._samples)
            self._samples.clear()
            return out

    def notes(self) -> dict[str, str]:
        """The heartbeat's notes: the reward and episode errors seen (MetricsPush.notes' cap)."""
        return dict(
            [
                *((f"reward_error/{kind}", text) for kind, text in self.reward_errors.items()),
                *((f"episode_error/{kind}", text) for kind, text in self.episode_errors.items()),
            ][:MAX_NOTES]
        )

    def snapshot(self) -> dict[str, float]:
        """The flat map to push; starts a new window for the windowed values."""
        with self._lock:
            now = time.monotonic()
            elapsed = max(now - self._window_start, 1e-6)
            out = dict(self.totals)
            out.update(self.gauges)
            out["rollout/generated_tok_s"] = self._window_tokens / elapsed
            out["rollout/backpressure_s"] = self._window_backpressure_s
            out["rollout/inflight"] = float(self.inflight_groups)
            if self._window_reward_n:
                out["reward"] = self._window_reward_sum / self._window_reward_n
            n, turns, calls, gen_s, env_s = self._window_episodes
            if n:
                out["episode/turns_mean"] = turns / n
                out["episode/tool_calls_mean"] = calls / n
                out["episode/gen_s_mean"] = gen_s / n
                out["episode/env_s_mean"] = env_s / n
                out["episode/env_time_frac"] = env_s / max(env_s + gen_s, 1e-9)
                self._window_episodes = [0, 0, 0, 0.0, 0.0]
            self._window_start = now
            self._window_tokens = 0
            self._window_backpressure_s = 0.0
            self._window_reward_sum = 0.0
            self._window_reward_n = 0
            return out
