"""An agent written with a widely used agent library (smolagents, tests/envs/smol_agent.py) in its own process
runs a group of episodes through a generator's endpoint, streaming its model calls; the group reaches the proxy,
is trained with the rewards the agent sent, and is counted like any other. smolagents is the ``agents`` extra
(scripts/setup.sh installs it): without it the agent process fails, and so does the test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bucketrl.wire import EnvSpec, EpisodeSpec
from tests.envs.test_slow_agents import GROUPS_PER_STEP, MAX_STALENESS, SteppingTrainer
from tests.envs.test_worker_episodes import TOOLS_RUN
from tests.generator.worker_support import create_run, running_worker, wait_until, worker_settings
from tests.proxy.harness import ProxyHarness


def test_a_smolagents_agent_streams_an_episode_group_that_is_trained_like_any_other(
    proxy: ProxyHarness, tiny_model_dir: Path, adapter_dir: Path, tmp_path: Path
) -> None:
    run = {
        **TOOLS_RUN,
        "group_size": 2,
        "groups_per_step": GROUPS_PER_STEP,
        "max_staleness": MAX_STALENESS,
        "env": EnvSpec(name="external"),
        # smolagents' system prompt whole: the byte-level BPE encodes every character of it (the character-level
        # tokenizer dropped its capitals and braces, and 256 tokens were enough).
        "episode": EpisodeSpec(max_turns=3, episode_timeout_s=60.0, max_episode_tokens=1024),
    }
    trainer, _ = create_run(proxy, "smol", tiny_model_dir, adapter_dir, **run)
    endpoint = tmp_path / "endpoint.json"
    settings = worker_settings(proxy, "smol", "gen-smol", openai_port=0, endpoint_file=str(endpoint))
    with SteppingTrainer(trainer, adapter_dir) as stepper, running_worker(settings) as worker:
        info = wait_until(lambda: endpoint.exists() and json.loads(endpoint.read_text())["openai"], 60, "endpoint")
        base = info["base_url"].removesuffix("/v1")
        agent = subprocess.run(
            [sys.executable, "-m", "tests.envs.smol_agent", base, info["token"], "2"],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert agent.returncode == 0, agent.stderr[-3000:]
        records = [json.loads(line) for line in agent.stdout.splitlines()]
        prompt = records[0]["episode"]["prompt_id"]
        wait_until(lambda: any(g.prompt_id == prompt for _, g in list(stepper.trained)), 60, "the agent's group")
        metrics = worker.metrics.snapshot()
    # The library streamed each episode's step (SSE through the endpoint); its final-answer call is a plain one.
    for r in records:
        assert r["calls"]["stream"] == 1 and r["calls"]["plain"] <= 1, r
        assert r["finished"]["turns"] == r["calls"]["stream"] + r["calls"]["plain"]
    assert {r["episode"]["prompt_id"] for r in records} == {prompt} and records[-1]["finished"]["group_complete"]
    # Every call was recorded as a turn of its episode, none failed ...
    assert metrics["episode/turns_total"] == sum(r["finished"]["turns"] for r in records)
    assert metrics.get("episode/failed_total", 0) == 0
    assert metrics["episode/tool_calls_total"] >= sum(len(r["tool_calls"]) for r in records)
    # ... and the group was accepted by the proxy and trained once, with the agent's rewards.
    ((_, group),) = [(v, g) for v, g in stepper.trained if g.prompt_id == prompt]
    assert [group.completions[idx[0]].reward for idx in group.episodes()] == [r["reward"] for r in records]
    queue = trainer.status().queue
    assert queue.accepted_total >= 1 and queue.rejected_stale_total == 0
