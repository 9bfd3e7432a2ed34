"""Build the inference engine a generator's settings name (``BUCKETRL_ENGINE``).

    engine = make_engine(settings, spec)          # vllm or transformers; sim once bucketrl.sim registered it

The production engines are known here by name. The SIMULATED engine lives in :mod:`bucketrl.sim.engine` and is
added by a direct call, :func:`register_engine` (the ``bucketrl`` command makes it, tests that want it too), so
no production module imports the simulation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from bucketrl import errors
from bucketrl.generator.engines.base import check_reproducible
from bucketrl.generator.engines.transformers_engine import TransformersEngine
from bucketrl.generator.engines.vllm_engine import VLLMEngine

if TYPE_CHECKING:
    from bucketrl.generator.settings import GeneratorSettings
    from bucketrl.rollout.engine import Engine
    from bucketrl.wire import RunSpec

# (settings, run spec, model path or name) -> a ready engine.
EngineBuilder = Callable[["GeneratorSettings", "RunSpec", str], "Engine"]


def _vllm(settings: GeneratorSettings, spec: RunSpec, model: str) -> Engine:

    return VLLMEngine(model, settings=settings, spec=spec)


def _transformers(settings: GeneratorSettings, spec: RunSpec, model: str) -> Engine:

    return TransformersEngine(model, settings=settings, spec=spec)


_BUILDERS: dict[str, EngineBuilder] = {"vllm": _vllm, "transformers": _transformers}


def register_engine(name: str, build: EngineBuilder) -> None:
    """Make ``BUCKETRL_ENGINE=name`` build its engine with ``build`` (the same name again replaces it)."""
    _BUILDERS[name] = build


def make_engine(settings: GeneratorSettings, spec: RunSpec) -> Engine:
    """Build the engine ``settings.engine`` names for the run's base model (``settings.model_path`` wins)."""
    check_reproducible(spec.sampling, spec.vocab_size, settings.engine)
    build = _BUILDERS.get(settings.engine)
    if build is None:
        raise errors.Invalid(
            f"BUCKETRL_ENGINE={settings.engine} is not registered in this process "
            f"(known: {', '.join(sorted(_BUILDERS))}); the simulated engine is registered by "
            "bucketrl.sim.engine.register(), which the bucketrl command calls"
        )
    return build(settings, spec, settings.model_path or spec.base_model)
