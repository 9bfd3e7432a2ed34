"""Exact detokenisation of the built-in model's byte-level BPE (issue 34): Arabic completions cut at every token
keep their ids, and their text (what the reward scores and the endpoint returns) holds back the incomplete bytes
of a character instead of showing U+FFFD; the stream's deltas join into that same text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bucketrl.rollout.detokenize import IncrementalDetokenizer, complete_text, token_bytes, token_label
from bucketrl.tasks import tiny_tokenizer

# Letters, tatweel, Eastern Arabic and Persian digits, the Arabic decimal separator, question mark and comma,
# RLM and ALM marks, a shadda, and a 4-byte character, so that token boundaries fall inside 2-, 3- and 4-byte
# characters.
ARABIC = [
    "ما ناتج ٣ + ٤؟ الجواب \\boxed{٧}",
    "فكّر خطوة بخطوة، ثم ضع الجواب النهائي داخل \\boxed{}",
    "\u200f-٣٫٥ والعدد ١٬٠٠٠ كـــبير ۴۲ \u061c٤٢ 🙂 انتهى",
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


class DecodeOnly:
    """A tokenizer with no ``tokenizers`` backend (a "slow" one): only ``decode``, as such a class offers it."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))


def whole_decode_reference(tok: Any, ids: list[int]) -> str:
    """The text as one decode of the longest run of tokens whose text ends in a whole character."""
    for k in range(len(ids), 0, -1):
        text = tok.decode(ids[:k], skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            return str(text)
    return ""


@pytest.mark.parametrize("text", ARABIC, ids=["sum", "instruction", "marks"])
def test_arabic_cut_at_every_token_holds_back_incomplete_characters(tok: Any, text: str) -> None:
    ids = tiny_tokenizer.encode(text)
    assert complete_text(tok, ids) == text  # whole: exactly the text
    cut_inside = 0
    for k in range(len(ids) + 1):
        prefix = ids[:k]
        got = complete_text(tok, prefix)
        raw = b"".join(token_bytes(tok, t) for t in prefix)
        # The ids are the text's bytes to here; the text is their whole characters up to the last token that ends
        # in a whole one (a token ending inside a character is held back whole, its leading space too, as vLLM does).
        assert text.encode().startswith(raw)
        assert "\ufffd" not in got and raw.decode("utf-8", errors="ignore").startswith(got)
        assert got == whole_decode_reference(tok, prefix)
        detok = IncrementalDetokenizer(tok)
        deltas = detok.extend(prefix)
        assert "".join(deltas) == got and "\ufffd" not in "".join(deltas)
        assert complete_text(DecodeOnly(tok), prefix) == got  # the slow path holds back the same
        cut_inside += "\ufffd" in tok.decode(prefix, skip_special_tokens=True)
    assert cut_inside > 0  # some cuts do fall inside a character (where a plain decode shows U+FFFD)


def test_token_labels_spell_partial_characters_as_bytes(tok: Any) -> None:
    text = ARABIC[0]
    ids = tiny_tokenizer.encode(text)
    labels = [token_label(token_bytes(tok, t)) for t in ids]
    assert all("\ufffd" not in label for label in labels)
    assert any(label.startswith("bytes:\\x") for label in labels)
    assert token_bytes(tok, tok.convert_tokens_to_ids(tiny_tokenizer.IM_END)) == b""  # skipped, as in the text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ids=st.lists(st.integers(min_value=0, max_value=tiny_tokenizer.VOCAB_SIZE - 1), max_size=24))
def test_any_ids_read_as_their_longest_whole_decode(tok: Any, ids: list[int]) -> None:
    # Random tokens (special tokens, stray continuation bytes) included: the text never ends inside a character,
    # the stream's deltas join into it, and it is the whole decode of the ids up to the last whole character.
    got = complete_text(tok, ids)
    assert not got.endswith("\ufffd")
    assert "".join(IncrementalDetokenizer(tok).extend(ids)) == got
    assert got == whole_decode_reference(tok, ids)
