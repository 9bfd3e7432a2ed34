"""``ToolEnv``: the chat-with-tools loop most environments need, and how a Python function becomes a tool.

    from bucketrl.envs import ToolEnv

    def add(a: int, b: int) -> int:
        "Add two integers."
        return a + b

    class Calculator(ToolEnv):
        tools = [add]                                   # or tools_for(ctx) for per-episode tools

        async def reward(self, ctx, messages):          # optional; None -> the run's reward function scores
            return 1.0 if messages[-1].get("content", "").strip() == ctx.row.answer else 0.0

Each model turn is a ``chat.completions`` call with the tools' JSON schemas (from the signatures: ``str``,
``int``, ``float``, ``bool``, ``list``, ``dict``; the docstring's first line describes it). Tool calls run in order;
each result (``str()`` of the return value) goes back as a ``tool`` message. A call the tool cannot run (unknown
tool, arguments that are not a JSON object, wrong arguments, the tool raising) sends the error back as the tool's
result, so the model can recover, and is counted (``episode/tool_errors_total``). The loop ends when a turn calls
no tool or after ``episode.max_turns`` model turns.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable
from typing import Any, ClassVar

from bucketrl.envs.protocol import EpisodeContext

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI tool definition of ``fn`` (parameters from its signature)."""
    props: dict[str, Any] = {}
    required = []
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        ann = p.annotation if p.annotation is not inspect.Parameter.empty else None
        if isinstance(ann, str):  # `from __future__ import annotations`
            ann = {"str": str, "int": int, "float": float, "bool": bool, "list": list, "dict": dict}.get(ann)
        props[name] = {"type": _JSON_TYPES[ann]} if ann in _JSON_TYPES else {}
        if p.default is inspect.Parameter.empty:
            required.append(name)
    doc = (inspect.getdoc(fn) or "").strip().splitlines()
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": doc[0] if doc else "",
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


class ToolEnv:
    """Subclass and set ``tools`` (or override ``tools_for``); optionally ``system_prompt`` and ``reward``."""

    tools: ClassVar[list[Callable[..., Any]]] = []
    system_prompt: ClassVar[str | None] = None

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    def tools_for(self, ctx: EpisodeContext) -> list[Callable[..., Any]]:
        return list(self.tools)

    def first_messages(self, ctx: EpisodeContext) -> list[dict[str, Any]]:
        messages = ctx.row.chat()
        if self.system_prompt and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    async def reward(self, ctx: EpisodeContext, messages: list[dict[str, Any]]) -> Any:
        """The episode's reward from its final conversation; None: the run's reward function scores the last
        assistant message."""
        return None

    async def rollout(self, ctx: EpisodeContext) -> Any:
        tools = {fn.__name__: fn for fn in self.tools_for(ctx)}
        schemas = [tool_schema(fn) for fn in tools.values()]
        messages = self.first_messages(ctx)
        for _ in range(ctx.max_turns):
            resp = await ctx.client.chat.completions.create(model=ctx.model, messages=messages, tools=schemas or None)
            msg = resp.choices[0].message
            messages.append(msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
            if not msg.tool_calls:
                break
            for call in msg.tool_calls:
                result = await self.call_tool(ctx, tools, call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        ctx.state["messages"] = messages
        return await self.reward(ctx, messages)

    async def call_tool(
        self, ctx: EpisodeContext, tools: dict[str, Callable[..., Any]], name: str, arguments: str
    ) -> str:
        """The tool's result as text, or the error the model is shown (and counted)."""
        fn = tools.get(name)
        if fn is None:
            ctx.tool_error()
            return f"error: no tool named {name!r} (tools: {', '.join(tools) or 'none'})"
        try:
            args = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            ctx.tool_error()
            return f"error: the arguments are not JSON ({exc.msg})"
        if not isinstance(args, dict):
            ctx.tool_error()
            return "error: the arguments must be a JSON object"
        try:
            out = fn(**args)
            if inspect.isawaitable(out):
                out = await out
        except TypeError as exc:
            ctx.tool_error()
            return f"error: wrong arguments for {name}: {exc}"
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            ctx.tool_error()
            return f"error: {name} raised {type(exc).__name__}: {exc}"
        return out if isinstance(out, str) else json.dumps(out) if isinstance(out, dict | list) else str(out)
