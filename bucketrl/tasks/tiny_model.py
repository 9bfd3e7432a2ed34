"""A tiny Qwen2 causal LM with a byte-level BPE tokenizer, built locally (no download).

Real architecture, real tokenizer files: transformers, peft and vLLM all load the directory like any
hub checkout. head_dim is 64 because vLLM's CPU attention kernels do not support 16.

The tokenizer is :mod:`bucketrl.tasks.tiny_tokenizer`'s byte-level BPE (320 tokens, Qwen2's pipeline, a ChatML
chat template, as a Qwen2.5 checkout has): any text round-trips, Arabic included. ``tokenizer="chars"`` builds
the older character-level one (64 tokens, ASCII only, no chat template) for what wants the smallest vocabulary.

    python -m bucketrl.tasks.tiny_model /tmp/tiny-qwen2
    python -m bucketrl.tasks.tiny_model /tmp/tiny-qwen2-chars --tokenizer chars
"""

from __future__ import annotations

import argparse
import json
import string
from pathlib import Path
from typing import Literal, get_args

from bucketrl.tasks import tiny_tokenizer, tiny_warm_start

PAD, EOS, BOS = "<pad>", "<|endoftext|>", "<|im_start|>"
SPECIALS = [PAD, EOS, BOS]
# Characters the character-level tokenizer knows (those the toy tasks use); one token each.
CHARS = list(string.digits + string.ascii_lowercase + " +-*=?:.,()[]<>|#\n!/_;'\"%")
CHARS_VOCAB_SIZE = 64  # >= len(SPECIALS) + len(CHARS); the rest are unused rows
TokenizerKind = Literal["bpe", "chars"]
TOKENIZERS: tuple[TokenizerKind, ...] = get_args(TokenizerKind)
DEFAULT_TOKENIZER: TokenizerKind = "bpe"
# The default build's vocabulary (the run spec's vocab_size for the built-in model).
VOCAB_SIZE = tiny_tokenizer.VOCAB_SIZE
# What build_tiny_model wrote into the directory (seed, vocab_size, tokenizer), read back by its idempotency check.
RECORD = "bucketrl_tiny.json"


def vocab(size: int = CHARS_VOCAB_SIZE) -> dict[str, int]:
    """Token -> id of the character-level tokenizer. ``size`` > CHARS_VOCAB_SIZE pads with filler tokens ``<xN>``
    (a realistic vocabulary's cost in the embedding and output head, as ``bench/gpu_check.py`` wants); every id
    still decodes to something."""
    tokens = SPECIALS + CHARS
    # At least CHARS_VOCAB_SIZE: an embedding row without a token would be sampled but undecodable.
    assert len(tokens) == CHARS_VOCAB_SIZE and size >= CHARS_VOCAB_SIZE, (len(tokens), size)
    tokens += [f"<x{i}>" for i in range(size - CHARS_VOCAB_SIZE)]
    return {tok: i for i, tok in enumerate(tokens)}


def bpe_vocab(size: int = tiny_tokenizer.VOCAB_SIZE) -> dict[str, int]:
    """Token -> id of the BPE tokenizer (the default), padded to ``size`` as :func:`vocab` pads."""
    base = tiny_tokenizer.VOCAB_SIZE
    tokens = tiny_tokenizer.load().get_vocab()
    assert len(tokens) == base and size >= base, (len(tokens), size)
    return {**tokens, **{f"<x{i}>": base + i for i in range(size - base)}}


def build_tokenizer(out_dir: Path, size: int = CHARS_VOCAB_SIZE) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=vocab(size), unk_token=PAD))
    # Every character is its own token; decoding concatenates them back.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, bos_token=BOS, unk_token=PAD)
    fast.save_pretrained(out_dir)


