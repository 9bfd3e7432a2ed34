"""One row of a run's dataset as every worker sees it (:mod:`bucketrl.datasets` loads them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    index: int
    # The text the reward function gets as ``prompt``: the row's prompt, or a chat row's last user turn.
    prompt: str
    answer: str | None
    # Chat format: the conversation up to the policy's turn ({"role", "content"} dicts), rendered through the
    # model's chat template; None for a plain-text prompt.
    messages: tuple[tuple[str, str], ...] | None = None
    # A plain prompt the model continues as written, never through a chat template (the built-in toy tasks': their
    # rules are a few characters a random model learns to follow; a template would bury them in its markup).
    raw: bool = False
    # The start of the policy's turn, written for it after the prompt (the toy arabic-math task's "\\boxed{"): the
    # completion the reward scores is what the policy wrote after it.
    prefill: str = ""

    def chat(self) -> list[dict[str, str]] | None:
        return None if self.messages is None else [{"role": r, "content": c} for r, c in self.messages]
