"""Environments that misbehave: each failure closes its own episode with reward null and a clear kind and message,
and never holds up the group's other episodes or the generator."""

from __future__ import annotations

from pathlib import Path

import pytest

from bucketrl.envs.loader import make_env
from bucketrl.envs.tools import tool_schema
from bucketrl.rollout.example import Example
from bucketrl.sim import engine as sim_engine
from bucketrl.tasks.tiny_model import VOCAB_SIZE
from tests.envs.env_fixtures import add
from tests.envs.support import episode_spec, harness

EXAMPLE = Example(index=0, prompt="q?", answer="odd")


@pytest.mark.slow  # waits out episode timeouts (6-8 s)
def test_each_failure_is_its_episodes_own(tiny_model_dir: Path, adapter_dir: Path) -> None:
    spec = episode_spec(tiny_model_dir, episode_timeout_s=8.0).model_copy(update={"group_size": 7})
    env = make_env("tests.envs.env_fixtures:Faulty", {})
    with harness(tiny_model_dir, adapter_dir, spec, env) as h:
        group = h.run_group(EXAMPLE)
    eps = group.episodes
    kinds = [e.error[0] if e.error else None for e in eps]
    assert kinds == ["exception", "timeout", "turn_limit", "non_numeric", "model", None, None]
    messages = [e.error[1] if e.error else "" for e in eps]
    assert "ValueError: the environment broke" in messages[0]
    assert "episode_timeout_s=8s" in messages[1]
    assert "max_turns is 3" in messages[2]
    assert "returned a bad reward" in messages[3] and "'1.0'" in messages[3]
    assert "pinned to" in messages[4]
    assert [e.reward for e in eps] == [None, None, None, None, None, 0.5, None]
    assert [e.needs_scoring for e in eps] == [False] * 6 + [True]
    # The episode's own failures (timeout, turn limit, another model) are abort; the environment raising and a bad
    # reward value are the reward's side (unscorable).
    assert [e.finish_reason == "abort" for e in eps] == [False, True, True, False, True, False, False]
    assert [len(e.turns) for e in eps] == [1, 1, 3, 1, 1, 1, 1]
    # The hung episode did not hold up the others: they ended while it was still waiting for its timeout.
    assert max(e.stats.ended for i, e in enumerate(eps) if i != 1) < eps[1].stats.ended - 3.0  # type: ignore[operator]
    assert all(e.closed for e in eps)


@pytest.mark.slow  # waits out episode timeouts (6-8 s)
def test_a_blocking_environment_runs_in_a_thread_and_times_out(tiny_model_dir: Path, adapter_dir: Path) -> None:
    spec = episode_spec(tiny_model_dir, episode_timeout_s=3.0)
    env = make_env("tests.envs.env_fixtures:BlockingHang", {})
    with harness(tiny_model_dir, adapter_dir, spec, env) as h:
        group = h.run_group(EXAMPLE)
        # The generator goes on serving while the blocked thread sleeps.
        again = h.run_group(Example(index=1, prompt="z?", answer="low"), timeout_s=20)
    assert [e.error[0] if e.error else None for e in group.episodes] == ["timeout", None, None, None]
    assert [e.reward for e in group.episodes] == [None, 1.0, 1.0, 1.0]
    assert again.episodes[1].reward == 1.0


def test_tool_calls_the_model_gets_wrong_are_answered_and_counted(tiny_model_dir: Path, adapter_dir: Path) -> None:
    env = make_env("tests.envs.env_fixtures:ToolErrors", {})
    with harness(tiny_model_dir, adapter_dir, episode_spec(tiny_model_dir), env) as h:
        group = h.run_group(EXAMPLE)
    ep = group.episodes[0]
    assert ep.reward == 1.0 and ep.stats.tool_errors == 5
    assert tool_schema(add)["function"] == {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    }


def test_environment_names_are_resolved_with_clear_errors() -> None:
    import pytest

    from bucketrl import errors

    for name, match in (
        ("nosuchmodule_xyz:Env", "cannot import 'nosuchmodule_xyz'"),
        ("tests.envs.env_fixtures:Nope", "has no class 'Nope' with a rollout method"),
        ("tests.envs.env_fixtures:add", "has no class 'add'"),
        ("plainname", "is not one of"),
    ):
        with pytest.raises(errors.Invalid, match=match):
            make_env(name, {})
    with pytest.raises(errors.Invalid, match=r"Faulty.*failed"):
        make_env("tests.envs.env_fixtures:Faulty", {"unknown": 1})


def test_every_group_is_handed_over_exactly_once(tiny_model_dir: Path, adapter_dir: Path) -> None:
    """Hundreds of groups, one after the other (each dropped once handed over): every one comes back. Finished
    groups were once remembered by id(), which a later group reuses: 1 group in ~70 never came back, holding its
    version and prompt lease forever."""
    import time

    env = make_env("tests.envs.env_fixtures:Instant", {})
    with harness(tiny_model_dir, adapter_dir, episode_spec(tiny_model_dir), env) as h:
        for i in range(300):
            group = h.group(Example(index=i, prompt="q?", answer="odd"))
            h.svc.start_group(group)
            deadline = time.monotonic() + 10
            while not (done := h.svc.take_finished()) and time.monotonic() < deadline:
                time.sleep(0.001)
            assert done == [group], f"group {i} was not handed over"
            assert [e.reward for e in group.episodes] == [1.0] * 4
            del group, done  # freed at once (refcounting): the next group may get its address
        assert len(h.svc.book) == 0


def test_the_sim_engine_serves_episodes(tiny_model_dir: Path, adapter_dir: Path) -> None:
    """BUCKETRL_ENGINE=sim (scale benchmarks) behind the endpoint: well-formed turns, recorded like any other."""
    from bucketrl.generator.settings import GeneratorSettings

    sim_engine.register()
    env = make_env("tests.envs.env_fixtures:Chatty", {})
    spec = episode_spec(tiny_model_dir)
    with harness(tiny_model_dir, adapter_dir, spec, env, engine=GeneratorSettings(engine="sim", seed=0)) as h:
        group = h.run_group(EXAMPLE)
    for ep in group.episodes:
        assert ep.error is None and len(ep.turns) == 3
        for t in ep.turns:
            assert 1 <= len(t.completion_ids) <= 8 and max(t.completion_ids) < VOCAB_SIZE
            assert len(t.logprobs) == len(t.completion_ids) and max(t.logprobs) <= 0.0
