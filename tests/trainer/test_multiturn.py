"""Multi-turn trajectories in the trainer (docs/design.md "Multi-turn trajectories"): the forward covers the whole
sequence, the loss only the model tokens, the token normaliser counts only trained tokens, a split episode's
samples share their episode's advantage, single-turn training is unchanged, and the generator engine's behaviour
logprobs on a multi-turn conversation match the trainer's recomputation within 1e-3 on every model token."""

from __future__ import annotations

import logging
import math
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from bucketrl.trainer.advantages import group_advantages
from bucketrl.trainer.batching import collate, trained_mask
from bucketrl.trainer.learner import MISMATCH_PREFIX, Learner, StepGroup
from bucketrl.trainer.loss import LossBatch, grpo_loss
from bucketrl.trainer.recompute import model_token_gaps, recompute_logprobs
from bucketrl.trainer.settings import TrainerSettings
from bucketrl.trainer.worker import EXIT_OK, TrainerWorker
from bucketrl.wire import Completion, LossSpec, RolloutGroup, SamplingSpec
from tests.proxy.harness import TOKENS, running
from tests.support.services import RedisServer
from tests.trainer.fake_generator import FakeGenerator
from tests.trainer.helpers import EOS, settings, tiny_spec
from tests.trainer.test_model import perturb_adapter
from tests.trainer.test_worker import spec_json

PROMPT = [5, 6, 7, 8]


def _lps(rng: random.Random, n: int) -> list[float]:
    return [-3.9 - 0.4 * rng.random() for _ in range(n)]


def _learner(model_dir: Path, **spec_kw: object) -> Learner:
    learner = Learner(tiny_spec(model_dir, group_size=2, **spec_kw), settings(micro_token_budget=64))
    perturb_adapter(learner.policy, seed=3, scale=0.3)
    return learner


def _grads(learner: Learner, groups: list[RolloutGroup]) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One step's loss and LoRA gradients (the optimizer does not step: the weights stay put)."""
    learner.optimizer.zero_grad(set_to_none=True)
    samples, stats = learner.build_samples([StepGroup(g, 1, "gen") for g in groups])
    stats.update(learner._accumulate(samples, 1, {}))
    grads = {n: p.grad.detach().clone() for n, p in learner.policy.model.named_parameters() if p.grad is not None}
    learner.optimizer.zero_grad(set_to_none=True)
    return stats, grads


def _assert_same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=1e-4, msg=name)
    assert any(float(g.abs().max()) > 0 for g in a.values()), "the step must have a gradient to compare"


def _episodes(rng: random.Random) -> list[tuple[list[int], list[int], list[int], float]]:
    """Two episodes (m1, env, m2, reward); the first model turn of episode 0 has an EOS mid-turn."""
    return [([9, EOS, 11], [20, 21], [12, 13], 1.0), ([14, 15, 16], [22, 23, 24], [17], 0.0)]


def test_env_tokens_are_context_only_the_extension_and_the_split_form_train_identically(tiny_model_dir: Path) -> None:
    """A multi-turn sample (prompt | m1 | env | m2) and the same episode split in two samples (prompt | m1, then
    prompt + m1 + env | m2) put every model token in the same context: the same loss and gradients. So env
    tokens reach the loss only as context, and a split episode's samples carry their episode's advantage."""
    rng = random.Random(0)
    learner = _learner(tiny_model_dir)
    eps = _episodes(rng)
    behaviour = [(_lps(rng, len(m1)), _lps(rng, len(m2))) for m1, _, m2, _ in eps]
    joined = RolloutGroup(
        prompt_id="0-0",
        prompt_index=0,
        prompt_token_ids=PROMPT,
        completions=[
            Completion.from_segments([("model", m1, b1), ("env", env, None), ("model", m2, b2)], r)
            for (m1, env, m2, r), (b1, b2) in zip(eps, behaviour, strict=True)
        ],
    )
    split = RolloutGroup(
        prompt_id="0-0",
        prompt_index=0,
        prompt_token_ids=PROMPT,
        completions=[
            c
            for e, ((m1, env, m2, r), (b1, b2)) in enumerate(zip(eps, behaviour, strict=True))
            for c in (
                Completion.from_segments([("model", m1, b1)], r, episode=e),
                Completion.from_segments([("model", m2, b2)], r, episode=e, prompt_token_ids=PROMPT + m1 + env),
            )
        ],
    )
    stats_a, grads_a = _grads(learner, [joined])
    stats_b, grads_b = _grads(learner, [split])
    # Trained tokens: m1 up to its EOS (2 + 3) and m2 (2 + 1); never the env tokens.
    assert stats_a["train/tokens"] == stats_b["train/tokens"] == 8.0
    assert stats_a["train/loss"] == pytest.approx(stats_b["train/loss"], rel=1e-5, abs=1e-7)
    _assert_same_grads(grads_a, grads_b)
    assert (stats_a["train/tokens_env"], stats_b["train/tokens_env"]) == (5.0, 0.0)
    assert stats_a["train/tokens_context"] == 2 * len(PROMPT) + sum(len(m1 + env + m2) for m1, env, m2, _ in eps)
    assert stats_a["episodes/turns_mean"] == stats_b["episodes/turns_mean"] == 2.0
    assert (stats_a["episodes/samples_per_episode"], stats_b["episodes/samples_per_episode"]) == (1.0, 2.0)
    assert stats_a["reward"] == stats_b["reward"] == 0.5  # over 2 episodes, not over 4 samples


