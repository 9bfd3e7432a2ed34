"""A slow external agent next to a fast one (two plain ``openai`` clients in their own processes): the slow one
pauses between its model calls for longer than the trainer takes for max_staleness steps on the fast one's
groups. Admission control (bucketrl/generator/admission.py) holds the slow group's version: the fast agent is
answered 429 ``admission`` (Retry-After) instead of new groups, the trainer waits, and no group is dropped as
stale; every episode is trained once with the reward its agent sent."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bucketrl.client import ProxyClient
from bucketrl.tarball import pack_dir
from bucketrl.tasks.toy import default_run_spec
from bucketrl.wire import EnvSpec, RolloutGroup
from tests.envs.test_worker_episodes import TOOLS_RUN
from tests.generator.worker_support import create_run, running_worker, wait_until, worker_settings
from tests.proxy.harness import ProxyHarness

GROUPS_PER_STEP = 1
MAX_STALENESS = 2
PAUSE_S = 10.0

# Slow agents paced by their own sleeps: make test, not make test-fast.
pytestmark = pytest.mark.slow


class SteppingTrainer:
    """A trainer stand-in that steps: it claims as a trainer does (its pace and floor on every claim), publishes
    the next version once it holds ``groups_per_step`` groups, and acks them; ``trained`` keeps each step's. A step
    takes at least ``min_step_s`` (a real trainer's time: the steps a group sees then depend on its life, not on how
    fast this machine samples the tiny model)."""

    def __init__(
        self,
        trainer: ProxyClient,
        adapter: Path,
        groups_per_step: int = GROUPS_PER_STEP,
        max_staleness: int = MAX_STALENESS,
        min_step_s: float = 0.0,
    ) -> None:
        self.trainer, self.tar = trainer, pack_dir(adapter)
        self.min_step_s = min_step_s
        self.groups_per_step, self.max_staleness = groups_per_step, max_staleness
        self.version = 1
        self.trained: list[tuple[int, RolloutGroup]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        held: list[tuple[str, list[RolloutGroup]]] = []
        stepped = time.monotonic()
        while not self.stop.is_set():
            got = self.trainer.claim(
                "trainer-test",
                max_groups=self.groups_per_step - sum(len(g) for _, g in held),
                wait_s=0.3,
                min_version=max(0, self.version - self.max_staleness),
                train_version=self.version,
            )
            held += [(d.delivery_id, d.groups) for d in got.deliveries]
            if sum(len(g) for _, g in held) >= self.groups_per_step:
                self.stop.wait(max(0.0, stepped + self.min_step_s - time.monotonic()))
                stepped = time.monotonic()
                self.trained += [(self.version, g) for _, gs in held for g in gs]
                self.version += 1
                self.trainer.publish_adapter(self.version, self.tar)
                self.trainer.ack([i for i, _ in held])
                held = []

    def __enter__(self) -> SteppingTrainer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


def _agent(base: str, token: str, *args: str) -> subprocess.Popen[str]:
    # "--": a token may begin with "-" (token_urlsafe), which argparse would read as an option.
    cmd = [sys.executable, "-m", "tests.envs.slow_agent", *args, "--", base, token]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_slow_agents_groups_hold_their_version_and_none_is_dropped_as_stale(
    proxy: ProxyHarness, tiny_model_dir: Path, adapter_dir: Path, tmp_path: Path
) -> None:
    run = {
        **TOOLS_RUN,
        "group_size": 2,
        "groups_per_step": GROUPS_PER_STEP,
        "max_staleness": MAX_STALENESS,
        "env": EnvSpec(name="external"),
    }
    trainer, _ = create_run(proxy, "slow", tiny_model_dir, adapter_dir, **run)
    endpoint = tmp_path / "endpoint.json"
    settings = worker_settings(proxy, "slow", "gen-s", openai_port=0, endpoint_file=str(endpoint))
    with SteppingTrainer(trainer, adapter_dir) as stepper, running_worker(settings) as worker:
        info = wait_until(lambda: endpoint.exists() and json.loads(endpoint.read_text())["openai"], 60, "endpoint")
        base = info["base_url"].removesuffix("/v1")
        slow = _agent(base, info["token"], "--episodes", "2", "--pause", str(PAUSE_S), "--reward-base", "0.5")
        time.sleep(2.0)  # the slow agent opens the first group
        stop = tmp_path / "stop"
        fast = _agent(
            base,
            info["token"],
            "--episodes",
            "200",
            "--reward-base",
            "0.1",
            "--max-wait",
            "1",
            "--stop-file",
            str(stop),
        )
        slow_out, slow_err = slow.communicate(timeout=240)
        stop.touch()  # the fast agent ran all along; it stops once its group is complete
        fast_out, fast_err = fast.communicate(timeout=240)
        assert slow.returncode == 0 and fast.returncode == 0, (slow_err[-2000:], fast_err[-2000:])
        records = [json.loads(line) for line in (slow_out + fast_out).splitlines()]
        # The agents left no group with a free slot (a group's free slot is handed out before a new group).
        groups = len({r["prompt_id"] for r in records})
        wait_until(lambda: _settled(trainer, groups), 60, "every group to be trained or dropped")
        metrics = worker.metrics.snapshot()
    status = trainer.status()
    # No group dropped as stale, in the proxy's books and the generator's, and no agent was told so at finish.
    assert status.queue.rejected_stale_total == 0 and status.queue.dropped_stale_total == 0
    assert metrics["rollout/dropped_stale_total"] == 0
    assert all(r["finish_status"] == 200 for r in records), [r for r in records if r["finish_status"] != 200]
    # The slow agent's episodes took longer than max_staleness of the trainer's steps would allow unpaced ...
    assert min(r["episode_s"] for r in records if r["reward"] >= 0.5) >= PAUSE_S
    # ... so the fast agent was held back (429 admission) while they ran, and the trainer waited for them.
    assert metrics["episode/admission_refused_total"] >= 1
    assert sum(r["refusals"] for r in records if r["reward"] < 0.5) >= 1
    # Every episode was trained once, with the reward its agent sent, within max_staleness of its version.
    sent = {(r["prompt_id"], r["index_in_group"]): (r["reward"], r["version"]) for r in records}
    trained: dict[tuple[str, int], float | None] = {}
    for train_version, g in stepper.trained:
        for i, idx in enumerate(g.episodes()):
            assert (g.prompt_id, i) not in trained, "an episode trained twice"
            trained[(g.prompt_id, i)] = g.completions[idx[0]].reward
            version = sent.get((g.prompt_id, i), (None, train_version))[1]
            assert train_version - version <= MAX_STALENESS
    assert trained == {k: reward for k, (reward, _) in sent.items()}


def _settled(trainer: ProxyClient, groups: int) -> bool:
    """Every group the agents completed reached the proxy and left its queue, trained or dropped."""
    q = trainer.status().queue
    return (
        q.accepted_total + q.rejected_stale_total >= groups
        and q.acked_total + q.dropped_stale_total >= q.accepted_total
    )


def test_in_a_mixed_run_the_generators_own_groups_wait_for_a_slow_agents_group(
    proxy: ProxyHarness, tiny_model_dir: Path, adapter_dir: Path, tmp_path: Path
) -> None:
    """The issue's case: the run's own environment (toy:tools) keeps the trainer stepping on its quick groups
    while an agent takes its time; its group still holds its version and is trained with its rewards."""
    run = {**TOOLS_RUN, "group_size": 2, "groups_per_step": GROUPS_PER_STEP, "max_staleness": MAX_STALENESS}
    trainer, _ = create_run(proxy, "mixed", tiny_model_dir, adapter_dir, **run)
    endpoint = tmp_path / "endpoint.json"
    settings = worker_settings(proxy, "mixed", "gen-m", openai_port=0, endpoint_file=str(endpoint))
    with SteppingTrainer(trainer, adapter_dir) as stepper, running_worker(settings) as worker:
        info = wait_until(lambda: endpoint.exists() and json.loads(endpoint.read_text())["openai"], 60, "endpoint")
        wait_until(lambda: stepper.version >= 3, 60, "the environment's groups to step the trainer")
        base = info["base_url"].removesuffix("/v1")
        # Two episodes, one after the other: the two slots of one group, open for ~2 x PAUSE_S.
        slow = _agent(base, info["token"], "--episodes", "2", "--pause", str(PAUSE_S), "--reward-base", "0.5")
        out, err = slow.communicate(timeout=240)
        assert slow.returncode == 0, err[-2000:]
        records = [json.loads(line) for line in out.splitlines()]
        prompt = records[0]["prompt_id"]
        wait_until(lambda: any(g.prompt_id == prompt for _, g in list(stepper.trained)), 60, "the agent's group")
        status, metrics = trainer.status(), worker.metrics.snapshot()
    assert status.queue.rejected_stale_total == 0 and status.queue.dropped_stale_total == 0
    assert metrics["rollout/dropped_stale_total"] == 0
    assert [r["finish_status"] for r in records] == [200, 200]
    assert {r["prompt_id"] for r in records} == {prompt}
    ((train_version, group),) = [(v, g) for v, g in stepper.trained if g.prompt_id == prompt]
    assert [group.completions[idx[0]].reward for idx in group.episodes()] == [0.5, 0.51]
    assert train_version - records[0]["version"] <= MAX_STALENESS
    # The environment's groups went on around it: the trainer stepped while the agent worked, then waited.
    assert any(v > records[0]["version"] for v, g in stepper.trained if g.prompt_id != prompt)


def test_beside_the_environment_a_slow_agent_gets_each_of_its_groups_trained(
    proxy: ProxyHarness, tiny_model_dir: Path, adapter_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 36: the run's own toy:tools environment and a slow agent asking for three groups one after the other,
    with the toy task's max_staleness and episode limits. The agent is one source and the environment another: each
    of the agent's groups is admitted at the next free slot (the agent gives up, exit 3, after an episode timeout
    of refusals: that was the starvation), all three are trained with its rewards, nothing is dropped as stale,
    the generator's share of the trained groups reads 1 and no staleness warning is logged."""
    toy = default_run_spec(tiny_model_dir, task="tools")
    run = {
        **TOOLS_RUN,
        "group_size": 2,
        "groups_per_step": 2,
        "max_staleness": toy.max_staleness,
        "episode": toy.episode,
        "queue_capacity_groups": toy.queue_capacity_groups,
    }
    trainer, spec = create_run(proxy, "fair", tiny_model_dir, adapter_dir, **run)
    endpoint = tmp_path / "endpoint.json"
    # The generator's own default of groups at once (worker_settings' is 2, for quick tests).
    settings = worker_settings(
        proxy, "fair", "gen-f", openai_port=0, endpoint_file=str(endpoint), prompts_per_request=8
    )
    caplog.set_level(logging.WARNING, logger="bucketrl.generator")
    with (
        SteppingTrainer(trainer, adapter_dir, spec.groups_per_step, spec.max_staleness) as stepper,
        running_worker(settings) as worker,
    ):
        info = wait_until(lambda: endpoint.exists() and json.loads(endpoint.read_text())["openai"], 60, "endpoint")
        wait_until(lambda: stepper.version >= 3, 60, "the environment's groups to step the trainer")
        base = info["base_url"].removesuffix("/v1")
        give_up = str(spec.episode.episode_timeout_s)
        agent = _agent(base, info["token"], "--episodes", "6", "--pause", "4", "--give-up", give_up, "--max-wait", "30")
        out, err = agent.communicate(timeout=300)
        assert agent.returncode == 0, (out[-2000:], err[-2000:])
        records = [json.loads(line) for line in out.splitlines()]
        prompts = list(dict.fromkeys(r["prompt_id"] for r in records))
        wait_until(lambda: {g.prompt_id for _, g in list(stepper.trained)} >= set(prompts), 60, "the agent's groups")
        status, metrics = trainer.status(), worker.metrics.snapshot()
    assert len(prompts) == 3 and [r["finish_status"] for r in records] == [200] * 6
    assert status.queue.rejected_stale_total == 0 and status.queue.dropped_stale_total == 0
    assert metrics["rollout/dropped_stale_total"] == 0
    for prompt in prompts:  # each trained once, with the rewards the agent sent, within max_staleness
        ((train_version, group),) = [(v, g) for v, g in stepper.trained if g.prompt_id == prompt]
        sent = [r for r in records if r["prompt_id"] == prompt]
        assert [group.completions[idx[0]].reward for idx in group.episodes()] == [r["reward"] for r in sent]
        assert train_version - sent[0]["version"] <= spec.max_staleness
    # The environment was not starved either: it fed the trainer between the agent's groups.
    first = next(i for i, (_, g) in enumerate(stepper.trained) if g.prompt_id == prompts[0])
    last = max(i for i, (_, g) in enumerate(stepper.trained) if g.prompt_id == prompts[-1])
    assert sum(g.prompt_id not in prompts for _, g in stepper.trained[first:last]) >= 2
    # What the sources got, from the generator's books: 3 agent groups admitted, the environment's many.
    assert metrics["admission/agent/admitted_total"] == 3 and metrics["admission/env/admitted_total"] >= 4
    assert metrics["admission/own_share"] == pytest.approx(1.0)
    assert not [r.getMessage() for r in caplog.records if "staleness" in r.getMessage()]
