"""``toy:arabic-math`` (issue 34): Arabic questions through the built-in model's chat template, the policy's turn
begun with ``\\boxed{``, answers in Eastern Arabic digits, partial credit beside the strict ``math`` reward. The
wiring and the rewards, not the learning (``bench/arabic_math.py`` measures that)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bucketrl.datasets import load_examples, prompt_token_ids
from bucketrl.numerals import normalise_numerals
from bucketrl.rewards import math_reward, validate_reward
from bucketrl.tasks.toy import (
    ARABIC_DEMO_LR,
    ARABIC_DEMO_MAX_STEPS,
    ARABIC_MAX_NEW_TOKENS,
    ARABIC_TEMPERATURE,
    ARABIC_WARM_START_STEPS,
    EASTERN_DIGITS,
    arabic_math_reward,
    default_run_spec,
    toy_examples,
    toy_reward,
)
from bucketrl.up.config import UpConfig, build_run_spec
from bucketrl.wire import DatasetSpec, RewardSpec

# (text the policy wrote after "\boxed{", answer, partial credit, strict math reward)
CASES = [
    ("٧}", "٧", 1.0, 1.0),
    ("٧}<|im_end|>", "٧", 1.0, 1.0),
    ("٧", "٧", 0.8, 1.0),  # the box never closed (math reads the last number)
    ("7}", "٧", 0.7, 1.0),  # the right number in the wrong digit system
    ("۷}", "٧", 0.7, 1.0),  # Persian seven
    ("٣}", "٧", 0.5, 0.0),  # the right format, the wrong number
    ("٣", "٧", 0.3, 0.0),  # an Eastern digit, the box left open
    ("٣٧}", "٧", 0.4, 0.0),  # a number longer than the answer: half the closing credit
    ("}٧", "٧", 0.1, 1.0),  # an empty box: math reads the last number, the partial credit wants it boxed
    ("", "٧", 0.0, 0.0),
    ("abc", "٧", 0.0, 0.0),
    ("3}", "٧", 0.2, 0.0),
    ("\ufffd", "٧", 0.0, 0.0),  # half a two-byte digit, decoded
    ("٠}", "٠", 1.0, 1.0),
]


@pytest.mark.parametrize(("text", "answer", "partial", "strict"), CASES)
def test_partial_credit_and_the_strict_reward(text: str, answer: str, partial: float, strict: float) -> None:
    assert arabic_math_reward(text, answer) == pytest.approx(partial)
    assert toy_reward(text, answer) == pytest.approx(partial)  # the answer says which task
    assert toy_reward(text, answer, task="arabic-math") == pytest.approx(partial)
    assert (math_reward("\\boxed{" + text.split("<|im_end|>")[0], answer) or 0.0) == strict


def test_questions_are_arabic_sums_with_eastern_answers() -> None:
    rows = toy_examples("arabic-math", 200)
    assert rows == toy_examples("arabic-math", 200)  # deterministic
    for row in rows:
        (message,) = row["prompt"]
        question = message["content"]
        assert message["role"] == "user" and question.startswith("ما ناتج ") and question.endswith("\\boxed{}")
        a, b = (int(normalise_numerals(x)) for x in question.removeprefix("ما ناتج ").split("؟")[0].split(" + "))
        assert row["answer"] == "".join(EASTERN_DIGITS[int(d)] for d in str(a + b))
    assert {r["answer"] for r in rows} == set(EASTERN_DIGITS)
    with pytest.raises(ValueError, match="Eastern Arabic digits"):
        toy_reward("٧}", "7", task="arabic-math")


def test_the_policy_sees_the_template_then_boxed(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    (ex,) = load_examples(DatasetSpec(uri="toy:arabic-math", size=1))
    assert ex.messages is not None and not ex.raw and ex.prefill == "\\boxed{"
    assert ex.answer is not None and ex.prompt == ex.messages[0][1]
    ids = prompt_token_ids(tok, ex.prompt, ex.chat(), raw=ex.raw, prefill=ex.prefill)
    text = tok.decode(ids)
    assert text == f"<|im_start|>user\n{ex.prompt}<|im_end|>\n<|im_start|>assistant\n\\boxed{{"
    assert "\ufffd" not in text and len(ids) < 64


def test_up_and_the_run_spec_wire_the_task(tmp_path: Path) -> None:
    spec = default_run_spec("model", task="arabic-math")
    assert spec.reward == RewardSpec(name="toy", kwargs={"task": "arabic-math"})
    assert spec.sampling.max_new_tokens == ARABIC_MAX_NEW_TOKENS and spec.dataset.uri == "toy:arabic-math"
    fn = validate_reward(spec.reward)
    assert fn("٥}", "٥", **spec.reward.kwargs) == 1.0
    cfg = UpConfig(dir=tmp_path / "run", dataset="toy:arabic-math")
    up_spec = build_run_spec(cfg, tmp_path / "model")
    assert up_spec["dataset"]["uri"] == "toy:arabic-math" and up_spec["reward"]["kwargs"] == {"task": "arabic-math"}
    assert cfg.effective_max_steps() == ARABIC_DEMO_MAX_STEPS and cfg.effective_lr() == ARABIC_DEMO_LR
    # The task starts from the warm-started built-in model and samples at its own temperature; nothing else does.
    assert up_spec["sampling"]["temperature"] == ARABIC_TEMPERATURE != default_run_spec("m").sampling.temperature
    assert cfg.warm_start_steps() == ARABIC_WARM_START_STEPS > 0
    assert (
        cfg.demo_lr_schedule() == "linear" and UpConfig(dir=tmp_path, dataset="toy:digits").demo_lr_schedule() is None
    )
    assert UpConfig(dir=tmp_path / "run", dataset="toy:digits").warm_start_steps() == 0
    assert UpConfig(dir=tmp_path / "run", dataset="toy:arabic-math", model="/some/model").warm_start_steps() == 0
