"""Tool calls in a model's text, turned into OpenAI ``tool_calls`` (the endpoint's side of tool use).

Two syntaxes, picked from the chat template (:func:`bucketrl.envs.templates.tool_syntax`):

- ``hermes``: ``<tool_call>{"name": "lookup", "arguments": {"key": "q"}}</tool_call>``, one block per call, what
  the Qwen2/2.5, Hermes and many other templates teach their models. The message's ``content`` is the text before
  the first block. A block that is not a JSON object with a string ``name`` is not a call: the turn's whole text
  is returned as content and the block is counted as a malformed call (``tool/malformed_calls_total``).
- ``bang``: the built-in tiny model's (:data:`bucketrl.envs.templates.TINY_CHAT_TEMPLATE`): a turn calls a tool
  when it contains ``!``; what follows is the call: a tool's name, optionally followed by a JSON object of
  arguments (``!lookup{"key":"q"}``). When the request offers exactly one tool the name may be left out: ``!``
  alone calls it with no arguments and whatever follows is not read. The content is the turn's whole text (the
  tiny template renders an assistant turn's content verbatim, so the next turn's prompt extends this one).

Arguments are passed on as the JSON text the model wrote (OpenAI's ``function.arguments`` is a string): a call
whose arguments are not a JSON object reaches the environment as such, and its tool runner reports the error
(:mod:`bucketrl.envs.tools`), as an OpenAI client would see it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Literal

ToolSyntax = Literal["hermes", "bang", "none"]

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-.]*")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text as the model wrote it (may be malformed: the tool runner reports it)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:16]}")


@dataclass(frozen=True)
class Parsed:
    content: str | None
    calls: list[ToolCall]
    malformed: int = 0  # blocks that looked like a call but could not be read as one


def parse(text: str, syntax: ToolSyntax, tool_names: list[str]) -> Parsed:
    """The assistant message a turn's ``text`` is, given the tools the request offered (none: no calls)."""
    if not tool_names or syntax == "none":
        return Parsed(text, [])
    if syntax == "hermes":
        return parse_hermes(text)
    return parse_bang(text, tool_names)


def parse_hermes(text: str) -> Parsed:
    start = text.find("<tool_call>")
    if start < 0:
        return Parsed(text, [])
    calls: list[ToolCall] = []
    malformed = 0
    for m in _HERMES.finditer(text, start):
        try:
            obj = json.loads(m.group(1).strip())
        except json.JSONDecodeError:
            malformed += 1
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            malformed += 1
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args)))
    if malformed:
        # What the model wrote is what the agent sees: nothing of it is silently dropped.
        return Parsed(text, calls, malformed)
    content = text[:start].strip()
    return Parsed(content or None, calls)


def parse_bang(text: str, tool_names: list[str]) -> Parsed:
    bang = text.find("!")
    if bang < 0:
        return Parsed(text, [])
    rest = text[bang + 1 :]
    m = _NAME.match(rest)
    name = m.group(0) if m else ""
    if name in tool_names:
        args = rest[len(name) :].strip() or "{}"
        return Parsed(text, [ToolCall(name, args)])
    if len(tool_names) == 1:
        return Parsed(text, [ToolCall(tool_names[0], "{}")])
    # Several tools and none named: a call nobody can run, reported by the tool runner as an unknown tool.
    return Parsed(text, [ToolCall(name or "?", rest[len(name) :].strip() or "{}")])
