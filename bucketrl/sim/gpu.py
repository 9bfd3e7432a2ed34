"""A simulated GPU: how long an engine call would take, and well-formed samples to return from it.

This is a model, not an engine: it stands in for the one part of a deployment this project cannot run
here (a GPU), so that everything around it (leases, adapter transfer, admission control, the queue, the
trainer's pace) can be run for real at a scale of hundreds of generators. It is used by the ``sim``
engine (:mod:`bucketrl.sim.engine`) and the asyncio fleet of :mod:`bucketrl.sim.fleet`.

Timing (continuous batching, memory-bound decode):

- prefill: the call's prompt tokens at ``prefill_tokens_per_s`` (a prompt is prefilled once for its n=G
  samples: they share the prefix);
- decode: every step emits one token for each sequence still running and takes
  ``decode_step_s + running * decode_step_per_seq_s``; the call lasts until its longest sequence ends, so
  ``sum over steps = max_len * decode_step_s + sum(lengths) * decode_step_per_seq_s``;
- loading an adapter takes ``load_adapter_s``.

So one sequence decodes at ``1 / (decode_step_s + batch * decode_step_per_seq_s)`` tokens/s and a batch at
``batch`` times that. Completion lengths are long-tailed: lognormal with median ``length_median`` and
shape ``length_sigma``, capped at the run's ``max_new_tokens`` (``finish_reason`` ``length`` there,
``stop`` otherwise). Defaults describe a ~1.5B model in bf16 on one current datacenter GPU (about 80
tokens/s per sequence, 5k tokens/s at a batch of 64); every figure is a ``BUCKETRL_SIM_*`` setting.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class SimGpu(BaseSettings):
    """The simulated GPU's throughput and the completion-length distribution (``BUCKETRL_SIM_*``)."""

    model_config = SettingsConfigDict(env_prefix="BUCKETRL_SIM_", extra="ignore", frozen=True)

    prefill_tokens_per_s: float = Field(20_000.0, gt=0, description="Prompt tokens prefilled per second.")
    decode_step_s: float = Field(0.012, ge=0, description="Time of one decode step, whatever the batch.")
    decode_step_per_seq_s: float = Field(
        0.00005, ge=0, description="Added to a decode step per sequence running in it."
    )
    load_adapter_s: float = Field(0.05, ge=0, description="Time to load one LoRA adapter into the engine.")
    length_median: float = Field(150.0, gt=0, description="Median completion length (tokens).")
    length_sigma: float = Field(1.0, ge=0, description="Lognormal shape of completion lengths (0 = all equal).")
    length_prompt_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of the log-length variance that belongs to the prompt (a hard prompt is long again when "
        "it is sampled again); 0: every completion drawn independently.",
    )

    def tokens_per_s_per_seq(self, batch: int) -> float:
        return 1.0 / (self.decode_step_s + batch * self.decode_step_per_seq_s)

    def call_seconds(self, prompt_lens: list[int], lengths: list[list[int]]) -> float:
        """How long one engine call takes: prefill of ``prompt_lens`` plus decoding ``lengths[i]`` per prompt."""
        flat = [n for group in lengths for n in group]
        if not flat:
            return sum(prompt_lens) / self.prefill_tokens_per_s
        prefill = sum(prompt_lens) / self.prefill_tokens_per_s
        return prefill + max(flat) * self.decode_step_s + sum(flat) * self.decode_step_per_seq_s

    def steps_done(self, prompt_lens: list[int], lengths: list[list[int]], elapsed_s: float) -> int:
        """Decode steps a call of :meth:`call_seconds` has completed ``elapsed_s`` after it started."""
        flat = sorted(n for group in lengths for n in group)
        t = sum(prompt_lens) / self.prefill_tokens_per_s
        k = 0
        for i, n in enumerate(flat):  # between two completions' ends the batch is constant: whole stretches at once
            running = len(flat) - i
            per_step = self.decode_step_s + running * self.decode_step_per_seq_s
            stretch = n - k
            if t + stretch * per_step > elapsed_s:
                return k + max(0, int((elapsed_s - t) / per_step))
            t += stretch * per_step
            k = n
        return k

    def sample_lengths(
        self, rng: np.random.Generator, count: int, max_new_tokens: int, prompt: list[int] | None = None
    ) -> list[int]:
        raw = rng.lognormal(math.log(self.length_median), self.length_sigma, count) if self.length_sigma else None
        if raw is None:
            raw = np.full(count, self.length_median)
        elif self.length_prompt_share and prompt is not None:
            # The prompt's own draw (the same every time it is sampled), mixed with each completion's.
            own = np.random.default_rng(zlib.crc32(np.asarray(prompt, dtype=np.int64).tobytes())).standard_normal()
            z = (np.log(raw) - math.log(self.length_median)) / self.length_sigma
            share = self.length_prompt_share
            mixed = math.sqrt(share) * own + math.sqrt(1 - share) * z
            raw = np.exp(math.log(self.length_median) + self.length_sigma * mixed)
        return np.clip(np.rint(raw), 1, max_new_tokens).astype(np.int64).tolist()


@dataclass(frozen=True)
class SimSample:
    """One simulated completion (the same fields as an engine's ``SampledCompletion``)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass(frozen=True)
class SimCall:
    """What one simulated engine call produced and how long the GPU would have taken for it."""

    samples: list[list[SimSample]]
    seconds: float


def simulate_call(
    gpu: SimGpu,
    rng: np.random.Generator,
    prompt_lens: list[int],
    *,
    n: int,
    max_new_tokens: int,
    vocab_size: int,
    lengths: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
) -> SimCall:
    """Sample ``n`` completions per prompt: long-tailed lengths (or ``lengths``, given), token ids in
    ``[0, vocab_size)``, behaviour logprobs finite and <= 0 (an exponential spread, as a tempered softmax gives),
    and the call's duration."""
    if lengths is None:
        lengths = [gpu.sample_lengths(rng, n, max_new_tokens, p) for p in prompts] if prompts else None
    if lengths is None:
        lengths = [gpu.sample_lengths(rng, n, max_new_tokens) for _ in prompt_lens]
    samples: list[list[SimSample]] = []
    for group in lengths:
        out = []
        for length in group:
            ids = rng.integers(0, vocab_size, length).tolist()
            lps = (-rng.exponential(1.0, length)).tolist()
            out.append(SimSample(ids, lps, "length" if length >= max_new_tokens else "stop"))
        samples.append(out)
    return SimCall(samples, gpu.call_seconds(prompt_lens, lengths))


# The benchmarks' GPU model (bench/scale_sim.py, bench/wan.py): a ~1.5B model on one current GPU, sped up so that
# runs fit a 2-core machine's budget: a call of 8 sequences decodes at ~160 tokens/s each; lengths lognormal
# (median 150, sigma 1) capped at 1024, so a call lasts ~3.5 s on average and 6 s when one completion hits the cap
# (the long tail the async design absorbs).
BENCH_GPU: dict[str, float] = {
    "decode_step_s": 0.006,
    "decode_step_per_seq_s": 0.00005,
    "prefill_tokens_per_s": 20000.0,
    "load_adapter_s": 0.05,
    "length_median": 150.0,
    "length_sigma": 1.0,
}
