"""A small ``verifiers`` (v1) environment, as a user would package one: ``verifiers:vf_lookup`` (this folder on
sys.path: verifiers imports a taskset id as a top-level module).

The taskset's tasks ask about a key; the harness runs its chat loop in-process (no program to install): it asks the
model, answers any tool call with the ``lookup`` tool (or, when the model called none, tells it what ``lookup`` says
in a user message), and asks again, so every episode has two model turns with environment tokens between them.
Two weighted rewards score the final reply. A task whose prompt says ``crash`` makes the harness raise, one whose
answer is ``raise`` a reward.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import verifiers.v1 as vf

LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up the answer for a key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}


class LookupData(vf.TaskData):
    answer: str | None = None


class LookupTask(vf.Task[LookupData]):
    @vf.reward
    async def length(self, trace: vf.Trace) -> float:
        return len(trace.last_reply) / 100.0

    @vf.reward(weight=0.5)
    async def said_answer(self, task: LookupData, trace: vf.Trace) -> float:
        if task.answer == "raise":
            raise ValueError("the reward broke")
        return 1.0 if task.answer and task.answer in trace.last_reply else 0.0


class LookupTaskset(vf.Taskset[LookupTask]):
    def load(self) -> Any:
        for key, answer in (("a", "odd"), ("b", "even"), ("c", "low")):
            yield LookupTask(LookupData(prompt=f"{key}?", answer=answer), self.config.task)


class LookupHarnessConfig(vf.HarnessConfig):
    pass


class LookupHarness(vf.Harness[LookupHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_: Any) -> vf.ProgramResult:
        if "crash" in data.prompt_text:
            raise RuntimeError("the harness broke")
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            system, prompt = self.resolve_prompt(data)
            messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
            messages += (
                [{"role": "user", "content": prompt}]
                if isinstance(prompt, str)
                else [m.model_dump(exclude_none=True) for m in prompt or []]
            )
            for turn in range(2):
                resp = await client.chat.completions.create(model=ctx.model, messages=messages, tools=[LOOKUP_TOOL])
                msg = resp.choices[0].message
                messages.append(msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
                if turn == 1:
                    break
                answer = getattr(data, "answer", None) or "unknown"
                if msg.tool_calls:
                    for call in msg.tool_calls:
                        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(answer)})
                else:
                    messages.append({"role": "user", "content": f"lookup says: {answer}. Answer now."})
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["LookupHarness", "LookupTaskset"]
