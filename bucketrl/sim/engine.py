"""``BUCKETRL_ENGINE=sim``: a SIMULATED engine for benchmarks and tests. It holds no model.

Each call takes the time :class:`bucketrl.sim.gpu.SimGpu` says a GPU of the stated throughput would take
(prefill, batched decode until the longest completion ends, long-tailed lengths) and returns well-formed
samples: random token ids below the run's ``vocab_size``, one finite logprob <= 0 per token. The rest of the
generator (leases, adapter download and sha256 check, prompt leases, scoring, submission) runs unchanged,
which is what the simulation is for: measuring the system around the GPU. A hook that raises
:class:`~bucketrl.rollout.engine.StopAtStep` cuts the call after the decode steps its time covered
(:class:`~bucketrl.rollout.engine.CallInterrupted`); a continuation's prompt (the prompt plus the tokens so far) is
prefilled and charged in full, as a real engine re-prefills under a new adapter. Its samples carry no meaning and
its logprobs are not a policy's: never train on them (the simulated trainer of :mod:`bucketrl.sim.trainer`
does not).

Loading an adapter checks the directory the worker unpacked (``adapter_config.json`` present) and takes
``load_adapter_s``. ``clock`` and ``sleep`` are injectable so tests can check the timing model exactly.

With ``BUCKETRL_SIM_TOKENS_FILE`` set, the engine keeps in that file the tokens it has decoded so far (a call's
tokens accrue step by step over its decode time: its short completions first), calls cut off by a kill or a notice
included: what a benchmark needs to count work lost with a SIGKILLed process, whose own counters die with it
(``bench/preemption.py``).

The generator knows it only once :func:`register` ran (the ``bucketrl`` command calls it; so do the tests that
run a generator on it): production code never imports the simulation.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bucketrl import errors
from bucketrl.generator.engines.factory import register_engine
from bucketrl.rollout.engine import CallInterrupted, SampledCompletion, StopAtStep, begin_call
from bucketrl.sim.gpu import SimGpu, simulate_call

if TYPE_CHECKING:
    from bucketrl.generator.settings import GeneratorSettings
    from bucketrl.wire import RunSpec, SamplingSpec

# How often (s) a running call hands control to its while_running hook (as the real engines do).
POLL_S = 0.05
TOKENS_FILE_ENV = "BUCKETRL_SIM_TOKENS_FILE"


class SimEngine:
    name = "sim"
    continues_calls = True  # a StopAtStep hook keeps the tokens so far (partial rollouts)

    def __init__(
        self,
        *,
        settings: GeneratorSettings,
        spec: RunSpec,
        gpu: SimGpu | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.gpu = gpu or SimGpu()
        self.max_model_len = settings.max_model_len
        self.max_loras = settings.max_loras or spec.max_staleness + 2
        self.vocab_size = spec.vocab_size
        self._sleep, self._clock = sleep, clock
        seed = settings.seed if settings.seed is not None else random.SystemRandom().randrange(2**63)
        self._rng = np.random.default_rng(seed)
        self._adapters: dict[str, int] = {}
        self.busy_s = 0.0  # simulated GPU time spent (calls and loads)
        self.tokens_decoded = 0.0  # calls cut off included (their decoded part)
        self._tokens_file = os.environ.get(TOKENS_FILE_ENV) or None
        # Partial rollouts: a completion cut at a step keeps the length it was drawn with; its continuation (the
        # prompt plus its tokens so far) decodes the rest, so cutting changes no length. Keyed by those ids.
        self._rest: dict[tuple[int, ...], int] = {}

    def load_adapter(self, name: str, version: int, path: str | Path) -> None:
        if name in self._adapters:
            return
        if not (Path(path) / "adapter_config.json").is_file():
            raise errors.Invalid(f"adapter {name!r}: {path} has no adapter_config.json")
        if len(self._adapters) >= self.max_loras:
            raise errors.Invalid(f"adapter {name!r}: {self.max_loras} adapters are resident already (max_loras)")
        self._wait(self.gpu.load_adapter_s, None)
        self._adapters[name] = version

    def unload_adapter(self, name: str) -> None:
        self._adapters.pop(name, None)

    def loaded_adapters(self) -> list[str]:
        return list(self._adapters)

    def generate(
        self,
        prompts: list[list[int]],
        *,
        adapter: str,
        n: int,
        sampling: SamplingSpec,
        while_running: Callable[[], None] | None = None,
    ) -> list[list[SampledCompletion]]:
        if not begin_call(self._adapters, adapter, prompts, while_running):
            return []
        prompt_lens = [len(p) for p in prompts]
        lengths = None
        if any(tuple(p) in self._rest for p in prompts):  # continuations: the rest of their drawn lengths
            lengths = [
                [min(self._rest.pop(tuple(p)), sampling.max_new_tokens)] * n
                if tuple(p) in self._rest
                else self.gpu.sample_lengths(self._rng, n, sampling.max_new_tokens, p)
                for p in prompts
            ]
        call = simulate_call(
            self.gpu,
            self._rng,
            prompt_lens,
            n=n,
            max_new_tokens=sampling.max_new_tokens,
            vocab_size=self.vocab_size,
            lengths=lengths,
            prompts=prompts,
        )
        samples = [[SampledCompletion(s.token_ids, s.logprobs, s.finish_reason) for s in g] for g in call.samples]  # type: ignore[arg-type]
        lengths = [[len(s.token_ids) for s in g] for g in samples]

        def decoded(elapsed_s: float) -> float:
            # Step by step, not pro rata: the short completions of a batch are done early, so a call abandoned
            # half-way has decoded most of their tokens (a linear count would understate what it wasted).
            k = self.gpu.steps_done(prompt_lens, lengths, elapsed_s)
            return float(sum(min(n, k) for g in lengths for n in g))

        start, base = self._clock(), self.tokens_decoded
        try:
            self._wait(call.seconds, while_running, tokens=sum(n for g in lengths for n in g), decoded=decoded)
        except StopAtStep as stop:
            self.busy_s -= max(0.0, call.seconds - (self._clock() - start))  # the GPU time it did not take
            k = self.gpu.steps_done(prompt_lens, lengths, self._clock() - start)
            kept = [[self._cut(p, s, k) for s in g] for p, g in zip(prompts, samples, strict=True)]
            self._decoded(base + sum(len(s.token_ids) for g in kept for s in g))  # what the steps decoded, exactly
            raise CallInterrupted(kept, stop) from None
        return samples

    def _cut(self, prompt: list[int], s: SampledCompletion, steps: int) -> SampledCompletion:
        """``s`` as it stood after ``steps`` decode steps; an unfinished one remembers the length left."""
        if len(s.token_ids) <= steps:
            return s
        ids = s.token_ids[:steps]
        self._rest[tuple(prompt + ids)] = len(s.token_ids) - steps
        return SampledCompletion(ids, s.logprobs[:steps], "abort")

    def _wait(
        self,
        seconds: float,
        hook: Callable[[], None] | None,
        tokens: int = 0,
        decoded: Callable[[float], float] | None = None,
    ) -> None:
        """Spend ``seconds`` as the GPU would, calling ``hook`` every POLL_S meanwhile (between 'steps'); ``tokens``
        accrue to ``tokens_decoded`` as the time passes (``decoded(elapsed)`` of them, else pro rata), before each
        hook call: a notice's abandon keeps them."""
        self.busy_s += seconds
        start, base = self._clock(), self.tokens_decoded
        end = start + seconds
        while (left := end - self._clock()) > 0:
            self._sleep(min(POLL_S, left))
            elapsed = self._clock() - start
            self._decoded(base + (decoded(elapsed) if decoded else tokens * min(1.0, elapsed / seconds)))
            if hook is not None and self._clock() < end:
                hook()
        self._decoded(base + tokens)

    def _decoded(self, total: float) -> None:
        self.tokens_decoded = total
        if self._tokens_file is not None:  # a small atomic rewrite: the reader never sees half a number
            tmp = f"{self._tokens_file}.tmp"
            with open(tmp, "w") as fh:
                fh.write(f"{total:.1f}")
            os.replace(tmp, self._tokens_file)

    def close(self) -> None:
        self._adapters.clear()


def register() -> None:
    """Make ``BUCKETRL_ENGINE=sim`` build a :class:`SimEngine` in this process."""
    register_engine("sim", lambda settings, spec, _model: SimEngine(settings=settings, spec=spec))
