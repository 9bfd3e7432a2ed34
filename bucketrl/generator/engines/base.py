"""The engine seam: what the worker loop needs from an inference engine, and the factory that builds one.

    engine = make_engine(settings, spec)          # vllm, transformers or sim, from BUCKETRL_ENGINE
    engine.load_adapter("demo-v3", 3, "/cache/demo/v3")
    groups = engine.generate([[5, 6, 7]], adapter="demo-v3", n=8, sampling=spec.sampling)
    groups[0][0].token_ids, groups[0][0].logprobs, groups[0][0].finish_reason

Both engines return, for every sampled token, the behaviour logprob computed exactly as the trainer's
:func:`bucketrl.logprobs.sampled_token_logprobs` computes it: temperature, then top-k / top-p masking,
then log-softmax (docs/design.md invariant 6). Sampling settings the trainer could not reproduce are refused by
:func:`check_reproducible` before an engine is built.

Engines are not thread-safe: the worker calls every method from one thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from bucketrl import errors

if TYPE_CHECKING:
    from bucketrl.generator.settings import GeneratorSettings
    from bucketrl.wire import RunSpec, SamplingSpec

FinishReason = Literal["stop", "length", "abort"]

# vLLM treats temperature below 1e-5 as greedy and then returns un-tempered logprobs; far above that,
# 1/T blows the logits up so that fp32 log-softmax loses the digits the trainer's ratio needs.
MIN_TEMPERATURE = 0.05
VLLM_MAX_TEMPERATURE = 2.0
# vLLM's supported LoRA ranks (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class Sample:
    """One completion: sampled token ids, their behaviour logprobs (same length) and why it ended."""

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
    ) -> list[list[Sample]]:
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


def check_reproducible(sampling: SamplingSpec, vocab_size: int, engine: str = "transformers") -> None:
    """Refuse sampling settings whose behaviour logprobs the trainer cannot recompute, or the engine cannot
    sample (``Invalid``, naming the run spec field to change)."""
    if sampling.temperature < MIN_TEMPERATURE:
        raise errors.Invalid(
            f"sampling.temperature={sampling.temperature} is below {MIN_TEMPERATURE}: vLLM samples greedily there and "
            "returns un-tempered logprobs, so the trainer's ratio would be wrong. Raise the run's sampling.temperature."
        )
    if sampling.top_k > vocab_size:
        raise errors.Invalid(
            f"sampling.top_k={sampling.top_k} exceeds vocab_size={vocab_size}; use -1 to disable top-k."
        )
    if engine == "vllm" and sampling.temperature > VLLM_MAX_TEMPERATURE:
        raise errors.Invalid(
            f"sampling.temperature={sampling.temperature}: vLLM samples only up to {VLLM_MAX_TEMPERATURE}; lower it "
            "or run the generator with BUCKETRL_ENGINE=transformers."
        )


def vllm_lora_rank(r: int) -> int:
    """The smallest rank vLLM accepts that holds a LoRA of rank ``r``."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise errors.Invalid(f"lora.r={r} exceeds the largest rank vLLM supports ({VLLM_LORA_RANKS[-1]})")


def adapter_name(run: str, version: int) -> str:
    """Invariant 3: one name, one set of weights, forever."""
    return f"{run}-v{version}"


def make_engine(settings: GeneratorSettings, spec: RunSpec) -> Engine:
    """Build the engine ``settings.engine`` names for the run's base model (``settings.model_path`` wins)."""
    check_reproducible(spec.sampling, spec.vocab_size, settings.engine)
    model = settings.model_path or spec.base_model
    if settings.engine == "vllm":
        from bucketrl.generator.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model, settings=settings, spec=spec)
    if settings.engine == "sim":
        from bucketrl.generator.engines.sim_engine import SimEngine

        return SimEngine(settings=settings, spec=spec)
    from bucketrl.generator.engines.transformers_engine import TransformersEngine

    return TransformersEngine(model, settings=settings, spec=spec)
