"""``bucketrl up --dataset toy:tools --env external --openai-port 0`` as processes, with the real trainer: an
external agent (a plain ``openai`` client in its own process, tests/envs/slow_agent.py) runs every group the run
trains and sends each episode a reward of its own. The test proves, from three books kept apart, that each of
those episodes was trained exactly once with exactly the reward the agent sent:

- the stored batch objects (``runs/{run}/rollouts/{batch_id}``, msgpack with ``groups_msgpack``: what the
  generator submitted), copied as they appear, since the proxy deletes a batch once its groups are acked;
- the trainer's audit log (``logs/trainer-audit.jsonl``): which deliveries (``{batch_id}:{g}``) each step trained;
- the trainer's step metrics (``reward`` per step, pushed to the proxy): the mean of those steps' rewards.

    .venv/bin/python -m pytest -q -s tests/e2e/test_up_agent_rewards.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import pytest

from bucketrl.wire import RolloutGroup
from tests.e2e.helpers import audit, running_cluster, series, wait_for

STEPS = 3
GROUP_SIZE = 2
GROUPS_PER_STEP = 2
EPISODES = STEPS * GROUPS_PER_STEP * GROUP_SIZE  # exactly what the run trains: no group left half open

Episode = tuple[str, int]  # (prompt_id, index in its group)


@contextmanager
def copying_batches(rollouts: Path, into: dict[str, bytes]) -> Iterator[None]:
    """Copy every batch object that appears under ``rollouts`` (file:// bucket) until the block ends."""
    stop = threading.Event()

    def copy() -> None:
        while True:
            last = stop.is_set()
            for path in rollouts.glob("*") if rollouts.exists() else []:
                if path.name not in into and not path.name.endswith(".done"):
                    try:
                        data = path.read_bytes()
                        msgpack.unpackb(data)  # whole (a rename puts it there, but check)
                    except (OSError, ValueError, msgpack.UnpackException):
                        continue
                    into[path.name] = data
            if last:
                return
            stop.wait(0.05)

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def stored_groups(batches: dict[str, bytes]) -> dict[str, RolloutGroup]:
    """delivery id (``{batch_id}:{g}``) -> the group as the generator submitted it."""
    out: dict[str, RolloutGroup] = {}
    for data in batches.values():
        obj = msgpack.unpackb(data, raw=False)
        for g, raw in enumerate(obj["groups_msgpack"]):
            out[f"{obj['batch_id']}:{g}"] = RolloutGroup.model_validate(msgpack.unpackb(raw, raw=False))
    return out


def check_books(
    sent: dict[Episode, float],
    groups: dict[str, RolloutGroup],
    records: list[dict[str, Any]],
    step_reward: dict[int, float],
) -> None:
    """Each episode the agent finished was trained in exactly one step, with exactly the reward it sent, and each
    step's ``reward`` metric is the mean of its groups' mean rewards."""
    steps = [r for r in records if r["event"] == "step"]
    assert not [r for r in records if r["event"] == "resume"], "the trainer restarted: not this test's case"
    trained: dict[Episode, float | None] = {}
    for step in steps:
        assert not step.get("repeats"), f"step {step['step']} held redelivered groups: {step['repeats']}"
        means: list[float] = []
        for delivery in step["deliveries"]:
            assert delivery in groups, f"step {step['step']} trained {delivery}, which no stored batch holds"
            group = groups[delivery]
            rewards = [group.completions[idx[0]].reward for idx in group.episodes()]
            for i, reward in enumerate(rewards):
                assert (group.prompt_id, i) not in trained, f"episode {(group.prompt_id, i)} trained twice"
                trained[(group.prompt_id, i)] = reward
            means.append(sum(r for r in rewards if r is not None) / len(rewards))
        assert step_reward[int(step["step"])] == pytest.approx(sum(means) / len(means), abs=1e-6), step
    assert trained == sent, "the trained episodes' rewards are not the ones the agent sent"
    assert len(step_reward) == len(steps), (sorted(step_reward), [s["step"] for s in steps])


@pytest.mark.slow
def test_an_external_agents_episodes_are_trained_once_with_the_rewards_it_sent(tmp_path: Path) -> None:
    batches: dict[str, bytes] = {}
    with running_cluster(
        tmp_path,
        dataset="toy:tools",
        env="external",
        openai_port=0,
        generators=1,
        max_steps=STEPS,
        group_size=GROUP_SIZE,
        groups_per_step=GROUPS_PER_STEP,
    ) as cluster:
        rollouts = Path(cluster.bucket_url.removeprefix("file://")) / "runs" / cluster.cfg.run / "rollouts"
        with copying_batches(rollouts, batches):
            endpoint = cluster.endpoint_file
            info = wait_for(
                lambda: endpoint.exists() and json.loads(endpoint.read_text()).get("openai"), 180, "gen-0's endpoint"
            )
            base = info["base_url"].removesuffix("/v1")
            cmd = [sys.executable, "-m", "tests.envs.slow_agent", base, info["token"], "--episodes", str(EPISODES)]
            cmd += ["--reward-base", "0.1", "--reward-step", "0.05", "--max-wait", "1"]
            agent = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
            assert agent.returncode == 0, agent.stderr[-3000:]
            trainer = cluster.services["trainer"]
            assert trainer.wait(180) == 0, trainer.log_tail()
        step_reward = dict(series(cluster, "reward"))
        records = audit(cluster)
    sent_records = [json.loads(line) for line in agent.stdout.splitlines()]
    assert [r["finish_status"] for r in sent_records] == [200] * EPISODES
    sent = {(r["prompt_id"], r["index_in_group"]): r["reward"] for r in sent_records}
    assert len(set(sent.values())) == EPISODES  # every episode's reward is its own
    groups = stored_groups(batches)
    check_books(sent, groups, records, step_reward)
    _check_the_check(sent, groups, records, step_reward)
    print(f"\n[agent rewards] {EPISODES} episodes over {len(step_reward)} steps: {step_reward}")


def _check_the_check(
    sent: dict[Episode, float],
    groups: dict[str, RolloutGroup],
    records: list[dict[str, Any]],
    step_reward: dict[int, float],
) -> None:
    """The same books, each changed the way a wrong system would change them, are refused."""
    a, b = list(sent)[:2]
    swapped = {**sent, a: sent[b], b: sent[a]}  # two episodes' rewards swapped
    steps = [r for r in records if r["event"] == "step"]
    twice = [*records, {**steps[0], "step": steps[-1]["step"] + 1}]  # a step's groups trained again
    extra = {**step_reward, twice[-1]["step"]: step_reward[steps[0]["step"]]}
    off = {**step_reward, steps[0]["step"]: step_reward[steps[0]["step"]] + 0.01}  # a step's metric off
    one_short = {k: v for k, v in groups.items() if k != steps[0]["deliveries"][0]}  # trained, never stored
    for wrong in (
        (swapped, groups, records, step_reward),
        (sent, groups, twice, extra),
        (sent, groups, records, off),
        (sent, one_short, records, step_reward),
    ):
        with pytest.raises(AssertionError):
            check_books(*wrong)