def build_bpe_tokenizer(out_dir: Path, size: int = tiny_tokenizer.VOCAB_SIZE) -> None:
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    tok = tiny_tokenizer.load()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tiny_tokenizer.SPECIALS])
    if size > tiny_tokenizer.VOCAB_SIZE:
        tok.add_tokens([f"<x{i}>" for i in range(size - tiny_tokenizer.VOCAB_SIZE)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, bos_token=BOS, chat_template=tiny_tokenizer.CHAT_TEMPLATE
    )
    fast.save_pretrained(out_dir)


def built_tokenizer(out: Path) -> TokenizerKind:
    """The tokenizer kind of a directory build_tiny_model wrote (one written before the kind was recorded: chars)."""
    record = out / RECORD
    kind = json.loads(record.read_text()).get("tokenizer", "chars") if record.exists() else "chars"
    if kind not in TOKENIZERS:
        raise ValueError(f"{record}: unknown tokenizer {kind!r}")
    return kind


def built_warm_start(out: Path) -> int:
    """The warm start steps of a directory build_tiny_model wrote (0 for one written before they were recorded)."""
    record = out / RECORD
    return int(json.loads(record.read_text()).get("warm_start_steps", 0)) if record.exists() else 0


def build_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    layers: int = 2,
    intermediate_size: int = 256,
    kv_heads: int | None = None,
    vocab_size: int | None = None,
    dtype: str = "float32",
    tokenizer: TokenizerKind = DEFAULT_TOKENIZER,
    warm_start_steps: int = 0,
) -> Path:
    """Write a randomly initialised Qwen2 + tokenizer to ``out_dir`` (idempotent) and return it: tiny by default,
    any shape on request (``bench/gpu_check.py`` builds Qwen2-0.5B's). ``tokenizer``: ``"bpe"`` (the default,
    :mod:`bucketrl.tasks.tiny_tokenizer`, :data:`VOCAB_SIZE` tokens) or ``"chars"`` (:data:`CHARS_VOCAB_SIZE`);
    ``vocab_size`` defaults to the tokenizer's own size. ``warm_start_steps``: that many steps of next-token training on
    text after the random initialisation (:mod:`bucketrl.tasks.tiny_warm_start`: what toy:arabic-math starts from). A
    directory already built with the other tokenizer, or another warm start, is refused."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {', '.join(TOKENIZERS)}, got {tokenizer!r}")
    out = Path(out_dir)
    complete = (out / "config.json").exists() and (out / "tokenizer.json").exists()
    # The record is written last: a warm start cut short has none, and is done again rather than trusted.
    if complete and (not warm_start_steps or (out / RECORD).exists()):
        if (built := built_tokenizer(out)) != tokenizer:
            raise ValueError(
                f"{out} holds the tiny model built with tokenizer={built!r}, not {tokenizer!r}: "
                "build into another directory (or delete this one)"
            )
        if (warmed := built_warm_start(out)) != warm_start_steps:
            raise ValueError(
                f"{out} holds the tiny model built with warm_start_steps={warmed}, not {warm_start_steps}: "
                "build into another directory (or delete this one)"
            )
        return out
    out.mkdir(parents=True, exist_ok=True)
    bpe = tokenizer == "bpe"
    vocab_size = vocab_size or (tiny_tokenizer.VOCAB_SIZE if bpe else CHARS_VOCAB_SIZE)
    ids = bpe_vocab(vocab_size) if bpe else vocab(vocab_size)
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
    # With the BPE's ChatML template, end-of-turn also ends a completion (as it does for Qwen2.5).
    model.generation_config.eos_token_id = [ids[EOS], ids[tiny_tokenizer.IM_END]] if bpe else ids[EOS]
    model.generation_config.pad_token_id = ids[PAD]
    with tiny_warm_start.quiet_progress():  # one small shard's progress bar is noise in `bucketrl up`'s lines
        model.save_pretrained(out, safe_serialization=True)
    (build_bpe_tokenizer if bpe else build_tokenizer)(out, vocab_size)
    if warm_start_steps:
        tiny_warm_start.warm_start(out, warm_start_steps, seed=seed)
    record = {"seed": seed, "vocab_size": vocab_size, "tokenizer": tokenizer, "warm_start_steps": warm_start_steps}
    (out / RECORD).write_text(json.dumps(record))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bucketrl.tasks.tiny_model", description="Write the built-in tiny Qwen2 model."
    )
    parser.add_argument("out_dir", nargs="?", default="tiny-qwen2", help="where to write it (default: tiny-qwen2)")
    parser.add_argument(
        "--tokenizer",
        choices=TOKENIZERS,
        default=DEFAULT_TOKENIZER,
        help="bpe (default, byte-level BPE with a chat template) or chars (64-token character-level, ASCII only)",
    )
    args = parser.parse_args(argv)
    print(build_tiny_model(args.out_dir, tokenizer=args.tokenizer))


if __name__ == "__main__":
    main()
