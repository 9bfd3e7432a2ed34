"""An external agent that fails most of its episodes (a plain ``openai`` client in another process, reporting
``{"error": ...}`` at finish on 3 of every 4): those episodes are ``abort`` (never trained, out of the group's
statistics), counted as ``episode/failed_agent``, never as the reward's failure; the trainer's watch trains on
the rest under the default limits and stops naming the agent (not the reward) under a tighter one."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bucketrl import preflight
from bucketrl.trainer.learner import _episode_advantages
from bucketrl.trainer.reporting import RewardWatch
from bucketrl.trainer.settings import TrainerSettings
from bucketrl.wire import EnvSpec
from tests.envs.test_worker_episodes import TOOLS_RUN
from tests.generator.helpers import make_adapter
from tests.generator.worker_support import Consumer, create_run, running_worker, wait_until, worker_settings
from tests.proxy.harness import ProxyHarness, running
from tests.support.services import RedisServer


@pytest.fixture()
def proxy(redis_server: RedisServer, tmp_path: Path) -> Iterator[ProxyHarness]:
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as h:
        yield h


def test_an_agent_failing_3_of_4_episodes_aborts_them_and_never_blames_the_reward(
    proxy: ProxyHarness, tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    adapter = make_adapter(tiny_model_dir, tmp_path / "v1", seed=21)
    trainer, spec = create_run(proxy, "fail", tiny_model_dir, adapter, **{**TOOLS_RUN, "env": EnvSpec(name="external")})
    endpoint = tmp_path / "endpoint.json"
    settings = worker_settings(proxy, "fail", "gen-f", openai_port=0, endpoint_file=str(endpoint))
    with Consumer(trainer) as consumer, running_worker(settings) as worker:
        info = wait_until(lambda: endpoint.exists() and json.loads(endpoint.read_text())["openai"], 60, "endpoint")
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.envs.agent_script",
                info["base_url"].removesuffix("/v1"),
                info["token"],
                "8",
                "fail",
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        got = consumer.wait_for(lambda ds: sum(len(d.groups) for d in ds) >= 2, timeout_s=60)
        m = wait_until(lambda: (s := worker.metrics.snapshot())["episode/episodes_total"] >= 8 and s, 30, "metrics")
    groups = [g for d in got for g in d.groups]
    assert len(groups) == 2
    for g in groups:
        results = g.episode_results()
        # The agent's one good episode per group keeps its reward; the 3 it failed are abort with no reward.
        assert [c.finish_reason == "abort" for c in results] == [False, True, True, True]
        assert [c.reward for c in results][:1] == [0.0] and all(c.reward is None for c in results[1:])
        assert set(g.reward_errors) == {"episode:agent"}
        assert "the agent's tool crashed" in g.reward_errors["episode:agent"]
        # The trainer's advantages: the aborted episodes are out of the group's statistics and never trained.
        adv, _, _, trainable, _ = _episode_advantages(g, spec.loss)
        assert adv.reward_mean == 0.0 and adv.reward_std == 0.0  # the one good episode's reward alone
        assert not any(keep for keep, c in zip(trainable, g.completions, strict=True) if c.finish_reason == "abort")
    # The generator counts them as the agent's failures, not unscorable rewards (status shows the same numbers).
    assert m["episode/failed_agent_total"] == 6 and m["episode/failed_total"] == 6
    assert m.get("rollout/unscorable_total", 0) == 0
    # The trainer's watch, with the defaults: nothing the reward could not score; the run trains on the rest,
    # with a warning that names the agent.
    limits = TrainerSettings()
    watch = RewardWatch(limits.max_unscorable_fraction, limits.max_failed_episode_fraction)
    with caplog.at_level(logging.WARNING, logger="bucketrl.trainer"):
        watch.check(got, "toy")
    assert watch.last_fraction() == 0.0 and watch.last_failed_fraction() == 0.75
    assert watch.reward_errors == {} and "the agent's tool crashed" in watch.episode_errors["agent"]
    assert "6/8 episodes" in caplog.text and "agent" in caplog.text
    # A tighter limit stops the run with the agent's message, never the reward's.
    with pytest.raises(preflight.ConfigError) as stop:
        RewardWatch(0.5, 0.5).check(got, "toy")
    said = str(stop.value)
    assert "the agent (or environment) is failing: 6/8 episodes" in said
    assert "BUCKETRL_MAX_FAILED_EPISODE_FRACTION=0.5" in said and "the agent's tool crashed" in said
    assert "could not score" not in said and "UNSCORABLE" not in said
