"""Long, heavy-tailed completions under a fast trainer: today's guard vs. finishing old vs. partial rollouts (issue 35).

    .venv/bin/python bench/long_tail.py                                  # 4 generators, 40 s per mode
    .venv/bin/python bench/long_tail.py --duration-s 90 --modes guard,partial --json /tmp/long_tail.json

Built from ``bench/preemption.py``'s pieces (fleet of real ``bucketrl generator`` processes on the simulated engine,
the proxy on a thread of this process, ``redis-server``), with its own trainer stand-in. Completion lengths are
lognormal (median ``--length-median``, shape ``--length-sigma``, half of the log-variance the prompt's own:
a hard prompt is long again when it is sampled again) capped at ``--max-new-tokens`` (3,000), so a call
(2 prompts x G=4) ends when the longest of 8 ends; the trainer's step (``--step-s``) is far shorter than the longest
call, so versions come while long calls run. The version pace is set by the groups the fleet delivers, so the
window's length in time goes as ``--groups-per-step`` / ``--generators``: with the defaults (4 generators, 5 groups a
step) the longest call (a 3,000-token completion, ~12 s) lasts about twice the staleness window (4 versions); each
mode prints its own measured ratio (``longest_call_over_window``: the longest call that ran to its end, from the
generators' ``rollout/call_s_max``, over 4 x the mode's seconds per version). Modes (one proxy, bucket and
fleet each, run one after the other):

- ``guard``: ``max_staleness`` 4, the staleness guard on (today): a call whose version leaves the window is
  abandoned and its prompts requeued; its decoded tokens are wasted.
- ``finish``: the window wide enough (``--finish-window``) that every call finishes and is accepted on its old
  version: nothing is wasted to staleness, but tokens are trained that many versions old.
- ``partial``: ``max_staleness`` 4 with ``partial_rollouts``: an overtaken call goes on under the newer version
  (the simulated engine charges each continuation's prefill: the prompt plus the completion so far).

The trainer stand-in claims ``--groups-per-step`` groups (``min_version`` = latest - window: the proxy drops stale
groups at claim), trains every token whose version (``Completion.token_versions``: partial rollouts' spans) is in
the window and masks the rest (counted as wasted), sleeps ``--step-s``, acks and publishes the next version.

Per mode it prints: trained tokens/s over the measured window, tokens decoded (the engines' count, cut calls
included, step by step) and wasted to staleness (decoded and never trained), the trained tokens' staleness (latest
version at training - the token's version; p50 and max), the trainer's idle share (waiting for groups),
continuations, and groups lost or trained twice (both must be 0). Where the waste goes: tokens the trainer masked
(``tokens_masked_by``: in continued completions, in their finished group mates, in groups with no continued
completion; ``tokens_masked_before_submit``: already out of the window at the batch's own version, the rest aged out
between the batch's last version and its training, ``claim_lag_versions_mean`` versions on average) and tokens never
trained (``tokens_wasted_untrained``: abandoned calls, batches refused stale at submit or dropped at claim, calls cut
at shutdown).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from bench.preemption import RUN, Fleet, _drain_queue
from bucketrl.tasks.tiny_model import build_tiny_model
from bucketrl.wire import DatasetSpec, RewardSpec, RunSpec, SamplingSpec
from tests.generator.helpers import run_spec
from tests.proxy.harness import ProxyHarness, adapter_tar, running
from tests.support.services import RedisServer

GROUP, STALENESS = 4, 4
# Masked tokens by their completion: ``continued`` (sampled by several versions: the early part of a long one),
# ``group_mate`` (one version, in a group with a continued one: it ended early and waited for its group's longest),
# ``whole_group`` (one version, in a group with no continued completion: it waited for its batch or in the queue).
MASKED_KINDS = ("continued", "group_mate", "whole_group")


class Trainer(threading.Thread):
    """Claims a step's groups, trains the tokens in the window (masks the rest), acks, publishes v+1."""

    def __init__(self, proxy: ProxyHarness, groups_per_step: int, step_s: float, window: int) -> None:
        super().__init__(daemon=True, name="trainer")
        self.client = proxy.client(RUN, "trainer", retries=3)
        self.client.register_trainer("trainer")
        self.client.publish_adapter(1, adapter_tar(1))
        self.groups_per_step, self.step_s, self.window = groups_per_step, step_s, window
        self.stop, self.version, self.steps = threading.Event(), 1, 0
        self.trained_tokens = self.masked_tokens = self.mixed_tokens = 0
        # Masked tokens by where they were in their group (see ``masked_by``) and by when they left the window:
        # already as of the batch's own version (stale before it was submitted) or only by the time it was trained.
        self.masked_by = dict.fromkeys(MASKED_KINDS, 0)
        self.masked_before_submit = 0
        self.claim_lag: list[int] = []  # per group trained: the trainer's version - the batch's (queue time)
        self.staleness: list[np.ndarray] = []  # per trained token: latest - its version (measured window only)
        self.prompts: list[str] = []
        self.idle_s = 0.0
        self.idle_since: float | None = None
        self.measuring = False
        self.window_tokens = 0

    def run(self) -> None:
        while not self.stop.is_set():
            got, ids = [], []
            t0 = time.monotonic()
            while len(got) < self.groups_per_step and not self.stop.is_set():
                want = self.groups_per_step - len(got)
                claim = self.client.claim("trainer", want, wait_s=0.5, min_version=max(1, self.version - self.window))
                self.idle_since = None if claim.deliveries else (self.idle_since or time.monotonic())
                for d in claim.deliveries:
                    got += [(g, d.version) for g in d.groups]
                    ids.append(d.delivery_id)
            if self.measuring:
                self.idle_s += time.monotonic() - t0
            if not got:
                continue
            time.sleep(self.step_s)
            self.client.ack(ids)
            for g, version in got:
                self.prompts.append(g.prompt_id)
                self.claim_lag.append(self.version - version)
                group_mixed = any(c.version_spans is not None and len(c.version_spans) > 1 for c in g.completions)
                for c in g.completions:
                    tv = np.asarray(c.token_versions(version))
                    keep = tv >= self.version - self.window
                    n = int(keep.sum())
                    self.trained_tokens += n
                    self.masked_tokens += len(tv) - n
                    mixed = c.version_spans is not None and len(c.version_spans) > 1
                    if mixed:
                        self.mixed_tokens += n
                    kind = "continued" if mixed else "group_mate" if group_mixed else "whole_group"
                    self.masked_by[kind] += len(tv) - n
                    self.masked_before_submit += int((tv < version - self.window).sum())
                    if self.measuring:
                        self.window_tokens += n
                        self.staleness.append(self.version - tv[keep])
            self.version += 1
            self.client.publish_adapter(self.version, adapter_tar(self.version))
            self.steps += 1


