"""Chat messages to prompt token ids: the model's own chat template, or bucketrl's minimal one.

A model whose tokenizer has a chat template is rendered with it (``apply_chat_template`` with ``tools=``, so
templates that describe tools to the model do). A model without one, and the built-in tiny model (whose ChatML
template knows no tools, and whose random weights could not learn a JSON tool call in a demo's minutes), gets
:data:`TINY_CHAT_TEMPLATE`, made for a small vocabulary (it was the character-level one's: no whitespace tokens):

    <|im_start|>f:lookup                    one line per offered tool (its name)
    <|im_start|>s:...  <|im_start|>u:...    system, user (the role's first letter, then ':')
    <|im_start|>t:odd                       a tool result
    <|im_start|>a:!<|endoftext|>            an assistant turn: its content verbatim, then end-of-text
    <|im_start|>a:                          the generation prompt

Its tool-call syntax is ``bang`` (:mod:`bucketrl.envs.parsers`). An assistant message is rendered from its content
as the endpoint returned it (the whole text the model wrote), so the next turn's prompt is this turn's prompt and
completion extended; only a message without content (written by an agent, not returned by us) renders its calls
as ``!name{arguments}``.
"""

from __future__ import annotations

import json
from typing import Any

from bucketrl.envs.parsers import ToolSyntax
from bucketrl.tasks.tiny_tokenizer import CHAT_TEMPLATE as BUILT_IN_CHAT_TEMPLATE

TINY_CHAT_TEMPLATE = (
    "{%- for t in (tools or []) -%}<|im_start|>f:{{ (t.function or t).name }}{%- endfor -%}"
    "{%- for m in messages -%}<|im_start|>{{ m.role[0] }}:"
    "{%- if m.role == 'assistant' -%}"
    "{%- if m.content -%}{{ m.content }}{%- else -%}"
    "{%- for c in (m.tool_calls or []) -%}{%- set f = c.function or c -%}!{{ f.name }}"
    "{%- if f.arguments -%}{{ f.arguments if f.arguments is string else f.arguments | tojson }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}<|endoftext|>"
    "{%- else -%}{{ m.content or '' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>a:{%- endif -%}"
)


def has_own_template(tokenizer: Any) -> bool:
    """Whether episodes render through the model's own template (not the built-in model's: see above)."""
    template = getattr(tokenizer, "chat_template", None)
    return bool(template) and template != BUILT_IN_CHAT_TEMPLATE


def tool_syntax(tokenizer: Any) -> ToolSyntax:
    """How this model writes tool calls: by the template that taught it (see bucketrl.envs.parsers)."""
    template = getattr(tokenizer, "chat_template", None)
    if not has_own_template(tokenizer):
        return "bang"
    text = template if isinstance(template, str) else json.dumps(template)
    return "hermes" if "<tool_call>" in text else "none"


def text_of(content: Any) -> str | None:
    """An OpenAI message content (a string, or a list of parts) as text."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates expect them: content as text, tool-call arguments as objects (templates
    write them with ``tojson``; a string would be quoted twice), as vLLM's server does."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if "content" in m:
            m["content"] = text_of(m["content"])
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for c in calls:
                c = dict(c)
                f = dict(c.get("function") or {})
                args = f.get("arguments")
                if isinstance(args, str):
                    try:
                        parsed = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        parsed = None
                    if isinstance(parsed, dict):
                        f["arguments"] = parsed
                c["function"] = f
                fixed.append(c)
            m["tool_calls"] = fixed
        out.append(m)
    return out


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Prompt token ids for the next assistant turn (the generation prompt included)."""
    ids = tokenizer.apply_chat_template(
        template_messages(messages),
        tools=tools or None,
        chat_template=None if has_own_template(tokenizer) else TINY_CHAT_TEMPLATE,
        add_generation_prompt=True,
        tokenize=True,
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return [int(t) for t in ids]
