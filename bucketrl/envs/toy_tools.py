"""``toy:tools``: the built-in multi-turn task. The model must call a tool to look something up, then answer with
what the tool returned, in a later turn.

A row asks about a key (``"q?"``); its answer is a digits rule (``even``, ``odd``, ``low``, ``high``: see
:mod:`bucketrl.tasks.toy`) drawn at random per row, so nothing in the prompt tells it: only the ``lookup`` tool
does. An episode with the tiny model and its template (:mod:`bucketrl.envs.templates`, ``bang`` tool calls):

    <|im_start|>f:lookup<|im_start|>u:q?<|im_start|>a:     prompt
    !                                                      model: calls lookup (a turn containing '!')
    <|endoftext|><|im_start|>t:odd<|im_start|>a:           environment: the tool's result
    13579<|endoftext|>                                     model: the answer, digits of that kind

Reward = ``TOOL_BONUS`` if the lookup was called + (1 - ``TOOL_BONUS``) x the digits task's graded credit of the
final answer against the looked-up rule (a final turn that calls a tool again answers nothing). Without the tool
the best the model can do is guess a rule (at most 0.7 x 0.55, ``even``/``low`` digits); calling it and ignoring
its result gets at most 0.3 + 0.7 x 0.55 = 0.685; using the result, 1.0. Measured: ``bench/toy_tools.py``.
"""

from __future__ import annotations

from typing import Any

from bucketrl.envs.protocol import EpisodeContext
from bucketrl.envs.tools import ToolEnv
from bucketrl.tasks.toy import DEFAULT_LENGTH, toy_reward

TOOL_BONUS = 0.3


class ToyToolsEnv(ToolEnv):
    def __init__(self, length: int = DEFAULT_LENGTH, tool_bonus: float = TOOL_BONUS, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.length = length
        self.tool_bonus = tool_bonus

    def tools_for(self, ctx: EpisodeContext) -> list[Any]:
        def lookup() -> str:
            """Look up the rule of the key in question."""
            ctx.state["looked_up"] = True
            return ctx.row.answer or ""

        return [lookup]

    async def reward(self, ctx: EpisodeContext, messages: list[dict[str, Any]]) -> float:
        last: dict[str, Any] = next((m for m in reversed(messages) if m.get("role") == "assistant"), {})
        answer = "" if last.get("tool_calls") else str(last.get("content") or "")
        graded = toy_reward(answer, ctx.row.answer, task="digits", length=self.length)
        return self.tool_bonus * bool(ctx.state.get("looked_up")) + (1.0 - self.tool_bonus) * graded
