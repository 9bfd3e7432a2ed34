"""The transformers engine: peft with several adapters resident by name, batched sampling with a KV cache.

The CPU default of the embedded demo and the reference implementation of the behaviour logprob: every
token is sampled from the processed distribution of :mod:`bucketrl.logprobs` and its logprob is computed
by :func:`bucketrl.logprobs.sampled_token_logprobs` from the very logits it was sampled from.

One ``generate`` call prefills each distinct prompt once, then repeats its KV cache G times
(``DynamicCache.batch_repeat_interleave``), so a group shares its prefix by construction, as with
vLLM's ``n=G``. Finished rows leave the batch so the decode cost follows the live sequences.

Weight sync while sampling: ``generate`` calls its ``while_running`` hook before the first step and then
between decode steps at most every ``POLL_S``, so a version published during a long call is loaded within
about one poll (the worker's hook loads the newest fetched adapter) instead of after the call. Loading an
adapter leaves the active one alone (peft), and the call re-activates its own adapter if a hook changed it:
every token of a call is sampled from the adapter the call was made with. A hook that raises
:class:`~bucketrl.rollout.engine.StopAtStep` stops the call between two steps with its tokens kept
(:class:`~bucketrl.rollout.engine.CallInterrupted`): partial rollouts continue them under a newer adapter, from
the prompt plus those token ids (a new prefill: a KV cache computed under one adapter is not another's).

Adapters are served in the dtype the base computes in (``adapter_dtype``: float32 on the CPU, bfloat16 on a GPU),
as vLLM serves them: a file in another dtype is cast on load (round to nearest even), so a bfloat16 engine holds
the same LoRA tensors whether it was given the bfloat16 or the float32 file of a version. (peft's default would
upcast the LoRA to float32 instead: not what a vLLM generator of the same model computes.)
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bucketrl import errors
from bucketrl.logprobs import process_logits, sampled_token_logprobs
from bucketrl.rollout.engine import BASE_ADAPTER, CallInterrupted, SampledCompletion, StopAtStep, begin_call

if TYPE_CHECKING:
    from bucketrl.generator.settings import GeneratorSettings
    from bucketrl.wire import RunSpec, SamplingSpec

log = logging.getLogger(__name__)

# How often (s) a running generate call hands control to its while_running hook between decode steps.
POLL_S = 0.05


class TransformersEngine:
    name = "transformers"
    continues_calls = True  # a StopAtStep hook keeps the tokens so far (partial rollouts)

    def __init__(self, model_path: str, *, settings: GeneratorSettings, spec: RunSpec) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self._torch = torch
        device = settings.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = settings.dtype
        if dtype == "auto":
            dtype = "float32" if device == "cpu" else "bfloat16"
        self.device = torch.device(device)
        self.adapter_dtype: str = dtype  # the dtype adapters are held and computed in (see the module docstring)
        try:
            base = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        except OSError as exc:
            raise errors.Invalid(
                f"cannot load base model {model_path!r}: {exc}. Set BUCKETRL_MODEL_PATH to a local copy."
            ) from exc
        # transformers wraps Module.to with functools.wraps, whose typing binds self to the first argument.
        self._base = base.to(self.device).eval()  # type: ignore[arg-type]
        self._model: Any = None  # a PeftModel once the first adapter is loaded
        self._adapters: dict[str, int] = {}
        cfg = base.config
        model_len = getattr(cfg, "max_position_embeddings", None)
        self.max_model_len = min(settings.max_model_len, model_len) if model_len else settings.max_model_len
        eos = base.generation_config.eos_token_id if base.generation_config else None
        eos = cfg.eos_token_id if eos is None else eos
        self.eos_ids: set[int] = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.pad_id: int = cfg.pad_token_id if cfg.pad_token_id is not None else next(iter(self.eos_ids), 0)
        seed = settings.seed if settings.seed is not None else random.SystemRandom().randrange(2**63)
        self._gen = torch.Generator(device=self.device).manual_seed(seed)

    # -- adapters -----------------------------------------------------------------------------------

    def load_adapter(self, name: str, version: int, path: str | Path) -> None:
        if name in self._adapters:
            return  # a name means one set of weights: loading it again would change nothing
        from peft import PeftModel

        # autocast off: the LoRA weights take the base layers' dtype (peft casts them on load), as in vLLM.
        if self._model is None:
            self._model = PeftModel.from_pretrained(
                self._base, str(path), adapter_name=name, is_trainable=False, autocast_adapter_dtype=False
            )
            self._model.eval()
        else:
            self._model.load_adapter(str(path), adapter_name=name, is_trainable=False, autocast_adapter_dtype=False)
        self._adapters[name] = version

    def unload_adapter(self, name: str) -> None:
        if name not in self._adapters:
            return
        if len(self._adapters) == 1:
            # peft cannot delete its last adapter; dropping the wrapper restores the bare base model.
            self._model = self._model.unload() and None
            self._base.eval()
        else:
            if self._model.active_adapter == name:
                self._model.set_adapter(next(a for a in self._adapters if a != name))
            self._model.delete_adapter(name)
        del self._adapters[name]

    def loaded_adapters(self) -> list[str]:
        return list(self._adapters)

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
        if not begin_call(self._adapters, adapter, prompts, while_running):
            return []
        if adapter == BASE_ADAPTER:
            # The bare weights: peft's adapter layers off for this call, with no hook inside it (a load there
            # could turn them back on mid-call).
            off = self._model.disable_adapter() if self._model is not None else contextlib.nullcontext()
            with off, self._torch.inference_mode():
                return self._sample(prompts, n, sampling, None, net=self._model or self._base)
        self._model.set_adapter(adapter)
        poll = self._poller(adapter, while_running) if while_running is not None else None
        with self._torch.inference_mode():
            return self._sample(prompts, n, sampling, poll)

    def _poller(self, adapter: str, hook: Callable[[], None]) -> Callable[[], None]:
        """Calls ``hook`` at most every POLL_S; keeps ``adapter`` active across it."""
        due = [time.monotonic() + POLL_S]

        def poll() -> None:
            now = time.monotonic()
            if now < due[0]:
                return
            # Outside inference mode: an adapter loaded here must not be made of inference tensors (peft
            # sets requires_grad on adapter weights when it switches adapters later).
            with self._torch.inference_mode(False):
                hook()
                if self._model.active_adapter != adapter:
                    self._model.set_adapter(adapter)
            due[0] = time.monotonic() + POLL_S

        return poll

    def _sample(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingSpec,
        poll: Callable[[], None] | None = None,
        net: Any = None,
    ) -> list[list[SampledCompletion]]:
        torch = self._torch
        net = net or self._model

        dev = self.device
        b = len(prompts)
        width = max(len(p) for p in prompts)
        max_new = min(sampling.max_new_tokens, self.max_model_len - width)
        if max_new < 1:
            raise errors.Invalid(f"prompt of {width} tokens leaves no room under max_model_len={self.max_model_len}")
        # Left padding: every prompt ends at the same column, so one decode step serves all rows.
        ids = torch.full((b, width), self.pad_id, dtype=torch.long, device=dev)
        mask = torch.zeros((b, width), dtype=torch.long, device=dev)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long, device=dev)
            mask[i, width - len(prompt) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = net(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        cache = out.past_key_values
        # Prefill once per prompt, then one row per completion: [b, ...] -> [b*n, ...].
        cache.batch_repeat_interleave(n)
        logits = out.logits[:, -1, :].float().repeat_interleave(n, dim=0)
        mask = mask.repeat_interleave(n, dim=0)
        next_pos = pos[:, -1:].repeat_interleave(n, dim=0) + 1

        rows = b * n
        live = torch.arange(rows, device=dev)  # which output row each batch row is
        tokens: list[list[int]] = [[] for _ in range(rows)]
        logps: list[list[float]] = [[] for _ in range(rows)]
        reasons: list[str] = ["length"] * rows
        eos = torch.tensor(sorted(self.eos_ids) or [-1], device=dev)
        t, k, p = sampling.temperature, sampling.top_k, sampling.top_p
        for step in range(max_new):
            probs = torch.softmax(process_logits(logits, t, k, p), dim=-1)
            tok = torch.multinomial(probs, 1, generator=self._gen).squeeze(-1)
            lp = sampled_token_logprobs(logits, tok, t, k, p)
            for row, tid, val in zip(live.tolist(), tok.tolist(), lp.tolist(), strict=True):
                tokens[row].append(tid)
                logps[row].append(val)
            done = torch.isin(tok, eos)
            for row in live[done].tolist():
                reasons[row] = "stop"
            keep = ~done
            if step + 1 == max_new or not bool(keep.any()):
                break
            if poll is not None:
                try:
                    poll()
                except StopAtStep as stop:  # partial rollouts: keep what each row sampled; live rows go on later
                    for row in live[keep].tolist():
                        reasons[row] = "abort"
                    raise CallInterrupted(self._grouped(tokens, logps, reasons, b, n), stop) from None
            if not bool(keep.all()):
                idx = keep.nonzero().squeeze(-1)
                cache.batch_select_indices(idx)
                live, tok, mask, next_pos = live[idx], tok[idx], mask[idx], next_pos[idx]
            mask = torch.cat([mask, torch.ones((mask.shape[0], 1), dtype=mask.dtype, device=dev)], dim=-1)
            out = net(
                input_ids=tok[:, None],
                attention_mask=mask,
                position_ids=next_pos,
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float()
            next_pos = next_pos + 1
        return self._grouped(tokens, logps, reasons, b, n)

    @staticmethod
    def _grouped(
        tokens: list[list[int]], logps: list[list[float]], reasons: list[str], b: int, n: int
    ) -> list[list[SampledCompletion]]:
        samples = [SampledCompletion(tokens[r], logps[r], reasons[r]) for r in range(b * n)]  # type: ignore[arg-type]
        return [samples[i * n : (i + 1) * n] for i in range(b)]

    def close(self) -> None:
        self._model = None
        self._adapters.clear()
