"""The built-in model's tokenizer (``build_tiny_model``'s default, ``tokenizer="bpe"``): a small byte-level BPE,
trained once from :data:`CORPUS` and shipped as ``bucketrl/tasks/tokenizer/tokenizer.json`` (no download, the
same file on every machine).

Byte-level: every byte is a token, so any text (Arabic, emoji, control characters) round-trips and there is no
unknown token; the older character-level tokenizer (``tokenizer="chars"``) drops every character outside its 53
(Arabic letters, capitals, backslashes and braces: ``\\boxed{}`` reads as ``boxed``). The pipeline is Qwen2's (NFC,
its split regex, ByteLevel), which transformers' ``Qwen2Tokenizer`` rebuilds from the vocabulary and merges, so the
directory loads the same whichever class reads it. Merges are learnt with every ASCII punctuation character split
off, so each digit (Qwen's regex splits them) and each symbol the toy tasks use stays one token of its own and
their prompts and rewards read as before. :data:`VOCAB_SIZE` stays small (the 256 bytes, the specials, a few dozen
merges): the toy tasks' random-policy reward falls with the share of the vocabulary that is digits (to about a
quarter of the character vocabulary's with this one), and their sampling temperature makes up for it
(bucketrl.tasks.toy).

    python -m bucketrl.tasks.tiny_tokenizer      # retrain and rewrite tokenizer.json (deterministic)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent / "tokenizer"
CORPUS = HERE / "corpus.txt"
TOKENIZER_JSON = HERE / "tokenizer.json"

# Ids 0-2 as the character-level tokenizer had them (pad, end-of-text, im_start); im_end as Qwen2.5 adds it.
PAD, EOS, IM_START, IM_END = "<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS = [PAD, EOS, IM_START, IM_END]
VOCAB_SIZE = 320  # 256 bytes + 4 specials + 60 merges (10 of them the digits of SINGLE_TOKEN_DIGITS)
# Eastern Arabic digits (U+0660-0669) are two bytes each, and the corpus alone merges only the frequent ones ("٤" was
# one token, "٣" two): each is a merge of its own, so an Arabic number is one token a digit as an ASCII one is, and
# the Arabic toy task's answer is one choice among ten tokens. Persian digits (U+06F0-06F9) stay two bytes: ten
# more merges would push out "ve", and "even:", the English demo's prompt, would tokenise differently.
SINGLE_TOKEN_DIGITS = "٠١٢٣٤٥٦٧٨٩"
# Qwen2's pre-tokenizer split (transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX).
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Split off before training only: no merge joins a symbol to anything.
ASCII_PUNCTUATION = r"[!-/:-@\[-`{-~]"
# Qwen2.5's ChatML without its default system prompt (a toy prompt stays a few tokens).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _qwen_pipeline(tok: Any) -> None:
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()


def train(lines: list[str], vocab_size: int = VOCAB_SIZE) -> Any:
    """A byte-level BPE of ``vocab_size`` tokens learnt from ``lines`` (same lines, same tokenizer), with Qwen2's
    pipeline and every digit of :data:`SINGLE_TOKEN_DIGITS` one token: the trainer learns as many merges as leave
    room for the digit merges it did not learn itself, which come last."""
    from tokenizers import Tokenizer

    for learnt in range(vocab_size, vocab_size - len(SINGLE_TOKEN_DIGITS) - 1, -1):
        # Each further learnt merge is either a digit's (one fewer to add) or another: the total grows by 0 or 1.
        data = json.loads(_train_bpe(lines, learnt).to_str())
        missing = [d for d in SINGLE_TOKEN_DIGITS if _byte_level(d) not in data["model"]["vocab"]]
        if learnt + len(missing) == vocab_size:
            break
    else:  # pragma: no cover - the loop above always meets vocab_size
        raise AssertionError("no merge count gives the vocabulary size")
    vocab, merges = data["model"]["vocab"], data["model"]["merges"]
    for digit in missing:
        spelt = _byte_level(digit)
        if len(spelt) != 2:  # an Eastern Arabic digit is two UTF-8 bytes, so two ByteLevel characters
            raise ValueError(f"{digit!r} is not two bytes")
        first, second = spelt[0], spelt[1]
        merges.append([first, second])
        vocab[first + second] = len(vocab)  # the specials are in it: ids stay 0..n-1
    tok = Tokenizer.from_str(json.dumps(data))
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    return tok


def _byte_level(text: str) -> str:
    """``text``'s UTF-8 bytes as ByteLevel's printable characters (how the vocabulary spells a token)."""
    from tokenizers import pre_tokenizers

    return "".join(piece for piece, _ in pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(text))


def _train_bpe(lines: list[str], vocab_size: int) -> Any:
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(ASCII_PUNCTUATION), behavior="isolated"),
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    _qwen_pipeline(tok)
    return tok


def corpus_lines() -> list[str]:
    return [line for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]


def write(path: Path = TOKENIZER_JSON) -> Path:
    """Train from :data:`CORPUS` and write ``path`` (sorted, indented JSON: a diff shows what changed)."""
    data = json.loads(train(corpus_lines()).to_str())
    path.write_text(json.dumps(data, ensure_ascii=False, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return path


def load() -> Any:
    """The shipped tokenizer (``tokenizers.Tokenizer``)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKENIZER_JSON))


def encode(text: str) -> list[int]:
    """Token ids of ``text`` (no special tokens added), as a model built with ``tokenizer="bpe"`` encodes it."""
    return list(load().encode(text, add_special_tokens=False).ids)


if __name__ == "__main__":
    print(write(Path(sys.argv[1]) if len(sys.argv) > 1 else TOKENIZER_JSON))
