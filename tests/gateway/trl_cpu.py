"""What TRL 1.16's ``AsyncGRPOTrainer`` needs to train on a CPU, and nothing more (the GPU is the missing edge).

Two calls in TRL assume CUDA, and only these two are replaced here:

- ``get_peak_flops_per_device`` asks ``torch.cuda.get_device_name`` for the MFU metric; on a CPU it raises. It is
  answered ``None``, which is TRL's own answer for a device it has no peak figure for (MFU off, nothing else).
- Tree attention (``trl/experimental/async_grpo/packing.py``) calls FlashAttention-3's ``flash_attn_varlen_func``,
  a CUDA kernel TRL fetches from the Hugging Face Hub. ``cpu_varlen_attention`` computes the same thing in plain
  torch: each query segment attends to its key path, causally aligned to the path's end (FA's ``causal=True`` for
  ``seqlen_q <= seqlen_k``), with grouped-query heads repeated.

Everything else (the packing, the fused LM head, the loss, PEFT, the adapter save, every HTTP call) is TRL's own.
The tiny model's tokenizer gets a chat template (TRL's rollout worker always renders prompts through one) and a
response template (TRL parses each completion with it and refuses a tokenizer it has no template for).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
# transformers' response-parsing spec: the whole completion is the assistant's content, up to the tiny model's EOS.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "fields": {"content": {"close_pattern": r"<\|endoftext\|>", "content": "text"}},
}


def cpu_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    **_: Any,
) -> torch.Tensor:
    """``flash_attn_varlen_func`` for (tokens, heads, dim) tensors; no sliding window (Qwen2 has none here)."""
    if window_size != (-1, -1):
        raise NotImplementedError("sliding-window tree attention is not needed by the tiny model")
    groups = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for i in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        k0, k1 = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        qs = q[q0:q1].transpose(0, 1)  # heads, Lq, dim
        ks = k[k0:k1].repeat_interleave(groups, dim=1).transpose(0, 1)
        vs = v[k0:k1].repeat_interleave(groups, dim=1).transpose(0, 1)
        lq, lk = q1 - q0, k1 - k0
        # Query row r sees keys up to lk - lq + r: the segment's own tokens sit at the end of its path.
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq) if causal else None
        att = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=softmax_scale)
        out[q0:q1] = att.transpose(0, 1)
    return out


def patch_trl_for_cpu(set_attr: Callable[[object, str, object], None] = setattr) -> None:
    """``set_attr``: pytest's ``monkeypatch.setattr`` in a test (undone after it), plain ``setattr`` in a script."""
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    set_attr(async_grpo_trainer, "get_peak_flops_per_device", lambda *_a, **_k: None)
    set_attr(packing, "_flash_attn", lambda: SimpleNamespace(flash_attn_varlen_func=cpu_varlen_attention))


def tiny_tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = CHAT_TEMPLATE
    tok.response_template = RESPONSE_TEMPLATE
    return tok


def even_ids_reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The toy reward (module-level: TRL pickles it into its rollout process): the share of the completion's tokens
    whose id is even, about 0.5 for the untrained tiny model (near-uniform over its 320 ids). Each token is a coin
    flip, so a group of 8 samples of 8 tokens almost never ties (a tie is a zero advantage) and every step moves the
    adapter. LoRA cannot raise it far: the logits are the tied embeddings times a final hidden state of fixed norm
    (RMSNorm, which LoRA leaves alone), which caps the even share at about 0.67 for the tiny model, and "low token
    ids score high" (the earlier toy) at 0.60 from 0.51; parity leaves the wider gap."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def trl_trainer(
    model_dir: Path,
    url: str,
    out: Path,
    *,
    steps: int,
    group: int = 4,
    prompts_per_step: int = 2,
    completion_tokens: int = 6,
    learning_rate: float = 5e-2,
    max_inflight: int | None = None,
    temperature: float = 1.0,
) -> Any:
    """TRL's ``AsyncGRPOTrainer`` on the tiny model, as a user's script builds it: LoRA, a sync every step,
    ``prompts_per_step`` groups of ``group`` completions a step, ``max_inflight`` requests in flight (default: one
    step's completions)."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from tests.generator.helpers import RANK

    prompts = [f"{a}+{b}=" for a in range(4) for b in range(4)]
    config = AsyncGRPOConfig(
        output_dir=str(out),
        vllm_server_base_url=url,  # the one line that points TRL at bucketrl
        vllm_server_timeout=60,
        max_steps=steps,
        weight_sync_steps=1,
        max_staleness=1,
        num_generations=group,
        per_device_train_batch_size=prompts_per_step * group,
        max_completion_length=completion_tokens,
        max_inflight_tasks=max_inflight or prompts_per_step * group,
        token_budget=0,  # a fixed count per micro-batch: one step is per_device_train_batch_size samples
        learning_rate=learning_rate,
        temperature=temperature,
        dtype="float32",
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        request_timeout=120,
        heartbeat_stale_after_s=300,
    )
    return AsyncGRPOTrainer(
        model=str(model_dir),
        reward_funcs=even_ids_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts]}),
        processing_class=tiny_tokenizer(str(model_dir)),
        peft_config=LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules="all-linear"),
    )
