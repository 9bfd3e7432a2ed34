"""The built-in toy tasks: deterministic examples, a graded reward in [0, 1], a demo spec that validates."""

from __future__ import annotations

import random
import string

import pytest

from bucketrl.tasks.tiny_model import CHARS
from bucketrl.tasks.toy import CHAT_TASKS, DEFAULT_TASK, RULES, TASKS, default_run_spec, toy_examples, toy_reward


def test_examples_are_deterministic_and_well_formed() -> None:
    for task in [t for t in TASKS if t not in CHAT_TASKS]:  # arabic-math: tests/tasks/test_arabic_math.py
        a = toy_examples(task, 50, seed=3)
        assert a == toy_examples(task, 50, seed=3)
        assert a != toy_examples(task, 50, seed=4)
        assert len(a) == 50
        for ex in a:
            assert set(ex) == {"prompt", "answer"}
            # Every prompt character is one token of the tiny model's tokenizer.
            assert set(ex["prompt"]) <= set(CHARS)
            assert 0.0 <= toy_reward(ex["prompt"], ex["answer"], task=task) <= 1.0
    # The digits task uses every rule.
    assert {ex["answer"] for ex in toy_examples("digits", 200)} == set(RULES)


def test_reward_is_graded_per_character() -> None:
    assert toy_reward("02468024", "even") == 1.0
    assert toy_reward("13579135", "even") == pytest.approx(0.1)  # digits, wrong kind: near credit
    assert toy_reward("0246xxxx", "even") == pytest.approx(0.5)
    assert toy_reward("56789", "high") == pytest.approx(5 / 8)  # stopping early earns nothing for the rest
    assert toy_reward("5678999999999", "high") == 1.0  # only the first `length` characters count
    assert toy_reward("5<|endoftext|>5555555", "high") == pytest.approx(1 / 8)
    assert toy_reward("", "low") == 0.0
    assert toy_reward("kkkkkkkk", "k") == 1.0
    assert toy_reward("kkkkaaaa", "k", task="copy") == pytest.approx((4 + 0.4) / 8)
    assert toy_reward("1357", "odd", task="parity", length=4) == 1.0
    assert toy_reward("1357", "odd", near=0.0, length=4, prompt="odd:") == 1.0


def test_uniform_random_output_starts_low() -> None:
    rng = random.Random(0)
    alphabet = [*CHARS, "<pad>", "<|im_start|>"]
    examples = toy_examples(DEFAULT_TASK, 2000)
    mean = sum(toy_reward("".join(rng.choice(alphabet) for _ in range(8)), **ex) for ex in examples) / len(examples)
    assert 0.04 < mean < 0.15
    # Ignoring the prompt (any digit) cannot reach the demo's 0.6 target.
    digits_only = sum(toy_reward("".join(rng.choice(string.digits) for _ in range(8)), **ex) for ex in examples)
    assert digits_only / len(examples) < 0.6


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: toy_examples("nope", 3), "unknown toy task"),
        (lambda: toy_examples("digits", 0), "n must be"),
        (lambda: toy_reward("1", None), "needs the example's answer"),
        (lambda: toy_reward("1", "maybe"), "cannot tell the toy task"),
        (lambda: toy_reward("1", "k", task="digits"), "digits answers"),
        (lambda: toy_reward("1", "low", task="parity"), "parity answers"),
        (lambda: toy_reward("1", "even", task="copy"), "copy answers"),
        (lambda: toy_reward("1", "even", length=0), "length must be"),
        (lambda: default_run_spec("/m", task="nope"), "unknown toy task"),
    ],
)
def test_bad_input_is_a_clear_error(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_default_run_spec_matches_the_tiny_model_and_task() -> None:
    from bucketrl.tasks.tiny_model import VOCAB_SIZE

    spec = default_run_spec("/models/tiny")
    assert spec.base_model == "/models/tiny"
    assert spec.vocab_size == VOCAB_SIZE
    assert spec.dataset.uri == f"toy:{DEFAULT_TASK}"
    assert spec.reward.name == "toy"
    assert spec.reward.kwargs["length"] == spec.sampling.max_new_tokens
    assert spec.queue_capacity_groups >= spec.groups_per_step


def test_a_toy_split_other_than_train_is_a_held_out_draw() -> None:
    from bucketrl.datasets import load_examples
    from bucketrl.wire import DatasetSpec

    train = load_examples(DatasetSpec(uri="toy:parity", size=64))
    test = load_examples(DatasetSpec(uri="toy:parity", size=64, split="test"))
    assert train == load_examples(DatasetSpec(uri="toy:parity", size=64, split="train"))  # unchanged for training
    assert len(test) == 64 and {e.prompt for e in test} != {e.prompt for e in train}
