"""Environments for the tests, named like a user's (``tests.envs.env_fixtures:Faulty``): each episode of a group
misbehaves in its own way, by its index in the group."""

from __future__ import annotations

import asyncio
import time
from typing import Any, ClassVar

from bucketrl.envs import EpisodeContext, ToolEnv, tool_schema


async def _turn(ctx: EpisodeContext) -> Any:
    return await ctx.client.chat.completions.create(model=ctx.model, messages=ctx.row.chat())


class Faulty:
    """0 raises after a turn, 1 hangs, 2 asks for too many turns, 3 returns a string, 4 asks for another model,
    5 is fine and 6 leaves the scoring to the run's reward function (returns None)."""

    def __init__(self, hang_s: float = 3600.0) -> None:
        self.hang_s = hang_s

    async def rollout(self, ctx: EpisodeContext) -> Any:
        i = ctx.episode.index
        await _turn(ctx)
        if i == 0:
            raise ValueError("the environment broke")
        if i == 1:
            await asyncio.sleep(self.hang_s)
        if i == 2:
            while True:
                await _turn(ctx)
        if i == 3:
            return "1.0"
        if i == 4:
            other = ctx.model.replace("-v1:", "-v7:")
            await ctx.client.chat.completions.create(model=other, messages=ctx.row.chat())
        if i == 5:
            return 0.5
        return None


class BlockingHang:
    """A plain-def environment (runs in a thread): episode 0 blocks past the timeout, the others finish."""

    def rollout(self, ctx: EpisodeContext) -> float:
        ctx.client.chat.completions.create(model=ctx.model, messages=ctx.row.chat())
        if ctx.episode.index == 0:
            time.sleep(6)
        return 1.0


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def boom() -> str:
    """Always fails."""
    raise RuntimeError("tool exploded")


class ToolErrors(ToolEnv):
    """One real turn, then the tool runner on the calls a model can get wrong."""

    tools: ClassVar[list[Any]] = [add, boom]

    async def rollout(self, ctx: EpisodeContext) -> float:
        await _turn(ctx)
        tools = {fn.__name__: fn for fn in self.tools_for(ctx)}
        calls = [("add", '{"a": 1'), ("add", "[1, 2]"), ("nope", "{}"), ("add", '{"a": 1}'), ("boom", "{}")]
        calls.append(("add", '{"a": 1, "b": 2}'))
        ctx.state["results"] = [await self.call_tool(ctx, tools, name, args) for name, args in calls]
        return 1.0


class Chatty(ToolEnv):
    """Every episode takes ``max_turns`` turns: a tool result after a call, a user message otherwise (so every
    episode has environment tokens between model turns)."""

    def tools_for(self, ctx: EpisodeContext) -> list[Any]:
        def lookup() -> str:
            """Look it up."""
            return ctx.row.answer or ""

        return [lookup]

    async def rollout(self, ctx: EpisodeContext) -> float:
        tools = {fn.__name__: fn for fn in self.tools_for(ctx)}
        messages = ctx.row.chat()
        for _ in range(ctx.max_turns):
            resp = await ctx.client.chat.completions.create(
                model=ctx.model, messages=messages, tools=[tool_schema(fn) for fn in tools.values()]
            )
            msg = resp.choices[0].message
            messages.append(msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
            for call in msg.tool_calls or []:
                result = await self.call_tool(ctx, tools, call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            if not msg.tool_calls:
                messages.append({"role": "user", "content": "more"})
        return float(len(messages))


class Instant:
    """Ends every episode at once (no model turn) with reward 1."""

    async def rollout(self, ctx: EpisodeContext) -> float:
        return 1.0
