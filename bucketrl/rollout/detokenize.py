"""Token ids to text, exactly as vLLM's detokenizer turns them into text, for every place a generator shows or
scores a completion: the reward's text, the OpenAI-compatible endpoint's answer and its stream.

A byte-level BPE (Qwen2.5's, Llama 3's, the built-in model's) has tokens that end inside a UTF-8 character, so a
completion cut by ``max_new_tokens`` can end with half an Arabic letter. ``tokenizer.decode`` renders those bytes
as U+FFFD; vLLM's detokenizer (``vllm.v1.engine.detokenizer.FastIncrementalDetokenizer``) steps a
``tokenizers.decoders.DecodeStream`` over the completion and never emits text that ends in an incomplete
character, so it holds them back, and at the end they are left out (the whole token that ends inside a character,
a space before its first byte included: text is released token by token). :class:`IncrementalDetokenizer` is that same
stream (the same class, the same reset on tokenizers' "Invalid prefix" error), so the text of a list of ids is the
same whichever engine sampled them, and the concatenated stream deltas are the whole text. The ids themselves
(what the trainer trains on) are never changed: only their text holds the incomplete bytes back.

One difference from vLLM, on purpose: vLLM primes its stream with the prompt's ids, here a completion is decoded
on its own (the reward reads the completion alone). For a byte-level BPE the two agree unless the prompt itself
ends inside a character.

A tokenizer without a ``tokenizers`` backend (a "slow" one) is decoded whole at each step and held back while
the text ends in U+FFFD: the same rule, as vLLM's slow path applies it.
"""

from __future__ import annotations

from functools import cache
from typing import Any

REPLACEMENT = "\ufffd"
# tokenizers' error when a decode no longer starts with what was already emitted (vLLM resets the stream on it).
INVALID_PREFIX = "Invalid prefix encountered"


def backend(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` (a transformers fast tokenizer, or one itself), or None."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    return getattr(tokenizer, "backend_tokenizer", None)


class IncrementalDetokenizer:
    """Text of a completion as its tokens arrive: :meth:`step` returns only whole characters ("" while a character
    is incomplete); :attr:`text` is everything returned so far. Special tokens are skipped."""

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._fast = backend(tokenizer)
        self._stream: Any = self._new_stream() if self._fast is not None else None
        self._ids: list[int] = []  # the slow path's ids so far
        self.text = ""

    def _new_stream(self) -> Any:
        from tokenizers.decoders import DecodeStream

        return DecodeStream(skip_special_tokens=self._skip)

    def step(self, token_id: int) -> str:
        delta = self._fast_step(token_id) if self._stream is not None else self._slow_step(token_id)
        self.text += delta
        return delta

    def _fast_step(self, token_id: int) -> str:
        try:
            piece = self._stream.step(self._fast, token_id)
        except Exception as exc:
            if not str(exc).startswith(INVALID_PREFIX):
                raise
            # What vLLM does: start a fresh stream from this token (tokenizers' issue with non-monotonic decodes).
            self._stream = self._new_stream()
            piece = self._stream.step(self._fast, token_id)
        return piece or ""

    def _slow_step(self, token_id: int) -> str:
        self._ids.append(token_id)
        whole = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)
        if whole.endswith(REPLACEMENT) or len(whole) <= len(self.text):
            return ""
        return whole[len(self.text) :]

    def extend(self, token_ids: list[int]) -> list[str]:
        """One :meth:`step` per id: the text each token completed."""
        return [self.step(t) for t in token_ids]


def complete_text(tokenizer: Any, token_ids: list[int]) -> str:
    """The text of a completion's ids: special tokens skipped, a trailing incomplete character left out (what the
    reward scores and the endpoint returns; vLLM's ``CompletionOutput.text`` for the same ids)."""
    detok = IncrementalDetokenizer(tokenizer)
    detok.extend(token_ids)
    return detok.text


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character a byte-level BPE spells each byte with."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The bytes one token adds to the text (b"" for a special token, which the text skips). Exact for a
    byte-level BPE (its token strings spell bytes); any other tokenizer: the UTF-8 of the token decoded alone."""
    fast = backend(tokenizer)
    if fast is not None:
        added = fast.get_added_tokens_decoder().get(token_id)
        if added is not None and added.special:
            return b""
        token = fast.id_to_token(token_id)
        table = _byte_decoder()
        if token is not None and added is None and _is_byte_level(fast) and all(ch in table for ch in token):
            return bytes(table[ch] for ch in token)
    return str(tokenizer.decode([token_id], skip_special_tokens=True)).encode("utf-8")


def _is_byte_level(fast: Any) -> bool:
    from tokenizers import decoders

    return isinstance(fast.decoder, decoders.ByteLevel)


def token_label(raw: bytes) -> str:
    """A token's text for a logprobs entry: its characters when its bytes are whole UTF-8, else OpenAI's spelling of
    bytes that are not (``bytes:\\xd8``) rather than a U+FFFD that would lose them."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
