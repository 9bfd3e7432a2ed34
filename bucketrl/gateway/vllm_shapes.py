"""vLLM's HTTP shapes, as far as the gateway speaks them (vLLM 0.32's ``entrypoints/openai`` protocol models).

Requests ignore fields the gateway does not act on (vLLM's own models accept many more); a sampling field that
would change the distribution and that the pool cannot honour is refused (400) rather than silently dropped.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CompletionRequest(_Lenient):
    model: str
    prompt: list[int] | list[list[int]] = Field(description="Token ids: one prompt, or a list of prompts.")
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    n: int = Field(1, ge=1)
    return_token_ids: bool = False
    logprobs: int | None = None
    seed: int | None = None

    def prompts(self) -> list[list[int]]:
        if self.prompt and isinstance(self.prompt[0], list):
            return [list(p) for p in self.prompt]
        return [list(self.prompt)]  # type: ignore[arg-type]

    def unsupported(self) -> str | None:
        """What of this request the pool cannot sample as asked, or None."""
        if self.top_k not in (None, 0, -1):
            return f"top_k={self.top_k} is not supported by the bucketrl gateway (only 0 or -1: off)"
        if self.min_p not in (None, 0.0):
            return f"min_p={self.min_p} is not supported by the bucketrl gateway"
        if self.repetition_penalty not in (None, 1.0):
            return f"repetition_penalty={self.repetition_penalty} is not supported by the bucketrl gateway"
        if not all(self.prompts()):
            return "every prompt needs at least one token id"
        return None


class LoadLoraRequest(_Lenient):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False


class UnloadLoraRequest(_Lenient):
    lora_name: str = ""


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    # The gateway holds no tokenizer: text is empty; TRL (and any token-in/token-out client) reads token_ids.
    text: str = ""
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's ``ErrorResponse``: ``{"error": {message, type, param, code}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def model_card(model_id: str, max_model_len: int | None, root: str | None = None, parent: str | None = None) -> dict:
    return {
        "id": model_id,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "bucketrl",
        "root": root or model_id,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [],
    }
