"""Tool-call syntaxes, the tiny chat template and how turns become training samples (pure functions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bucketrl.envs.parsers import parse, parse_bang, parse_hermes
from bucketrl.envs.templates import render, tool_syntax
from bucketrl.rollout.trajectory import Turn, build_samples

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
# A Hermes-style template (what Qwen2.5's does with tools, shortened): calls as <tool_call> JSON, re-serialised.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>s:{% for t in tools %}{{ t.function.name }}{% endfor %}{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role[0] }}:{{ m.content or '' }}"
    "{%- for c in (m.tool_calls or []) %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{%- endfor %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>a:{% endif %}"
)


def test_hermes_calls_content_and_malformed_blocks() -> None:
    p = parse_hermes('ok <tool_call>{"name": "lookup", "arguments": {"key": "q"}}</tool_call>')
    assert p.content == "ok" and [(c.name, json.loads(c.arguments)) for c in p.calls] == [("lookup", {"key": "q"})]
    two = parse_hermes('<tool_call>{"name":"a","arguments":"{bad"}</tool_call><tool_call>{"name":"b"}')
    # Arguments pass through as the model wrote them (the tool runner reports bad JSON); an unclosed last block
    # still counts.
    assert [(c.name, c.arguments) for c in two.calls] == [("a", "{bad"), ("b", "{}")] and two.content is None
    bad = parse_hermes('text <tool_call>{"name": lookup}</tool_call> <tool_call>[1]</tool_call>')
    assert bad.calls == [] and bad.malformed == 2 and bad.content.startswith("text <tool_call>")
    assert parse("<tool_call>{}</tool_call>", "hermes", []).calls == []  # no tools offered: plain text


def test_bang_syntax() -> None:
    assert parse_bang("12!xyz", ["lookup"]).calls[0].name == "lookup"  # one tool: '!' alone calls it
    named = parse_bang('!add{"a":1}', ["add", "lookup"])
    assert (named.calls[0].name, named.calls[0].arguments, named.content) == ("add", '{"a":1}', '!add{"a":1}')
    assert parse_bang("!x", ["add", "lookup"]).calls[0].name == "x"  # unknown: the tool runner says so
    assert parse_bang("13579", ["lookup"]).calls == []


def test_templates_and_their_syntax(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tool_syntax(tok) == "bang"
    first = render(tok, [{"role": "user", "content": "q?"}], TOOLS)
    assert tok.decode(first) == "<|im_start|>f:lookup<|im_start|>u:q?<|im_start|>a:"
    completion = [*tok.encode("x!"), tok.eos_token_id]
    history = [
        {"role": "user", "content": "q?"},
        {"role": "assistant", "content": "x!", "tool_calls": [{"id": "1", "function": {"name": "lookup"}}]},
        {"role": "tool", "content": "odd", "tool_call_id": "1"},
    ]
    second = render(tok, history, TOOLS)
    assert second[: len(first) + len(completion)] == first + completion  # an exact extension
    tok.chat_template = HERMES_TEMPLATE
    assert tool_syntax(tok) == "hermes"
    call = {"id": "1", "type": "function", "function": {"name": "lookup", "arguments": '{"k":1}'}}
    text = tok.decode(render(tok, [{"role": "assistant", "content": None, "tool_calls": [call]}], TOOLS))
    # Arguments reach the template as an object, not a JSON string quoted twice.
    assert '"arguments": {"k": 1}}</tool_call>' in text


def _turn(prompt: list[int], completion: list[int]) -> Turn:
    return Turn(prompt, completion, [-0.5] * len(completion), "stop")


def test_turns_extend_one_sample_or_split() -> None:
    turns = [_turn([1, 2], [3, 4]), _turn([1, 2, 3, 4, 9, 9], [5]), _turn([1, 2, 3, 4, 9, 9, 5], [6])]
    (one,) = build_samples(turns)
    assert one.prompt_ids == [1, 2]
    assert [(k, ids) for k, ids, _ in one.segments] == [
        ("model", [3, 4]),
        ("env", [9, 9]),
        ("model", [5]),
        ("model", [6]),
    ]
    assert one.seq_len == 8
    # A re-rendered history (the 3 the model wrote came back as 7): a new sample with its own prompt.
    split = build_samples([_turn([1, 2], [3]), _turn([1, 2, 7, 8], [4]), _turn([1, 2, 7, 8, 4, 8], [5])])
    assert [s.prompt_ids for s in split] == [[1, 2], [1, 2, 7, 8]]
    assert [k for k, _, _ in split[1].segments] == ["model", "env", "model"]
    assert build_samples([_turn([1], [])]) == []


@pytest.mark.parametrize("lp", [1e-7])
def test_rounding_above_zero_is_clamped(lp: float) -> None:
    (s,) = build_samples([Turn([1], [2], [lp], "stop")])
    assert s.segments[0][2] == [0.0]
