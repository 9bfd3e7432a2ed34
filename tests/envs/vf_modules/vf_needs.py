"""A verifiers taskset whose tasks need a field a bucketrl dataset row does not have (``tests``)."""

from __future__ import annotations

from typing import Any

import verifiers.v1 as vf


class NeedsData(vf.TaskData):
    tests: list[str]


class NeedsTask(vf.Task[NeedsData]):
    @vf.reward
    async def passed(self, task: NeedsData) -> float:
        return float(len(task.tests))


class NeedsTaskset(vf.Taskset[NeedsTask]):
    def load(self) -> Any:
        yield NeedsTask(NeedsData(prompt="p", tests=["t"]), self.config.task)


__all__ = ["NeedsTaskset"]