def test_env_positions_carry_no_loss_whatever_their_placeholders(tiny_model_dir: Path) -> None:
    rng = random.Random(1)
    learner = _learner(tiny_model_dir)
    group = RolloutGroup(
        prompt_id="0-0",
        prompt_index=0,
        prompt_token_ids=PROMPT,
        completions=[
            Completion.from_segments(
                [("model", m1, _lps(rng, len(m1))), ("env", env, None), ("model", m2, _lps(rng, len(m2)))], r
            )
            for m1, env, m2, r in _episodes(rng)
        ],
    )
    samples, _ = learner.build_samples([StepGroup(group, 1, "gen")])
    assert [s.loss_mask for s in samples] == [(1, 1, 0, 0, 0, 1, 1), (1, 1, 1, 0, 0, 0, 1)]
    # Garbage behaviour logprobs at env positions (never on the wire: placeholders) change nothing.
    garbage = [
        replace(
            s, behaviour_logprobs=[b if m else -50.0 for b, m in zip(s.behaviour_logprobs, s.loss_mask, strict=True)]
        )
        for s in samples
        if s.loss_mask is not None
    ]
    learner.optimizer.zero_grad(set_to_none=True)
    out_a = learner._accumulate(samples, 1, {})
    grads_a = {n: p.grad.clone() for n, p in learner.policy.model.named_parameters() if p.grad is not None}
    learner.optimizer.zero_grad(set_to_none=True)
    out_b = learner._accumulate(garbage, 1, {})
    grads_b = {n: p.grad.clone() for n, p in learner.policy.model.named_parameters() if p.grad is not None}
    assert out_a["train/loss"] == out_b["train/loss"] and out_a["train/tokens"] == 8.0
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    # And the loss has exactly zero gradient with respect to the logprob of an env token.
    mb = collate(samples, learner.policy.pad_id)
    lp = (mb.behaviour + 0.05).requires_grad_(True)
    grpo_loss(
        LossBatch(logprobs=lp, behaviour_logprobs=mb.behaviour, advantages=torch.tensor([1.0, -1.0]), mask=mb.mask),
        LossSpec(),
    ).loss.backward()
    assert lp.grad is not None
    assert float(lp.grad[mb.mask == 0].abs().max()) == 0.0 and float(lp.grad[mb.mask == 1].abs().min()) > 0.0


