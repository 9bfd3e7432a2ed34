"""The transformers engine passes the shared engine behaviour suite, plus adapter bookkeeping."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bucketrl import errors
from bucketrl.generator.engines.base import check_reproducible, vllm_lora_rank
from bucketrl.generator.engines.factory import make_engine
from bucketrl.generator.settings import GeneratorSettings
from bucketrl.wire import SamplingSpec
from tests.generator.engine_suite import PROMPTS, EngineBehaviour, max_logprob_gap
from tests.generator.helpers import make_adapter, run_spec


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {v: make_adapter(model_dir, root / f"v{v}", seed=v) for v in (1, 2, 3)}


@pytest.fixture(scope="module")
def engine(model_dir: Path, adapters: dict[int, Path]) -> Iterator[Any]:
    eng = make_engine(GeneratorSettings(engine="transformers", seed=0), run_spec(model_dir))
    eng.load_adapter("t-v1", 1, adapters[1])
    eng.load_adapter("t-v2", 2, adapters[2])
    yield eng
    eng.close()


class TestTransformersEngine(EngineBehaviour):
    def test_load_unload_keeps_others_serving(self, engine: Any, adapters: dict[int, Path], model_dir: Path) -> None:
        sampling = SamplingSpec(temperature=1.0, max_new_tokens=8)
        engine.load_adapter("t-v3", 3, adapters[3])
        engine.load_adapter("t-v3", 3, adapters[3])  # same name again: a no-op, never a reload
        assert sorted(engine.loaded_adapters()) == ["t-v1", "t-v2", "t-v3"]
        engine.unload_adapter("t-v3")
        engine.unload_adapter("t-v3")
        assert sorted(engine.loaded_adapters()) == ["t-v1", "t-v2"]
        groups = engine.generate(PROMPTS, adapter="t-v2", n=2, sampling=sampling)
        assert max_logprob_gap(model_dir, adapters[2], groups, sampling) < 1e-3

    def test_a_version_loads_between_decode_steps_without_touching_the_running_call(
        self, engine: Any, adapters: dict[int, Path], model_dir: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from bucketrl.generator.engines import transformers_engine

        monkeypatch.setattr(transformers_engine, "POLL_S", 0.0)  # hand over between every pair of steps
        sampling = SamplingSpec(temperature=1.0, max_new_tokens=12)
        calls: list[list[str]] = []

        def hook() -> None:
            calls.append(sorted(engine.loaded_adapters()))
            if len(calls) == 2:  # the first call is before sampling; this one is between decode steps
                engine.load_adapter("t-v3", 3, adapters[3])
                engine._model.set_adapter("t-v3")  # even a hook that switches adapters cannot leak into the call

        try:
            groups = engine.generate(PROMPTS, adapter="t-v1", n=2, sampling=sampling, while_running=hook)
            assert len(calls) > 2 and calls[1] == ["t-v1", "t-v2"] and "t-v3" in calls[-1]
            assert max_logprob_gap(model_dir, adapters[1], groups, sampling) < 1e-3  # v1's weights throughout
            newer = engine.generate(PROMPTS, adapter="t-v3", n=2, sampling=sampling)
            assert max_logprob_gap(model_dir, adapters[3], newer, sampling) < 1e-3
        finally:
            engine.unload_adapter("t-v3")


def test_unloading_every_adapter_then_loading_again(model_dir: Path, adapters: dict[int, Path]) -> None:
    eng = make_engine(GeneratorSettings(engine="transformers", seed=1), run_spec(model_dir))
    eng.load_adapter("u-v1", 1, adapters[1])
    eng.unload_adapter("u-v1")
    assert eng.loaded_adapters() == []
    eng.load_adapter("u-v2", 2, adapters[2])
    sampling = SamplingSpec(max_new_tokens=6)
    groups = eng.generate(PROMPTS, adapter="u-v2", n=2, sampling=sampling)
    assert max_logprob_gap(model_dir, adapters[2], groups, sampling) < 1e-3


def test_sampling_the_trainer_cannot_reproduce_is_refused(model_dir: Path) -> None:
    with pytest.raises(errors.Invalid, match="temperature"):
        check_reproducible(SamplingSpec(temperature=0.01), 64)
    with pytest.raises(errors.Invalid, match="top_k"):
        check_reproducible(SamplingSpec(top_k=65), 64)
    check_reproducible(SamplingSpec(temperature=3.0), 64, "transformers")
    with pytest.raises(errors.Invalid, match="BUCKETRL_ENGINE=transformers"):
        check_reproducible(SamplingSpec(temperature=3.0), 64, "vllm")
    with pytest.raises(errors.Invalid, match="temperature"):
        make_engine(GeneratorSettings(), run_spec(model_dir, sampling=SamplingSpec(temperature=0.001)))


def test_missing_base_model_is_a_clear_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(errors.Invalid, match="BUCKETRL_MODEL_PATH"):
        make_engine(GeneratorSettings(), run_spec(tiny_model_dir, base_model=str(tmp_path / "nope")))


def test_vllm_lora_rank_rounds_up() -> None:
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 33, 300, 512)] == [1, 8, 8, 16, 64, 320, 512]
    with pytest.raises(errors.Invalid):
        vllm_lora_rank(513)
