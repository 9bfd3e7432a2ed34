"""Adapters in the dtype they are served in (issue 32): a bfloat16 transformers engine holds the same LoRA tensors
whether it is given a version's bfloat16 file (what the trainer ships for a bfloat16 model) or its float32 file, so
its behaviour logprobs do not change; a float32 engine casts a bfloat16 file up on load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bucketrl.generator.engines.factory import make_engine
from bucketrl.generator.settings import GeneratorSettings
from bucketrl.trainer.model import AdapterSnapshot
from tests.generator.helpers import make_adapter, run_spec


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bucketrl.tasks.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-bf16"), dtype="bfloat16")


@pytest.fixture(scope="module")
def files(bf16_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One version's adapter as float32 (the trainer's master weights) and as the trainer ships it in bfloat16."""
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("adapters")
    fp32 = make_adapter(bf16_model, root / "fp32", seed=3)
    state = load_file(str(fp32 / "adapter_model.safetensors"))
    snap = AdapterSnapshot(state=state, config_json=(fp32 / "adapter_config.json").read_text())
    return {"float32": fp32, "bfloat16": snap.write(root / "bf16", "bfloat16")}


def _lora(engine: Any, name: str) -> dict[str, Any]:
    return {k.replace(f".{name}.", "."): p.detach() for k, p in engine._model.named_parameters() if f".{name}." in k}


def _logits(engine: Any, name: str) -> Any:
    import torch

    engine._model.set_adapter(name)
    with torch.inference_mode():
        return engine._model(input_ids=torch.tensor([[3, 4, 5, 6, 7, 8]])).logits


def test_a_bf16_engine_holds_the_same_lora_from_the_bf16_or_the_fp32_file(
    bf16_model: Path, files: dict[str, Path]
) -> None:
    import torch

    engine: Any = make_engine(GeneratorSettings(engine="transformers", seed=0, dtype="bfloat16"), run_spec(bf16_model))
    try:
        assert engine.adapter_dtype == "bfloat16"
        engine.load_adapter("t-v1", 1, files["float32"])
        engine.load_adapter("t-v2", 2, files["bfloat16"])
        a, b = _lora(engine, "t-v1"), _lora(engine, "t-v2")
        assert a.keys() == b.keys() and len(a) > 0
        for k in a:
            assert a[k].dtype == b[k].dtype == torch.bfloat16, k
            assert torch.equal(a[k], b[k]), k
        assert torch.equal(_logits(engine, "t-v1"), _logits(engine, "t-v2"))
    finally:
        engine.close()


def test_a_fp32_engine_casts_a_bf16_file_up_on_load(bf16_model: Path, files: dict[str, Path]) -> None:
    import torch
    from safetensors.torch import load_file

    engine: Any = make_engine(GeneratorSettings(engine="transformers", seed=0, dtype="float32"), run_spec(bf16_model))
    try:
        assert engine.adapter_dtype == "float32"
        engine.load_adapter("t-v2", 2, files["bfloat16"])
        held = _lora(engine, "t-v2")
        shipped = load_file(str(files["bfloat16"] / "adapter_model.safetensors"))
        assert len(held) == len(shipped) > 0
        for k, v in held.items():
            assert v.dtype == torch.float32
            key = next(s for s in shipped if s.removesuffix(".weight") in k)
            assert torch.equal(v, shipped[key].to(torch.float32)), k
    finally:
        engine.close()
