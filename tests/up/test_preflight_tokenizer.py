"""The preflight refuses a tokenizer that loses the dataset's text (issue 34): the character-level tokenizer (the
built-in model's before its byte-level BPE, still built with ``tokenizer="chars"``) read every Arabic letter as its
padding token, and a run on Arabic data trained on padding without a word. One line naming a row and the fix;
``--allow-lossy-tokenizer`` (run spec ``dataset.allow_lossy_tokenizer``) says the user knows. The built-in model's
BPE reads the same rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bucketrl import preflight
from bucketrl.preflight import ConfigError, check_tokenizer_coverage
from bucketrl.rollout.example import Example
from bucketrl.tasks.tiny_model import build_tiny_model
from bucketrl.up.config import UpConfig, build_run_spec
from bucketrl.wire import RunSpec

ARABIC = "ما ناتج 2 + 1؟ ضع الجواب داخل \\boxed{}"


def _rows(*prompts: str, answer: str | None = "3") -> list[Example]:
    return [Example(index=i, prompt=p, answer=answer) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def chars_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-chars"), tokenizer="chars")


@pytest.fixture(scope="module")
def chars_tokenizer(chars_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chars_model_dir)


def test_the_character_tokenizer_refuses_arabic_with_one_line(chars_tokenizer: Any, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    check_tokenizer_coverage(AutoTokenizer.from_pretrained(tiny_model_dir), _rows("2+1=", ARABIC))  # the BPE reads it
    with pytest.raises(ConfigError) as refused:
        check_tokenizer_coverage(chars_tokenizer, _rows("2+1=", ARABIC))
    message = str(refused.value)
    assert "\n" not in message
    assert "row 2" in message and "--dataset" in message and "--allow-lossy-tokenizer" in message
    assert "% of the dataset's characters" in message


def test_toy_and_ascii_rows_pass(chars_tokenizer: Any) -> None:
    check_tokenizer_coverage(chars_tokenizer, _rows("even:", "12+30=", "q?", "2*(3-1)=?", answer="42"))


def test_a_few_unknown_characters_are_under_the_share(chars_tokenizer: Any) -> None:
    """One lost character in 230 passes (a stray symbol is no reason to stop a run); two in 155 do not."""
    ascii_row = "what:1+1,2+2,3+3,4+4,5+5,6+6,7+7,8+8?"  # 37 characters, and each row's answer "3"
    check_tokenizer_coverage(chars_tokenizer, _rows(*([ascii_row] * 6), "م"))
    with pytest.raises(ConfigError, match=r"loses 1% of the dataset's characters.*\(row 5: 'ما' reads back as ''\)"):
        check_tokenizer_coverage(chars_tokenizer, _rows(*([ascii_row] * 4), "ما"))


class _DropsNonAscii:
    """A slow tokenizer with no unknown token that drops what it cannot encode."""

    unk_token_id = pad_token_id = None
    is_fast = False

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text if c.isascii()]

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(map(chr, ids))


def test_a_tokenizer_that_drops_characters_is_refused() -> None:
    check_tokenizer_coverage(_DropsNonAscii(), _rows("  1 +\n1 = ", "2+2"))  # whitespace runs compare as one space
    with pytest.raises(ConfigError) as refused:
        check_tokenizer_coverage(_DropsNonAscii(), _rows("2+2", "café"))
    message = str(refused.value)
    assert "row 2: 'café' reads back as 'caf'" in message
    assert "--allow-lossy-tokenizer" in message


def test_the_run_spec_option_turns_the_check_off(tmp_path: Path, chars_model_dir: Path) -> None:
    data = tmp_path / "ar.jsonl"
    data.write_text(json.dumps({"prompt": ARABIC, "answer": "3"}, ensure_ascii=False) + "\n")
    examples = _rows(ARABIC)
    for allow in (False, True):
        cfg = UpConfig(
            dir=tmp_path / "run",
            dataset=str(data),
            model=str(chars_model_dir),
            allow_lossy_tokenizer=allow,
            max_new_tokens=64,
        )
        spec = build_run_spec(cfg, None, vocab_size=64)
        assert spec["dataset"]["allow_lossy_tokenizer"] is allow
        probe = RunSpec.model_validate({**spec, "dataset": {**spec["dataset"], "uri": str(data), "size": 1}})
        if allow:
            preflight.check_run(probe, examples=examples, reward="skip", names=preflight.SPEC_NAMES)
        else:
            with pytest.raises(ConfigError, match=r"dataset\.allow_lossy_tokenizer: true"):
                preflight.check_run(probe, examples=examples, reward="skip", names=preflight.SPEC_NAMES)


def test_up_stops_on_arabic_data_with_a_character_tokenizer(tmp_path: Path, chars_model_dir: Path) -> None:
    """`bucketrl up` on an Arabic JSONL with a character-level model exits 2 in seconds with the one line."""
    (tmp_path / "ar.jsonl").write_text(
        "".join(
            json.dumps({"prompt": ARABIC.replace("2 + 1", f"{i} + 1"), "answer": str(i + 1)}) + "\n" for i in range(5)
        )
    )
    t0 = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bucketrl.cli",
            "up",
            "--dir",
            str(tmp_path / "run"),
            "--no-live",
            "--dataset",
            "ar.jsonl",
            "--model",
            str(chars_model_dir),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    seconds = time.monotonic() - t0
    stderr = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out.stdout + out.stderr
    assert len(stderr) == 1 and "Traceback" not in out.stdout + out.stderr, out.stderr
    line = stderr[0]
    assert "--dataset" in line and "row 1" in line and "--allow-lossy-tokenizer" in line, line
    assert "the tokenizer of --model" in line, line
    assert not (tmp_path / "run" / "services.json").exists()
    assert seconds < 60, seconds
