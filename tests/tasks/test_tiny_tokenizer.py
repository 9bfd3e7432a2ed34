"""The built-in model's byte-level BPE (issue 34, the default of ``build_tiny_model``): no text is lost, the toy
tasks' digits and symbols are one token each, the shipped file is what the script writes, and transformers loads
the built directory with its template. ``tokenizer="chars"`` still builds the character vocabulary, and neither
kind of directory is handed back for the other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bucketrl.tasks import tiny_model, tiny_tokenizer
from bucketrl.tasks.tiny_model import (
    CHARS,
    CHARS_VOCAB_SIZE,
    EOS,
    PAD,
    VOCAB_SIZE,
    build_tiny_model,
    built_tokenizer,
    vocab,
)
from bucketrl.tasks.tiny_tokenizer import IM_END, IM_START, encode
from bucketrl.tasks.toy import CHAT_TASKS, EASTERN_DIGITS, TASKS, toy_examples

BPE_VOCAB_SIZE = tiny_tokenizer.VOCAB_SIZE
# Not in the corpus: a held-back Arabic text, with Persian digits, diacritics, a tatweel and bidi marks.
HELD_BACK = "تُعدّ القراءة غذاءً للعقل؛ وفي المكتبة ۱۲۳ كتابـاً جديداً \u200f−٧٫٥ — هل قرأتَ أحدها؟ 🙂"


@pytest.fixture(scope="module")
def chars_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built once for the module: a few hundred milliseconds each time."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-chars"), tokenizer="chars")


def test_every_corpus_line_and_a_held_back_text_round_trip_with_no_unknown_token() -> None:
    tok = tiny_tokenizer.load()
    assert tok.get_vocab_size() == BPE_VOCAB_SIZE and tok.model.unk_token is None
    for text in [*tiny_tokenizer.corpus_lines(), HELD_BACK, "\x00\t\r\n", "x" * 300]:
        assert tok.decode(tok.encode(text).ids) == text


def test_merges_cross_utf8_character_boundaries_and_join_no_symbol() -> None:
    # One Arabic letter is two bytes: a token of the word "the" (ال) covers four.
    assert len(encode("الجواب")) < len("الجواب".encode())
    digits_and_symbols = [c for c in CHARS if not c.isalpha()]
    for c in digits_and_symbols:
        assert len(encode(c)) == 1, c
    text = "12+34=?(5*6)-7/8:9,0.[]<>|#!_;%"
    assert len(encode(text)) == len(text)


def test_every_eastern_arabic_digit_is_one_token() -> None:
    # As in a Qwen2.5 vocabulary: the Arabic toy task's operands and its answer are one token a digit.
    assert [len(encode(d)) for d in EASTERN_DIGITS] == [1] * 10
    assert len(encode("١٢٣٤٥٦٧٨٩٠")) == 10 and len({encode(d)[0] for d in EASTERN_DIGITS}) == 10


def test_toy_prompts_keep_their_digits_and_symbols_apart() -> None:
    tok = tiny_tokenizer.load()
    for task in [t for t in TASKS if t not in CHAT_TASKS]:
        for ex in toy_examples(task, 50):
            ids = encode(ex["prompt"])
            assert tok.decode(ids) == ex["prompt"]
            assert sum(1 for t in ids if tok.id_to_token(t).isdigit()) == sum(c.isdigit() for c in ex["prompt"])


def test_the_shipped_file_is_what_the_script_writes(tmp_path: Path) -> None:
    a, b = tiny_tokenizer.write(tmp_path / "a.json"), tiny_tokenizer.write(tmp_path / "b.json")
    assert a.read_bytes() == b.read_bytes() == tiny_tokenizer.TOKENIZER_JSON.read_bytes()


def test_transformers_loads_the_built_in_model_with_chatml(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tok) == BPE_VOCAB_SIZE
    assert (tok.pad_token, tok.eos_token, tok.bos_token) == (PAD, EOS, IM_START)
    # The specials keep the character-level tokenizer's ids.
    assert [tok.convert_tokens_to_ids(t) for t in (PAD, EOS, IM_START)] == [vocab()[t] for t in (PAD, EOS, IM_START)]
    assert tok.decode(tok.encode(HELD_BACK, add_special_tokens=False)) == HELD_BACK
    messages = [{"role": "system", "content": "فكّر خطوة بخطوة"}, {"role": "user", "content": "ما ناتج ٢ + ١؟"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nفكّر خطوة بخطوة<|im_end|>\n<|im_start|>user\nما ناتج ٢ + ١؟<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert tok.decode(ids) == text
    for special in (PAD, EOS, IM_START, IM_END):
        assert len(tok.encode(special, add_special_tokens=False)) == 1

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.vocab_size == BPE_VOCAB_SIZE
    assert model.generation_config.eos_token_id == [tok.convert_tokens_to_ids(t) for t in (EOS, IM_END)]
    assert json.loads((tiny_model_dir / "bucketrl_tiny.json").read_text())["tokenizer"] == "bpe"


def test_the_character_vocabulary_is_still_built_on_request(tiny_model_dir: Path, chars_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    assert built_tokenizer(tiny_model_dir) == "bpe"
    assert json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"] == VOCAB_SIZE == BPE_VOCAB_SIZE
    tok = AutoTokenizer.from_pretrained(chars_model_dir)
    assert len(tok) == CHARS_VOCAB_SIZE == 64 and tok.get_vocab() == vocab()
    assert tok.chat_template is None
    assert tok.convert_ids_to_tokens(tok.encode("12+3=", add_special_tokens=False)) == list("12+3=")
    assert json.loads((chars_model_dir / "config.json").read_text())["vocab_size"] == CHARS_VOCAB_SIZE
    assert built_tokenizer(chars_model_dir) == "chars"


def test_a_directory_is_never_handed_back_for_the_other_tokenizer(
    tiny_model_dir: Path, chars_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match="tokenizer='chars', not 'bpe'"):
        build_tiny_model(chars_model_dir)
    with pytest.raises(ValueError, match="tokenizer='bpe', not 'chars'"):
        build_tiny_model(tiny_model_dir, tokenizer="chars")
    assert build_tiny_model(chars_model_dir, tokenizer="chars") == chars_model_dir
    tiny_model.main([str(chars_model_dir), "--tokenizer", "chars"])  # idempotent: no rebuild
    assert capsys.readouterr().out.strip() == str(chars_model_dir)
    # A directory built before the kind was recorded holds the character-level tokenizer.
    (tmp_path / "bucketrl_tiny.json").write_text(json.dumps({"seed": 0, "vocab_size": CHARS_VOCAB_SIZE}))
    assert built_tokenizer(tmp_path) == "chars"
