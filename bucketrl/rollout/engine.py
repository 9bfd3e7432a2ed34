"""The engine seam: what the generator's loop and the environments' endpoint need from an inference engine.

    groups = engine.generate([[5, 6, 7]], adapter="demo-v3", n=8, sampling=spec.sampling)
    groups[0][0].token_ids, groups[0][0].logprobs, groups[0][0].finish_reason

The engines themselves, the factory that builds one and the sampling checks live in
:mod:`bucketrl.generator.engines`. Engines are not thread-safe: the worker calls every method from one thread.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from bucketrl import errors

if TYPE_CHECKING:
    from bucketrl.wire import SamplingSpec

FinishReason = Literal["stop", "length", "abort"]
# The adapter name that samples with the base model alone (no adapter: completion jobs of version None).
BASE_ADAPTER = ""


@dataclass(frozen=True)
class SampledCompletion:
    """One completion an engine sampled: token ids, their behaviour logprobs (same length) and why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason


class Engine(Protocol):
    """An inference engine with several LoRA adapters resident, each under a name that never changes meaning."""

    name: str
    # Longest prompt + completion; the worker truncates prompts from the left to leave max_new_tokens.
    max_model_len: int

    def load_adapter(self, name: str, version: int, path: str | Path) -> None:
        """Make the PEFT adapter directory ``path`` available as ``name`` (``{run}-v{N}``, id ``version``).

        Called between generate calls; adapters already loaded stay usable.
        """
        ...

    def unload_adapter(self, name: str) -> None:
        """Free ``name``. Called only once no in-flight work uses it."""
        ...

    def loaded_adapters(self) -> list[str]:
        """Names currently resident."""
        ...

    def generate(
        self,
        prompts: list[list[int]],
        *,
        adapter: str,
        n: int,
        sampling: SamplingSpec,
        while_running: Callable[[], None] | None = None,
    ) -> list[list[SampledCompletion]]:
        """Sample ``n`` completions for each prompt (one request with n=G per prompt); result[i] has n samples.

        ``while_running`` is called once the requests are queued and then between steps, at most every
        ``POLL_S``: vLLM samples meanwhile (its engine core runs in another process), the transformers engine
        between its decode steps, so the worker loads the next adapter version without waiting for the call
        to end. Every completion of the call is still sampled from ``adapter``.
        """
        ...

    def close(self) -> None:
        """Release the engine's memory and processes."""
        ...


class StopAtStep(Exception):
    """Raised by a ``while_running`` hook: stop the call at this step. An engine that can keep what it sampled so
    far raises :class:`CallInterrupted` with it instead (partial rollouts); any other lets this propagate (the
    call's work is lost)."""


class CallInterrupted(Exception):
    """A call stopped by :class:`StopAtStep`, with what it sampled so far: ``partial[i][j]`` is prompt i's j-th
    completion, its tokens and behaviour logprobs up to the stop; ``finish_reason`` ``abort`` when it had not
    ended (it may be continued from the prompt plus these tokens), ``stop``/``length`` when it had."""

    def __init__(self, partial: list[list[SampledCompletion]], cause: StopAtStep) -> None:
        super().__init__(str(cause))
        self.partial = partial
        self.cause = cause


def begin_call(
    loaded: Collection[str], adapter: str, prompts: list[list[int]], while_running: Callable[[], None] | None
) -> bool:
    """The start every engine's ``generate`` shares: NotFound for an adapter that is not loaded, the caller's
    ``while_running`` once, and False when there is nothing to sample."""
    if adapter != BASE_ADAPTER and adapter not in loaded:
        raise errors.NotFound(f"adapter {adapter!r} is not loaded (loaded: {sorted(loaded)})")
    if while_running is not None:
        while_running()
    return bool(prompts)
