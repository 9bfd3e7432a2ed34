"""TrainerSettings: BUCKETRL_RUN_SPEC as a file or inline JSON, clear errors, the LR schedule."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from bucketrl.trainer.settings import TrainerSettings

SPEC = {
    "base_model": "/models/tiny",
    "reward": {"name": "toy"},
    "dataset": {"uri": "toy:digits"},  # no size: the trainer counts the dataset
    "vocab_size": 64,
}


def test_run_spec_inline_json_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUCKETRL_RUN_SPEC", json.dumps(SPEC))
    monkeypatch.setenv("BUCKETRL_MAX_STEPS", "7")
    s = TrainerSettings()
    assert s.run_spec_dict() == SPEC and s.max_steps == 7
    path = tmp_path / "run.json"
    path.write_text(json.dumps(SPEC))
    monkeypatch.setenv("BUCKETRL_RUN_SPEC", str(path))
    assert TrainerSettings().run_spec_dict() == SPEC
    monkeypatch.delenv("BUCKETRL_RUN_SPEC")
    assert TrainerSettings().run_spec_dict() is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("/no/such/file.json", "neither inline JSON nor an existing file"),
        ("{not json", "not valid JSON"),
        (json.dumps({**SPEC, "group_size": 1}), "not a valid run spec"),
        (json.dumps({**SPEC, "typo_field": 1}), "not a valid run spec"),
    ],
)
def test_bad_run_spec_is_refused_naming_the_setting(value: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message) as info:
        TrainerSettings(run_spec=value)
    assert "BUCKETRL_RUN_SPEC" in str(info.value)


def test_lr_schedule_warmup_then_decay() -> None:
    s = TrainerSettings(warmup_steps=4, max_steps=14, lr_schedule="linear", min_lr_ratio=0.0)
    assert [s.lr_factor(i) for i in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert s.lr_factor(4) == pytest.approx(1.0)
    assert s.lr_factor(9) == pytest.approx(0.5)
    assert s.lr_factor(14) == pytest.approx(0.0)
    c = TrainerSettings(warmup_steps=0, max_steps=10, lr_schedule="cosine", min_lr_ratio=0.1)
    assert c.lr_factor(0) == pytest.approx(1.0)
    assert c.lr_factor(5) == pytest.approx(0.1 + 0.9 * 0.5)
    assert c.lr_factor(10) == pytest.approx(0.1)
    assert TrainerSettings().lr_factor(123) == 1.0
    with pytest.raises(ValidationError, match="BUCKETRL_WARMUP_STEPS"):
        TrainerSettings(warmup_steps=10, max_steps=10, lr_schedule="cosine")


def test_trainer_settings_import_without_torch() -> None:
    code = "import sys, bucketrl.trainer.settings, bucketrl.trainer.cli\nassert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