def test_token_normaliser_counts_only_trained_tokens(tiny_model_dir: Path) -> None:
    """Behaviour logprobs = the trainer's own (ratio 1): each trained token's loss is -A, and the step's loss is
    exactly -sum(A_i * trained_i) / sum(trained_i); counting env tokens would change the denominator."""
    rng = random.Random(2)
    learner = _learner(tiny_model_dir)
    eps = _episodes(rng)

    def build(lps: list[list[float]] | None) -> RolloutGroup:
        comps = []
        for i, (m1, env, m2, r) in enumerate(eps):
            got = lps[i] if lps else [-1.0] * len(m1 + env + m2)
            b1, b2 = got[: len(m1)], got[len(m1) + len(env) :]
            comps.append(Completion.from_segments([("model", m1, b1), ("env", env, None), ("model", m2, b2)], r))
        return RolloutGroup(prompt_id="0-0", prompt_index=0, prompt_token_ids=PROMPT, completions=comps)

    group = build(recompute_logprobs(learner.policy, build(None)))
    assert max(model_token_gaps(learner.policy, group)) < 1e-5
    stats, _ = _grads(learner, [group])
    adv = group_advantages([r for *_, r in eps]).advantages
    trained = [sum(trained_mask(c, learner.policy.eos_token_ids)) for c in group.completions]
    assert trained == [4, 4]
    expected = -sum(a * n for a, n in zip(adv, trained, strict=True)) / sum(trained)
    assert stats["train/loss"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert stats["train/tokens"] == 8.0 and stats["ratio"] == pytest.approx(1.0, abs=1e-5)


def test_a_single_model_segment_trains_like_a_single_turn_completion(tiny_model_dir: Path) -> None:
    rng = random.Random(3)
    learner = _learner(tiny_model_dir, loss=LossSpec(objective="gspo", aggregation="sequence"))
    tokens = [[9, 10, EOS, 30], [11, 12, 13]]
    lps = [_lps(rng, len(t)) for t in tokens]
    flat = RolloutGroup(
        prompt_id="0-0",
        prompt_index=0,
        prompt_token_ids=PROMPT,
        completions=[
            Completion(token_ids=t, logprobs=lp, reward=float(i))
            for i, (t, lp) in enumerate(zip(tokens, lps, strict=True))
        ],
    )
    segmented = flat.model_copy(
        update={
            "completions": [
                Completion.from_segments([("model", c.token_ids, c.logprobs)], c.reward) for c in flat.completions
            ]
        }
    )
    stats_a, grads_a = _grads(learner, [flat])
    stats_b, grads_b = _grads(learner, [segmented])
    assert stats_a["train/loss"] == stats_b["train/loss"] and stats_a["train/tokens"] == stats_b["train/tokens"] == 6.0
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    assert "episodes/turns_mean" not in stats_a and stats_b["episodes/turns_mean"] == 1.0


def test_split_episode_advantages_and_exclusions_are_per_episode(tiny_model_dir: Path) -> None:
    learner = _learner(tiny_model_dir, loss=LossSpec(mask_truncated_completions=True))
    seg = [("model", [9, 10], [-1.0, -1.0])]
    group = RolloutGroup(
        prompt_id="0-0",
        prompt_index=0,
        prompt_token_ids=PROMPT,
        completions=[
            Completion.from_segments(seg, 1.0, episode=0),
            Completion.from_segments(seg, 1.0, episode=0, prompt_token_ids=[5, 6]),
            Completion.from_segments(seg, 1.0, episode=0, prompt_token_ids=[5, 7]),
            Completion.from_segments(seg, 0.0, episode=1),
        ],
    )
    samples, stats = learner.build_samples([StepGroup(group, 1, "gen")])
    adv = group_advantages([1.0, 0.0]).advantages  # over the 2 episodes, not the 4 samples
    assert [s.advantage for s in samples] == [adv[0]] * 3 + [adv[1]]
    assert [s.prompt_ids for s in samples] == [PROMPT, [5, 6], [5, 7], PROMPT]
    assert (stats["episodes/samples_per_episode"], stats["episodes/turns_max"], stats["reward"]) == (2.0, 3.0, 0.5)
    # An aborted or (with mask_truncated_completions) truncated episode: none of its samples is trained.
    for reason in ("abort", "length"):
        cut = group.model_copy(
            update={
                "completions": [
                    c.model_copy(update={"finish_reason": reason}) if c.episode == 0 else c for c in group.completions
                ]
            }
        )
        samples, stats = learner.build_samples([StepGroup(cut, 1, "gen")])
        # Only episode 1's sample; an aborted episode also leaves the group statistics (one scored episode:
        # advantage 0), a truncated one stays in them.
        assert [(s.prompt_ids, s.advantage) for s in samples] == [(PROMPT, 0.0 if reason == "abort" else adv[1])]
        assert stats["sample/aborted"] == (1.0 if reason == "abort" else 0.0)


def test_a_step_reports_the_tool_calls_errors_timeouts_and_env_time_its_groups_measured(tiny_model_dir: Path) -> None:
    """The generator's per-group episode sums (RolloutGroup.episode_stats) become the step's metrics, so they
    reach the trackers, the step log and the metrics the trainer posts; a step of groups without them (single-turn)
    reports none."""
    learner = _learner(tiny_model_dir)
    seg = [("model", [9, 10], [-1.0, -1.0]), ("env", [20], None), ("model", [11], [-1.0])]

    def group(i: int, stats: dict[str, float]) -> RolloutGroup:
        comps = [Completion.from_segments(seg, 1.0), Completion.from_segments(seg, 0.0)]
        return RolloutGroup(
            prompt_id=f"0-{i}", prompt_index=i, prompt_token_ids=PROMPT, completions=comps, episode_stats=stats
        )

    a = {"episodes": 2.0, "turns": 4.0, "tool_calls": 3.0, "tool_errors": 1.0, "timeouts": 0.0, "gen_s": 3.0}
    b = {"episodes": 2.0, "turns": 4.0, "tool_calls": 1.0, "tool_errors": 0.0, "timeouts": 1.0, "gen_s": 1.0}
    stats = learner.train_step(
        [StepGroup(group(0, {**a, "env_s": 1.0}), 1, "gen"), StepGroup(group(1, {**b, "env_s": 3.0}), 1, "gen")],
        policy_version=1,
    )
    assert stats["episodes/tool_calls_mean"] == 1.0  # 4 calls over 4 episodes
    assert (stats["episodes/tool_errors"], stats["episodes/timeouts"]) == (1.0, 1.0)
    assert stats["episodes/env_time_frac"] == 0.5  # 4 s of env time, 4 s of generation
    _, single = learner.build_samples([StepGroup(group(2, {}), 1, "gen")])
    assert not [k for k in single if k in ("episodes/tool_calls_mean", "episodes/tool_errors", "episodes/timeouts")]
    assert "episodes/env_time_frac" not in single


SAMPLINGS = [
    SamplingSpec(temperature=1.0, max_new_tokens=6),
    SamplingSpec(temperature=0.8, top_k=8, top_p=0.9, max_new_tokens=6),
]


def check_multi_turn_agreement(engine: Any, learner: Learner, adapter: str, adapter_dir: Path) -> None:
    """prompt | model turn (engine) | env tokens (by hand) | model turn (engine, prompted with all before it):
    the trainer's recomputation over the whole sequence matches every model token's behaviour logprob, and a
    training step on it reports no mismatch. ``engine`` serves ``adapter`` = ``learner``'s weights (saved in
    ``adapter_dir``); run by ``tests/trainer/test_engine_agreement.py`` for each engine, on its engine."""
    for sampling in SAMPLINGS:
        first = engine.generate([PROMPT], adapter=adapter, n=2, sampling=sampling)[0]
        comps = []
        for j, turn1 in enumerate(first):
            env = [40 + j, 41, 42]
            turn2 = engine.generate([PROMPT + turn1.token_ids + env], adapter=adapter, n=1, sampling=sampling)[0][0]
            segments = [
                ("model", turn1.token_ids, turn1.logprobs),
                ("env", env, None),
                ("model", turn2.token_ids, turn2.logprobs),
            ]
            comps.append(Completion.from_segments(segments, float(j)))
        group = RolloutGroup(prompt_id="0-0", prompt_index=0, prompt_token_ids=PROMPT, completions=comps)
        gaps = model_token_gaps(learner.policy, group, sampling)
        assert max(gaps) < 1e-3, (sampling, gaps)
        stats = learner.train_step([StepGroup(group, 3, "gen-x", sampling)], policy_version=3)
        assert stats[MISMATCH_PREFIX + "gen-x"] < 1e-3
        assert stats["ratio"] == pytest.approx(1.0, abs=1e-3)
        assert stats["train/tokens_env"] == 6.0 and math.isfinite(stats["train/loss"])
        learner.policy.load_adapter(adapter_dir)  # back to the weights the engine serves


def test_trainer_worker_trains_multi_turn_groups_and_reports_what_it_trained(
    redis_server: RedisServer, tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Multi-turn groups (split and not) over the real wire: trained, acked like any group, and the step's tokens
    trained vs in context and turns per episode reach the proxy's status and the step log."""
    caplog.set_level(logging.INFO, logger="bucketrl")
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as proxy:
        worker_settings = TrainerSettings(
            proxy_url=proxy.url,
            token=TOKENS["trainer"],
            run="r1",
            worker_id="trainer-a",
            run_spec=spec_json(tiny_model_dir, {"uri": "toy:digits", "size": 16}),
            max_steps=3,
            sync_every=1,
            checkpoint_every=3,
            device="cpu",
            lr=1e-2,
            claim_wait_s=0.5,
            work_dir=str(tmp_path / "work"),
        )
        gen = FakeGenerator(proxy.url, "r1", TOKENS["generator"], worker_id="gen-a", multi_turn=True)
        gen.start()
        try:
            rc = TrainerWorker(worker_settings, echo=lambda _: None).run()
        finally:
            gen.stop()
        assert rc == EXIT_OK and not gen.errors, gen.errors
        status = proxy.client("r1", role="admin").status()
        assert status.queue.acked_total == 6  # 3 steps x 2 groups, split or not
        metrics = status.metrics["trainer-a"]
        assert 0 < metrics["train/tokens"] < metrics["train/tokens_context"]
        assert metrics["train/tokens_env"] > 0 or metrics["episodes/samples_per_episode"] > 1
        assert 1.0 <= metrics["episodes/turns_mean"] <= metrics["episodes/turns_max"] <= 3.0
    steps = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(steps) == 3 and all(" tokens trained " in line and " turns " in line for line in steps), steps
