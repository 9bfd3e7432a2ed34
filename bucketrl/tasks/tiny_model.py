"""A tiny Qwen2 causal LM with a character-level tokenizer, built locally (no download).

Real architecture, real tokenizer files: transformers, peft and vLLM all load the directory like any
hub checkout. head_dim is 64 because vLLM's CPU attention kernels do not support 16.

    python -m bucketrl.tasks.tiny_model /tmp/tiny-qwen2
"""

from __future__ import annotations

import json
import string
import sys
from pathlib import Path

PAD, EOS, BOS = "<pad>", "<|endoftext|>", "<|im_start|>"
SPECIALS = [PAD, EOS, BOS]
# Characters the toy tasks use; one token each.
CHARS = list(string.digits + string.ascii_lowercase + " +-*=?:.,()[]<>|#\n!/_;'\"%")
VOCAB_SIZE = 64  # >= len(SPECIALS) + len(CHARS); the rest are unused rows


def vocab(size: int = VOCAB_SIZE) -> dict[str, int]:
    """Token -> id. ``size`` > VOCAB_SIZE pads with filler tokens ``<xN>`` (a realistic vocabulary's cost in the
    embedding and output head, as ``bench/gpu_check.py`` wants); every id still decodes to something."""
    tokens = SPECIALS + CHARS
    # At least VOCAB_SIZE: an embedding row without a token would be sampled but undecodable.
    assert len(tokens) == VOCAB_SIZE and size >= VOCAB_SIZE, (len(tokens), size)
    tokens += [f"<x{i}>" for i in range(size - VOCAB_SIZE)]
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer(out_dir: Path, size: int = VOCAB_SIZE) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=vocab(size), unk_token=PAD))
    # Every character is its own token; decoding concatenates them back.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, bos_token=BOS, unk_token=PAD)
    fast.save_pretrained(out_dir)


def build_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    layers: int = 2,
    intermediate_size: int = 256,
    kv_heads: int | None = None,
    vocab_size: int = VOCAB_SIZE,
    dtype: str = "float32",
) -> Path:
    """Write a randomly initialised Qwen2 + tokenizer to ``out_dir`` (idempotent) and return it: tiny by default,
    any shape on request (``bench/gpu_check.py`` builds Qwen2-0.5B's)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    ids = vocab(vocab_size)
    # head_dim is no declared field of transformers' dataclass-typed Qwen2Config: passed as an extra, as it accepts.
    config = Qwen2Config(  # type: ignore[call-arg]
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=hidden_size // 64,
        num_key_value_heads=kv_heads or hidden_size // 64,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        dtype=dtype,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.generation_config.eos_token_id = ids[EOS]
    model.generation_config.pad_token_id = ids[PAD]
    from transformers.utils import logging as hf_logging

    # Quietly: a progress bar for one small shard is noise in `bucketrl up`'s start-up lines.
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
    build_tokenizer(out, vocab_size)
    (out / "bucketrl_tiny.json").write_text(json.dumps({"seed": seed, "vocab_size": vocab_size}))
    return out


if __name__ == "__main__":
    print(build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "tiny-qwen2"))
