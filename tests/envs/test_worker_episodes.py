"""A generator worker on a multi-turn run, against a real proxy: its environment's episodes (toy:tools) become
groups of G episodes that the proxy accepts and a trainer claims, with exact behaviour logprobs on every model
token; an external agent (a plain ``openai`` client in another process, reading endpoint.json) rolls out through
the exposed endpoint and its episodes are accounted like any other."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bucketrl.tasks.tiny_model import build_tiny_model
from bucketrl.wire import DatasetSpec, Delivery, EnvSpec, EpisodeSpec, RewardSpec, RunSpec, SamplingSpec
from tests.generator.helpers import make_adapter, teacher_forced_logprobs
from tests.generator.worker_support import Consumer, create_run, running_worker, wait_until, worker_settings
from tests.proxy.harness import ProxyHarness, running
from tests.support.services import RedisServer

TOOLS_RUN = {
    "group_size": 4,
    "sampling": SamplingSpec(temperature=1.0, max_new_tokens=8),
    "reward": RewardSpec(name="toy", kwargs={"task": "digits", "length": 8}),
    "dataset": DatasetSpec(uri="toy:tools", size=64),
    "env": EnvSpec(name="toy:tools"),
    "episode": EpisodeSpec(max_turns=3, episode_timeout_s=60.0, max_episode_tokens=128),
}


@pytest.fixture()
def proxy(redis_server: RedisServer, tmp_path: Path) -> Iterator[ProxyHarness]:
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as h:
        yield h


@pytest.fixture(scope="module")
def adapter_v1(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tiny_model_dir, tmp_path_factory.mktemp("mt-adapters") / "v1", seed=21)


def check_trajectories(d: Delivery, spec: RunSpec, model_dir: Path, adapter: Path) -> int:
    """Every group holds G episodes of multi-turn samples whose model tokens carry the behaviour logprobs the
    trainer's forward over the whole sequence recomputes. Returns the model tokens checked."""
    checked = 0
    for g in d.groups:
        assert len(g.episodes()) == spec.group_size
        for c in g.completions:
            assert c.segments is not None and c.segments[0].kind == "model"
            assert c.reward is None or math.isfinite(c.reward)
            if c.finish_reason == "abort":
                continue
            prompt = g.prompt_of(c)
            ref = teacher_forced_logprobs(model_dir, adapter, prompt, c.token_ids, d.sampling or spec.sampling)
            for got, want, trained in zip(c.logprobs, ref, c.loss_mask(), strict=True):
                if trained:
                    assert abs(got - want) < 1e-3, (got, want)
                    checked += 1
    return checked


@pytest.fixture(scope="module")
def chars_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The character-level tiny model: every sampled token is the canonical encoding of its text, so a turn's
    re-rendered history extends the previous sequence and an episode's turns can stay one sample. With the
    byte-level BPE, the random model's turns seldom re-encode to what was sampled (stray bytes read back as
    U+FFFD, non-canonical merges), so whether any episode stays whole is luck."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("mt-chars"), tokenizer="chars")
    return model_dir, make_adapter(model_dir, tmp_path_factory.mktemp("mt-chars-adapter") / "v1", seed=21)


def test_a_multi_turn_run_submits_groups_of_episodes(proxy: ProxyHarness, chars_model: tuple[Path, Path]) -> None:
    tiny_model_dir, adapter_v1 = chars_model
    # Chatty: every episode takes max_turns turns with tool results or user messages between them (toy:tools' own
    # environment, at the start of training, rarely gets past the first turn: tests/e2e/test_up_tools.py runs it).
    run = {**TOOLS_RUN, "env": EnvSpec(name="tests.envs.env_fixtures:Chatty")}
    trainer, spec = create_run(proxy, "mt", tiny_model_dir, adapter_v1, **run)
    settings = worker_settings(proxy, "mt", "gen-a", max_groups=4)
    with Consumer(trainer) as consumer, running_worker(settings) as worker:
        got = consumer.wait_for(lambda ds: sum(len(d.groups) for d in ds) >= 4, timeout_s=120)
        wait_until(lambda: worker.thread.join(0) or not worker.thread.is_alive(), 60, "the worker to stop")
    checked = sum(check_trajectories(d, spec, tiny_model_dir, adapter_v1) for d in got)
    assert checked > 0
    # Every episode's 3 model turns are trained, in one sample or split over several (a chat template that
    # re-renders the random tiny model's reply differently splits there); inside a sample, tool results or user
    # messages sit in context between the model's turns.
    groups = [g for d in got for g in d.groups]
    episodes = [[g.completions[i] for i in idx] for g in groups for idx in g.episodes()]
    assert len(episodes) == 16
    for samples in episodes:
        assert sum(c.turns() for c in samples) == 3, [c.turns() for c in samples]
        for c in samples:
            env = sum(1 for s in c.segments or [] if s.kind == "env")
            assert env == c.turns() - 1, (env, c.turns())
    assert any(c.turns() > 1 for samples in episodes for c in samples)
    m = worker.metrics.snapshot()
    assert m["episode/episodes_total"] == 16 and m["rollout/groups_submitted_total"] == 4
    assert m["episode/turns_total"] == 16 * 3 and m["episode/tokens_context_total"] > 0
    # Each group carries its G episodes' sums to the trainer (its step metrics), agreeing with the worker's own.
    stats = [g.episode_stats for d in got for g in d.groups]
    assert [(s["episodes"], s["turns"]) for s in stats] == [(4.0, 12.0)] * 4
    assert all(s["gen_s"] > 0 and s["env_s"] >= 0 for s in stats)
    for key in ("tool_calls", "tool_errors", "timeouts"):
        assert sum(s[key] for s in stats) == m[f"episode/{key}_total"], key
    status = proxy.client("mt", "viewer").status()
    pushed = next(w for w in status.workers if w.worker_id == "gen-a")
    assert pushed is not None
    assert trainer.status().queue.groups == 0


def test_an_external_agent_rolls_out_through_the_exposed_endpoint(
    proxy: ProxyHarness, tiny_model_dir: Path, adapter_v1: Path, tmp_path: Path
) -> None:
    run = {**TOOLS_RUN, "env": EnvSpec(name="external")}
    trainer, spec = create_run(proxy, "ext", tiny_model_dir, adapter_v1, **run)
    endpoint = tmp_path / "endpoint.json"
    settings = worker_settings(proxy, "ext", "gen-x", openai_port=0, endpoint_file=str(endpoint))
    with Consumer(trainer) as consumer, running_worker(settings):
        info = wait_until(lambda: endpoint.exists() and json.loads(endpoint.read_text())["openai"], 60, "endpoint")
        assert oct(endpoint.stat().st_mode & 0o777) == "0o600"
        base = info["base_url"].removesuffix("/v1")
        out = subprocess.run(
            [sys.executable, "-m", "tests.envs.agent_script", base, info["token"], "8"],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        got = consumer.wait_for(lambda ds: sum(len(d.groups) for d in ds) >= 2, timeout_s=60)
    records = [json.loads(line) for line in out.stdout.splitlines()]
    groups = [g for d in got for g in d.groups]
    assert sorted(g.prompt_id for g in groups) == sorted({r["episode"]["prompt_id"] for r in records})
    for g in groups:
        # The rewards the agent reported (0.25 x its index in the group), one per episode.
        assert [g.completions[idx[0]].reward for idx in g.episodes()] == [0.0, 0.25, 0.5, 0.75]
    assert sum(check_trajectories(d, spec, tiny_model_dir, adapter_v1) for d in got) > 0