def mode_spec(mode: str, model_dir: Path, args: argparse.Namespace) -> RunSpec:
    spec = run_spec(
        model_dir,
        group_size=GROUP,
        max_staleness=args.finish_window if mode == "finish" else STALENESS,
        groups_per_step=args.groups_per_step,
        queue_capacity_groups=4 * args.groups_per_step,
        sampling=SamplingSpec(temperature=1.0, max_new_tokens=args.max_new_tokens),
        reward=RewardSpec(name="exact"),
        dataset=DatasetSpec(uri="toy:digits", size=20_000),
    )
    return spec.model_copy(update={"partial_rollouts": mode == "partial"})


def scenario(mode: str, args: argparse.Namespace, model_dir: Path, tmp: Path) -> dict[str, Any]:
    server = RedisServer(tmp / f"redis-{mode}", persistent=False).start()
    logs = tmp / f"logs-{mode}"
    logs.mkdir()
    env = {
        "BUCKETRL_MAX_MODEL_LEN": str(args.max_new_tokens + 512),
        "BUCKETRL_SIM_LENGTH_MEDIAN": str(args.length_median),
        "BUCKETRL_SIM_LENGTH_SIGMA": str(args.length_sigma),
        "BUCKETRL_SIM_LENGTH_PROMPT_SHARE": str(args.length_prompt_share),
        "BUCKETRL_SIM_DECODE_STEP_PER_SEQ_S": "0.00005",
        "BUCKETRL_SIM_PREFILL_TOKENS_PER_S": str(args.prefill_tokens_per_s),
        "BUCKETRL_STALENESS_GUARD": "true",
    }
    spec = mode_spec(mode, model_dir, args)
    try:
        with running(server.url, f"file://{tmp}/bucket-{mode}") as proxy:
            proxy.client(RUN, "trainer").put_run(spec)
            trainer = Trainer(proxy, args.groups_per_step, args.step_s, spec.max_staleness)
            fleet = Fleet(proxy, model_dir, logs, args, classes=[("h100", 3.0, args.decode_step_s)], env=env)
            for slot in range(args.generators):
                fleet.start(slot)
            trainer.start()
            try:
                window_s, steps = _measure(fleet, trainer, args)
            finally:
                fleet.stop_all(timeout_s=60)  # SIGINT: they submit what they hold (killed if not done by then)
            _drain_queue(trainer)
            status = proxy.client(RUN, "viewer").status()
    finally:
        server.kill()
    return figures(mode, spec.max_staleness, fleet, trainer, status, window_s, steps)


