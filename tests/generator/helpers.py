"""Test helpers: LoRA adapters with real (non-zero) weights for the tiny model, and the trainer's recomputation."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from bucketrl.tasks.tiny_model import VOCAB_SIZE
from bucketrl.wire import DatasetSpec, LoraSpec, RewardSpec, RunSpec, SamplingSpec

RANK = 8


def make_adapter(model_dir: Path, out_dir: Path, *, seed: int, r: int = RANK) -> Path:
    """A peft LoRA adapter on every linear layer with random A and B (peft's default B=0 would be a no-op)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if (out_dir / "adapter_config.json").exists():
        return out_dir
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(base, cfg).save_pretrained(out_dir)
    return out_dir


@cache
def _peft_model(model_dir: str, adapter_dir: str) -> Any:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def teacher_forced_logprobs(
    model_dir: Path, adapter_dir: Path, prompt: list[int], tokens: list[int], sampling: SamplingSpec
) -> list[float]:
    """What the trainer computes: one forward pass over prompt+completion, then bucketrl.logprobs."""
    import torch

    from bucketrl.logprobs import sampled_token_logprobs

    model = _peft_model(str(model_dir), str(adapter_dir))
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    lp = sampled_token_logprobs(logits, torch.tensor(tokens), sampling.temperature, sampling.top_k, sampling.top_p)
    return lp.tolist()


def run_spec(model_dir: Path, **overrides: Any) -> RunSpec:
    fields: dict[str, Any] = {
        "base_model": str(model_dir),
        "lora": LoraSpec(r=RANK, alpha=2.0 * RANK),
        "group_size": 4,
        "max_staleness": 1,
        "sampling": SamplingSpec(temperature=1.0, max_new_tokens=16),
        "reward": RewardSpec(name="exact"),
        "dataset": DatasetSpec(uri="toy:digits", size=8),
        "vocab_size": VOCAB_SIZE,
    }
    fields.update(overrides)
    return RunSpec(**fields)
