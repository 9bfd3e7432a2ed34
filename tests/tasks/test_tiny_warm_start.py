"""The built-in model's warm start (toy:arabic-math's): it learns the text, it is recorded, and a build cut short or
asked for another warm start is never taken for the one asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bucketrl.tasks.tiny_model import RECORD, build_tiny_model
from bucketrl.tasks.tiny_warm_start import sums_text, warm_start, warm_start_text

STEPS = 10


def text_loss(model_dir: Path, lines: list[str]) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    losses = []
    with torch.no_grad():
        for line in lines:
            ids = torch.tensor([tok(line)["input_ids"] + [tok.eos_token_id]])
            losses.append(model(input_ids=ids, labels=ids).loss.item())
    return sum(losses) / len(losses)


def test_the_text_holds_the_sums_in_both_digit_systems_and_the_corpus() -> None:
    text = warm_start_text()
    assert "3 + 4 = 7" in text and "٣ + ٤ = ٧" in text and "٩ + ٩ = ١٨" in text
    assert len(sums_text()) == 200 and len(sums_text(both_systems=False)) == 100
    # Never the task's own form: no chat template, no Arabic question with its answer in a box.
    assert not any("<|im_start|>" in line or ("ضع الجواب" in line and "\\boxed{" in line) for line in sums_text())


def test_a_warm_start_lowers_the_loss_on_its_text_and_is_recorded(tmp_path: Path) -> None:
    cold = build_tiny_model(tmp_path / "cold")
    warm = build_tiny_model(tmp_path / "warm", warm_start_steps=STEPS)
    sample = sums_text()[::17]
    assert text_loss(warm, sample) < 0.7 * text_loss(cold, sample)
    assert json.loads((warm / RECORD).read_text())["warm_start_steps"] == STEPS
    assert json.loads((cold / RECORD).read_text())["warm_start_steps"] == 0
    # The same directory asked for again is taken as it is; asked for another warm start it is refused.
    assert build_tiny_model(warm, warm_start_steps=STEPS) == warm
    with pytest.raises(ValueError, match=f"warm_start_steps={STEPS}, not 0"):
        build_tiny_model(warm)
    with pytest.raises(ValueError, match=f"warm_start_steps=0, not {STEPS}"):
        build_tiny_model(cold, warm_start_steps=STEPS)


def test_a_warm_start_cut_short_is_done_again(tmp_path: Path) -> None:
    out = build_tiny_model(tmp_path / "m", warm_start_steps=STEPS)
    weights = (out / "model.safetensors").read_bytes()
    (out / RECORD).unlink()  # what a build killed during its warm start leaves: the files, no record
    (out / "model.safetensors").write_bytes(b"")
    assert build_tiny_model(out, warm_start_steps=STEPS) == out
    assert (out / "model.safetensors").read_bytes() == weights  # the same seed, the same model again
    assert json.loads((out / RECORD).read_text())["warm_start_steps"] == STEPS


def test_a_warm_start_of_no_steps_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="warm start steps must be >= 1, got 0"):
        warm_start(tmp_path, 0)