def _measure(fleet: Fleet, trainer: Trainer, args: argparse.Namespace) -> tuple[float, int]:
    """Warm up (the fleet up, a first step), then measure ``duration_s``: the window's seconds and steps."""
    deadline = time.monotonic() + 120
    while trainer.steps < 1 and time.monotonic() < deadline:  # warm-up: the fleet up, a first step
        fleet.observe()
        time.sleep(0.5)
    trainer.measuring, t0, steps0 = True, time.monotonic(), trainer.steps
    while time.monotonic() < t0 + args.duration_s:
        fleet.observe()
        time.sleep(0.5)
    trainer.measuring, window_s = False, time.monotonic() - t0
    return window_s, trainer.steps - steps0


def figures(
    mode: str, max_staleness: int, fleet: Fleet, trainer: Trainer, status: Any, window_s: float, steps: int
) -> dict[str, Any]:
    q = status.queue
    decoded = fleet.tokens_decoded()
    stale = np.concatenate(trainer.staleness) if trainer.staleness else np.zeros(0)
    metric = lambda name: sum(m.get(name, 0.0) for m in fleet.metrics.values())  # noqa: E731
    # The longest call that ran to its end (with the guard, calls past the window were abandoned: a lower bound)
    # against the staleness window's length in time (STALENESS versions at the mode's pace).
    longest = max((m.get("rollout/call_s_max", 0.0) for m in fleet.metrics.values()), default=0.0)
    version_s = window_s / max(1, steps)
    return {
        "mode": mode,
        "max_staleness": max_staleness,
        "trained_tokens_per_s": round(trainer.window_tokens / window_s, 1),
        "steps_per_s": round(steps / window_s, 3),
        "tokens_decoded": int(decoded),
        "tokens_trained": trainer.trained_tokens,
        "tokens_wasted_stale": int(max(0.0, decoded - trainer.trained_tokens)),
        "tokens_masked": trainer.masked_tokens,
        "tokens_masked_by": trainer.masked_by,
        "tokens_masked_before_submit": trainer.masked_before_submit,
        # Decoded and never seen by the trainer: abandoned calls, groups dropped stale, calls cut at shutdown.
        "tokens_wasted_untrained": int(max(0.0, decoded - trainer.trained_tokens - trainer.masked_tokens)),
        "claim_lag_versions_mean": round(float(np.mean(trainer.claim_lag)), 2) if trainer.claim_lag else None,
        "longest_call_s": round(longest, 2),
        "version_interval_s": round(version_s, 3),
        "longest_call_over_window": round(longest / (STALENESS * version_s), 2),
        "mixed_version_share": round(trainer.mixed_tokens / max(1, trainer.trained_tokens), 3),
        "token_staleness_p50": float(np.percentile(stale, 50)) if stale.size else None,
        "token_staleness_max": int(stale.max()) if stale.size else None,
        "trainer_idle_share": round(trainer.idle_s / window_s, 3),
        "stale_abandoned_groups": metric("rollout/stale_abandoned_total"),
        "continuations": metric("rollout/continuations_total"),
        "stale_at_claim": q.dropped_stale_total,
        "stale_at_submit": int(sum(fleet.stale_at_submit.values())),
        "groups_lost": q.accepted_total - (q.acked_total + q.dropped_stale_total + q.groups + q.pending),
        "groups_trained_twice": len(trainer.prompts) - len(set(trainer.prompts)),
        "window_s": round(window_s, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--generators", type=int, default=4)
    p.add_argument("--duration-s", type=float, default=40.0, help="measured window per mode (after the warm-up)")
    p.add_argument("--modes", default="guard,finish,partial")
    p.add_argument("--groups-per-step", type=int, default=5)
    p.add_argument("--step-s", type=float, default=0.5, help="the stand-in trainer's time per step")
    p.add_argument("--max-new-tokens", type=int, default=3000)
    p.add_argument("--length-median", type=float, default=150.0)
    p.add_argument("--length-sigma", type=float, default=1.2)
    p.add_argument(
        "--length-prompt-share",
        type=float,
        default=0.5,
        help="share of the log-length variance that is the prompt's: a requeued hard prompt is long again",
    )
    p.add_argument("--decode-step-s", type=float, default=0.004, help="the simulated GPU's decode step")
    p.add_argument("--prefill-tokens-per-s", type=float, default=20000.0)
    p.add_argument("--finish-window", type=int, default=64, help="finish mode's max_staleness")
    p.add_argument("--metrics-interval-s", type=float, default=0.5)
    p.add_argument("--prompt-lease-ttl-s", type=float, default=30.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bucketrl-long-tail-"))
    model_dir = build_tiny_model(tmp / "model")
    # The simulated engine holds no model (the tiny one gives the tokenizer and the checks): room for 3,000 tokens.
    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = args.max_new_tokens + 512
    (model_dir / "config.json").write_text(json.dumps(config))
    by_mode: dict[str, dict[str, Any]] = {}
    for mode in args.modes.split(","):
        t0 = time.monotonic()
        r = scenario(mode, args, model_dir, tmp)
        r["wall_s"] = round(time.monotonic() - t0, 1)
        print(json.dumps(r), flush=True)
        by_mode[mode] = r
    for mode, r in by_mode.items():
        print(
            f"{mode}: longest call {r['longest_call_s']:.1f} s = {r['longest_call_over_window']:.2f}x the window "
            f"({STALENESS} versions x {r['version_interval_s']:.2f} s); masked {r['tokens_masked']:,} "
            f"({r['tokens_masked_before_submit']:,} already stale at submit; by completion {r['tokens_masked_by']}), "
            f"never trained {r['tokens_wasted_untrained']:,} (abandoned {r['stale_abandoned_groups']:.0f} groups, "
            f"refused stale at submit {r['stale_at_submit']}, dropped stale at claim {r['stale_at_claim']})",
            flush=True,
        )
    if "guard" in by_mode and "partial" in by_mode:
        g, pr = by_mode["guard"], by_mode["partial"]
        speed = pr["trained_tokens_per_s"] / max(g["trained_tokens_per_s"], 1e-9)
        waste = pr["tokens_wasted_stale"] / max(g["tokens_wasted_stale"], 1)
        print(f"partial / guard: trained tokens/s {speed:.2f}x, tokens wasted to staleness {waste:.2f}x", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"by_mode": by_mode, "args": vars(args) | {"json": str(args.json)}}, indent=2))


if __name__ == "__main__":
    main()
