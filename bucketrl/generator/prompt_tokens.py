"""The token ids the generator samples a leased prompt from: the chat template applied, cut to leave room for
the completion, cached per dataset index."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bucketrl.datasets import prompt_token_ids
from bucketrl.generator.metrics import GeneratorMetrics
from bucketrl.rollout.example import Example


class PromptTokens:
    def __init__(
        self,
        *,
        tokenizer: Any,
        max_model_len: int,
        examples: list[Example],
        max_new_tokens: Callable[[], int],
        metrics: GeneratorMetrics,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.examples = examples
        self.max_new_tokens = max_new_tokens  # the run's (mutable between versions: forget() on a change)
        self.metrics = metrics
        self._cache: dict[int, list[int]] = {}

    def ids(self, index: int) -> list[int]:
        """The training prompt ``index``'s ids, cut for the run's ``sampling.max_new_tokens``."""
        ids = self._cache.get(index)
        if ids is None:
            ids = self.encode(self.examples[index], self.max_new_tokens())
            self._cache[index] = ids
        return ids

    def forget(self) -> None:
        """``sampling.max_new_tokens`` changed: the cached cuts no longer fit."""
        self._cache = {}

    def encode(self, example: Example, max_new_tokens: int) -> list[int]:
        """The prompt's token ids (through the chat template for chat rows), cut to leave room to sample."""
        ids = prompt_token_ids(self.tokenizer, example.prompt, example.chat(), raw=example.raw, prefill=example.prefill)
        room = self.max_model_len - max_new_tokens
        if len(ids) > room:
            # Keep the end of the prompt (where the question is) so the completion always fits.
            ids = ids[-room:]
            self.metrics.add("rollout/truncated_prompts_total")
        return ids
