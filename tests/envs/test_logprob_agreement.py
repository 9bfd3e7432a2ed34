"""Invariant 6 on multi-turn trajectories: episodes sampled through the endpoint (chat template, tool calls, tool
results and user messages between turns) carry, on every model token, the behaviour logprob the trainer recomputes over
the whole sequence (bucketrl.trainer.recompute, the training step's own path) within 1e-3; env tokens are masked.

On the character-level model: there every sampled completion is the tokenisation of its own text, so each turn's
prompt extends the previous turn's tokens and the episodes are multi-turn samples, which is what is checked here.
With the byte-level BPE (the built-in default), a random policy's completions are seldom the canonical
tokenisation of their text, the re-rendered prompt then does not extend them, and such a turn starts a sample of
its own by design (bucketrl.rollout.trajectory); whether any episode stayed one sample depended on the sampled
tokens, so the test passed or failed by the order of the tests before it."""

from __future__ import annotations

from pathlib import Path

import pytest

from bucketrl.generator.episode_groups import episode_group
from bucketrl.generator.settings import GeneratorSettings
from bucketrl.rollout.example import Example
from bucketrl.tasks.tiny_model import CHARS_VOCAB_SIZE, build_tiny_model
from bucketrl.trainer.model import PolicyModel
from bucketrl.trainer.recompute import model_token_gaps
from bucketrl.wire import PromptLeaseItem, SamplingSpec
from tests.envs.env_fixtures import Chatty
from tests.envs.support import episode_spec, harness
from tests.generator.helpers import make_adapter

SAMPLINGS = [SamplingSpec(temperature=1.0, max_new_tokens=8), SamplingSpec(temperature=0.7, top_k=8, max_new_tokens=8)]


def check_agreement(model_dir: Path, adapter_dir: Path, engine: GeneratorSettings) -> None:
    spec = episode_spec(model_dir).model_copy(update={"group_size": 6, "vocab_size": CHARS_VOCAB_SIZE})
    policy = PolicyModel(spec)
    policy.load_adapter(adapter_dir)
    trained = context = 0
    with harness(model_dir, adapter_dir, spec, Chatty(), engine=engine) as h:
        for i, sampling in enumerate(SAMPLINGS):
            h.spec = spec.model_copy(update={"sampling": sampling})
            done = h.run_group(Example(index=i, prompt="q?", answer="odd"))
            prompt = PromptLeaseItem(prompt_id=f"0-{i}", index=i, **{"pass": 0})
            group = episode_group(prompt, [1], done.episodes, {}, placeholder_token=1)
            gaps = model_token_gaps(policy, group, sampling)
            assert max(gaps) < 1e-3, (sampling, gaps)
            for c in group.completions:
                mask = c.loss_mask()
                trained += sum(mask)
                context += len(mask) - sum(mask)
    assert trained > 0 and context > 0


@pytest.fixture(scope="module")
def chars_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The character-level tiny model and an adapter for it."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-chars"), tokenizer="chars")
    return model_dir, make_adapter(model_dir, tmp_path_factory.mktemp("chars-adapter") / "v1", seed=1)


def test_transformers_engine_agrees_on_multi_turn_episodes(chars_model: tuple[Path, Path]) -> None:
    check_agreement(*chars_model, GeneratorSettings(engine="transformers", seed=0))


@pytest.mark.vllm
def test_vllm_engine_agrees_on_multi_turn_episodes(chars_model: tuple[Path, Path]) -> None:
    settings = GeneratorSettings(engine="vllm", seed=0, max_model_len=256, gpu_memory_utilization=0.2)
    check_agreement(*chars_model, settings)
