"""A verifiers (v1) environment built for the tests (tests/envs/vf_modules/vf_lookup.py) runs through the
generator's endpoint with the tiny model: verifiers' harness makes the model calls through its interception, the
endpoint records them as the episode's multi-turn trajectory, and the taskset's weighted rewards score it. What
verifiers marks failed fails the bucketrl episode with verifiers' error."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from bucketrl import errors
from bucketrl.envs.loader import make_env
from bucketrl.generator.episode_groups import episode_group
from bucketrl.rollout.episodes import Episode, GroupRun
from bucketrl.rollout.example import Example
from bucketrl.wire import PromptLeaseItem
from tests.envs.support import Harness, episode_spec, harness

MODULES = Path(__file__).parent / "vf_modules"


@pytest.fixture(autouse=True)
def _vf_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    # verifiers imports a taskset id as a top-level module: the test's environments are on the path like a user's.
    monkeypatch.syspath_prepend(str(MODULES))


@contextmanager
def served(model_dir: Path, adapter_dir: Path, kwargs: dict[str, Any], group_size: int) -> Iterator[Harness]:
    env = make_env("verifiers:vf_lookup", kwargs)
    spec = episode_spec(model_dir, episode_timeout_s=60.0).model_copy(update={"group_size": group_size})
    with harness(model_dir, adapter_dir, spec, env) as h:
        yield h
        assert env._envs  # a served verifiers env (its interception server) ...
    assert not env._envs  # ... that the generator's shutdown closed (the environment's aclose)


def context_text(h: Harness, ep: Episode) -> str:
    """What the episode's samples hold that the model did not write: env segments and later samples' prompts."""
    samples = ep.samples()
    ids = [t for s in samples for kind, toks, _ in s.segments if kind == "env" for t in toks]
    ids += [t for s in samples[1:] for t in s.prompt_ids]
    return h.svc.decode(ids)


def wire_group(group: GroupRun) -> Any:
    lease = PromptLeaseItem(prompt_id=group.prompt.prompt_id, index=group.prompt.index, **{"pass": 0})
    return episode_group(lease, [1], group.episodes, {}, placeholder_token=0)


def test_a_verifiers_env_runs_through_the_endpoint(tiny_model_dir: Path, adapter_dir: Path) -> None:
    with served(tiny_model_dir, adapter_dir, {}, group_size=4) as h:
        group = h.run_group(Example(index=0, prompt="a?", answer="odd"), timeout_s=120)
        for ep in group.episodes:
            assert ep.error is None, ep.error
            # The harness's two model calls, through verifiers' interception, are the episode's two turns.
            assert len(ep.turns) == 2 and all(t.completion_ids for t in ep.turns)
            assert sum(kind == "model" for s in ep.samples() for kind, _, _ in s.segments) == 2
            # The lookup (a tool result or a user message) is in context between them, never trained.
            assert "odd" in context_text(h, ep)
            # The rubric: length of the final reply (weight 1) + the answer in it (weight 0.5), on the endpoint's reply.
            reply = ep.final_text.strip()
            assert ep.reward == pytest.approx(len(reply) / 100 + 0.5 * ("odd" in reply))
            assert not ep.needs_scoring
    rg = wire_group(group)
    assert not rg.reward_errors
    assert {c.reward for c in rg.completions} == {ep.reward for ep in group.episodes}
    assert all(c.segments and c.segments[0].kind == "model" for c in rg.completions)


def test_task_from_taskset_runs_the_tasksets_own_task(tiny_model_dir: Path, adapter_dir: Path) -> None:
    with served(tiny_model_dir, adapter_dir, {"task_from": "taskset"}, group_size=2) as h:
        # Row 1 is the taskset's task 1 ("b?", answer "even"), whatever the bucketrl row says.
        group = h.run_group(Example(index=1, prompt="zz?", answer="nope"), timeout_s=120)
        past = h.run_group(Example(index=7, prompt="q?", answer="x"), timeout_s=60)
        for ep in group.episodes:
            assert ep.error is None, ep.error
            assert h.svc.decode(ep.turns[0].prompt_ids).count("b?") == 1
            text = context_text(h, ep)
            assert "even" in text and "nope" not in text
    assert [e.error[0] if e.error else None for e in past.episodes] == ["exception", "exception"]
    assert all("row 7 has no task" in e.error[1] and "has 3" in e.error[1] for e in past.episodes if e.error)


def test_what_verifiers_marks_failed_is_a_reward_error(tiny_model_dir: Path, adapter_dir: Path) -> None:
    with served(tiny_model_dir, adapter_dir, {}, group_size=2) as h:
        crashed = h.run_group(Example(index=0, prompt="crash", answer="odd"), timeout_s=60)
        unscored = h.run_group(Example(index=1, prompt="b?", answer="raise"), timeout_s=120)
    for ep in crashed.episodes:
        assert ep.error is not None and ep.error[0] == "exception" and ep.reward is None
        assert "HarnessError" in ep.error[1] and "the harness broke" in ep.error[1]
        assert not ep.turns
    for ep in unscored.episodes:
        # The model's turns ran; the reward raised: no reward, and the group says why.
        assert ep.error is not None and "TaskError" in ep.error[1] and "the reward broke" in ep.error[1]
        assert len(ep.turns) == 2 and ep.reward is None
    rg = wire_group(unscored)
    assert "the reward broke" in rg.reward_errors["exception"]
    assert all(c.reward is None for c in rg.completions)


def test_verifiers_env_names_and_kwargs_are_checked_when_made() -> None:
    for name, kwargs, match in (
        ("verifiers:no_such_taskset_xyz", {}, "no module 'no_such_taskset_xyz'"),
        ("verifiers:tests.envs.vf_lookup", {}, "top-level module"),
        ("verifiers:vf_lookup", {"task_from": "file"}, "task_from 'file' is not one of row, taskset"),
        ("verifiers:vf_lookup", {"nonsense": 1}, "nonsense"),
        ("verifiers:vf_lookup", {"agent": {"max_turns": "many"}}, "max_turns"),
        ("verifiers:vf_needs", {}, r"NeedsData needs tests.*task_from 'taskset'"),
    ):
        with pytest.raises(errors.Invalid, match=match):
            make_env(name, kwargs)
    env = make_env("verifiers:vf_needs", {"task_from": "taskset"})
    # Defaults that keep an episode on this machine and its trajectory whole: local runtime, no retries.
    assert env.config.agent.runtime.type == "subprocess"
    assert env.config.agent.retries.max_retries == 0 and env.config.retries.max_retries == 0
