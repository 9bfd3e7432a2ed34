"""What every engine of the generator keeps to: the sampling it can reproduce, LoRA ranks, adapter names.

The engine interface itself (:class:`~bucketrl.rollout.engine.Engine`, :class:`~bucketrl.rollout.engine.
SampledCompletion`) is in :mod:`bucketrl.rollout.engine`, the factory in :mod:`bucketrl.generator.engines.factory`.

Both engines return, for every sampled token, the behaviour logprob computed exactly as the trainer's
:func:`bucketrl.logprobs.sampled_token_logprobs` computes it: temperature, then top-k / top-p masking,
then log-softmax (docs/design.md invariant 6). Sampling settings the trainer could not reproduce are refused by
:func:`check_reproducible` before an engine is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bucketrl import errors

if TYPE_CHECKING:
    from bucketrl.wire import SamplingSpec

# vLLM treats temperature below 1e-5 as greedy and then returns un-tempered logprobs; far above that,
# 1/T blows the logits up so that fp32 log-softmax loses the digits the trainer's ratio needs.
MIN_TEMPERATURE = 0.05
VLLM_MAX_TEMPERATURE = 2.0
# vLLM's supported LoRA ranks (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


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
