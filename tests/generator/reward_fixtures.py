"""User reward functions for the tests (``tests.generator.reward_fixtures:<name>``): well-behaved and not."""

from __future__ import annotations

import os
import time


def length_reward(completion: str, answer: str | None, *, prompt: str, scale: float = 1.0) -> float:
    return scale * len(completion)


def raises(completion: str, answer: str | None, *, prompt: str) -> float:
    if completion == "ok":
        return 1.0
    raise RuntimeError("this reward always fails")


def hangs(completion: str, answer: str | None, *, prompt: str) -> float:
    if completion == "ok":
        return 1.0
    time.sleep(3600)
    return 0.0


def dies(completion: str, answer: str | None, *, prompt: str) -> float:
    if completion == "ok":
        return 1.0
    os._exit(3)


def garbage(completion: str, answer: str | None, *, prompt: str) -> object:
    return {"nan": float("nan"), "str": "1.0", "inf": float("inf")}.get(completion, 0.5)


def sleepy(completion: str, answer: str | None, *, prompt: str, seconds: float = 60.0) -> float:
    """Scores slowly but successfully (keeps a generator busy in the lifecycle tests). Gives up early when its
    parent dies, so a SIGKILLed generator leaves no process behind for long."""
    parent = os.getppid()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if os.getppid() != parent:
            os._exit(0)
        time.sleep(0.1)
    return 1.0


not_callable = 42
