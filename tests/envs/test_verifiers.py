"""A verifiers environment (a small taskset built here, verifiers 0.4's v1 stack) runs through the ``verifiers``
adapter: each bucketrl episode is one verifiers episode whose model calls go through verifiers' interception
server to the generator's endpoint (pinned, recorded, trained); its reward is the taskset's ``@vf.reward``; a
failing verifiers episode is a failed bucketrl episode; the taskset module passes the reward-module allow-list."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from bucketrl.datasets import Example
from bucketrl.envs.protocol import make_env
from bucketrl.generator.trust import check_spec
from bucketrl.preflight import ConfigError
from tests.envs.support import episode_spec, harness
from tests.proxy.harness import make_spec

TASKSET = """
import verifiers.v1 as vf


class Data(vf.TaskData):
    answer: str = ""


class LengthTask(vf.Task[Data]):
    @vf.reward
    async def short_answers(self, task, trace) -> float:
        if task.answer == "boom":
            raise ValueError("the grader broke")
        return 0.25 if task.answer == "odd" else 0.75


class Tiny(vf.Taskset[LengthTask]):
    def load(self):
        for key, answer in (("q", "odd"), ("r", "even"), ("s", "boom")):
            yield LengthTask(Data(prompt=f"{key}?", answer=answer), self.config.task)


__all__ = ["Tiny"]
"""


@pytest.fixture()
def taskset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    pytest.importorskip("verifiers.v1")  # the optional extra (installed by scripts/setup.sh)
    (tmp_path / "bucketrl_vf_tiny.py").write_text(textwrap.dedent(TASKSET))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "bucketrl_vf_tiny"


def test_a_verifiers_taskset_runs_through_the_endpoint(tiny_model_dir: Path, adapter_dir: Path, taskset: str) -> None:
    env = make_env("verifiers", {"taskset": taskset})
    assert len(env.tasks) == 3
    with harness(tiny_model_dir, adapter_dir, episode_spec(tiny_model_dir), env) as h:
        odd = h.run_group(Example(index=0, prompt="q?", answer="odd"))
        even = h.run_group(Example(index=1, prompt="r?", answer="even"))
        broken = h.run_group(Example(index=2, prompt="s?", answer="boom"))
    for group, reward in ((odd, 0.25), (even, 0.75)):
        for ep in group.episodes:
            assert ep.error is None and ep.reward == reward
            # The model call went through verifiers' interception to our endpoint: one recorded, trainable turn.
            assert len(ep.turns) == 1 and ep.turns[0].completion_ids
            assert h.svc.decode(ep.turns[0].prompt_ids) == f"u:{'q' if reward == 0.25 else 'r'}?a:"  # the task's prompt
    for ep in broken.episodes:
        assert ep.reward is None and ep.error is not None and ep.error[0] == "exception"
        assert "the grader broke" in ep.error[1] or "verifiers episode failed" in ep.error[1]


def test_the_taskset_module_passes_the_allow_list(taskset: str) -> None:
    def spec(ts: str):  # type: ignore[no-untyped-def]
        return make_spec(dataset={"uri": "toy:tools", "size": 4}, env={"name": "verifiers", "kwargs": {"taskset": ts}})

    check_spec(spec(taskset), "bucketrl_vf_tiny", "")
    with pytest.raises(ConfigError, match=r"env.kwargs.taskset 'evil_tasks'"):
        check_spec(spec("evil_tasks"), "bucketrl_vf_tiny", "")
