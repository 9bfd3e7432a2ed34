"""Invariant 6 end to end: the generator engines, loaded with the adapter files the TRAINER writes, report
behaviour logprobs that the trainer's own code path (padded batch, ``logits_to_keep``, gather) recomputes
within 1e-3 in fp32, and the trainer's per-generator mismatch metric says so (``ratio`` stays at 1); on
single-turn completions and on multi-turn ones (prompt | model | env | model: every model token)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bucketrl.generator.engines.factory import make_engine
from bucketrl.generator.settings import GeneratorSettings
from bucketrl.trainer.batching import make_micro_batches
from bucketrl.trainer.learner import MISMATCH_PREFIX, Learner, StepGroup
from bucketrl.wire import Completion, LoraSpec, RolloutGroup, SamplingSpec
from tests.trainer.helpers import settings, tiny_spec
from tests.trainer.test_model import perturb_adapter
from tests.trainer.test_multiturn import check_multi_turn_agreement

PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16], [20]]
SAMPLINGS = [
    SamplingSpec(temperature=1.0, max_new_tokens=12),
    SamplingSpec(temperature=0.7, max_new_tokens=12),
    SamplingSpec(temperature=0.8, top_k=8, top_p=0.9, max_new_tokens=12),
]


def check_engine_agrees_with_trainer(engine_name: str, model_dir: Path, tmp: Path, **engine_kw: object) -> None:
    spec = tiny_spec(model_dir, lora=LoraSpec(r=8, alpha=16.0), sampling=SAMPLINGS[0])
    learner = Learner(spec, settings(micro_token_budget=64))
    perturb_adapter(learner.policy, seed=5, scale=0.3)
    adapter_dir = learner.policy.save_adapter(tmp / "v3")
    engine = make_engine(GeneratorSettings(engine=engine_name, seed=0, **engine_kw), spec)  # type: ignore[arg-type]
    try:
        engine.load_adapter("run-v3", 3, adapter_dir)
        for sampling in SAMPLINGS:
            learner.spec = learner.policy.spec = spec.model_copy(update={"sampling": sampling})
            out = engine.generate(PROMPTS, adapter="run-v3", n=4, sampling=sampling)
            groups = [
                RolloutGroup(
                    prompt_id=f"0-{i}",
                    prompt_index=i,
                    prompt_token_ids=prompt,
                    completions=[
                        Completion(token_ids=s.token_ids, logprobs=s.logprobs, reward=float(j % 2))
                        for j, s in enumerate(samples)
                    ],
                )
                for i, (prompt, samples) in enumerate(zip(PROMPTS, out, strict=True))
            ]
            # The trainer's path: advantages, samples, padded micro-batches, logprobs.
            samples, _ = learner.build_samples([StepGroup(g, 3, "gen-x") for g in groups])
            gap = 0.0
            for mb in make_micro_batches(samples, 64, learner.policy.pad_id):
                with torch.no_grad():
                    lp, _ = learner.policy.token_logprobs(mb)
                gap = max(gap, float(((lp - mb.behaviour).abs() * mb.mask).max()))
            assert gap < 1e-3, (sampling, gap)
            before = learner.policy.adapter_state()
            stats = learner.train_step([StepGroup(g, 3, "gen-x") for g in groups], policy_version=3)
            assert stats[MISMATCH_PREFIX + "gen-x"] < 1e-3
            assert stats["ratio"] == pytest.approx(1.0, abs=1e-3)
            learner.policy.load_adapter(adapter_dir)  # back to the weights the engine serves
            for k, v in learner.policy.adapter_state().items():
                assert torch.equal(v, before[k])
        # Multi-turn trajectories on the same engine (no second engine start): every model token agrees.
        check_multi_turn_agreement(engine, learner, "run-v3", adapter_dir)
    finally:
        engine.close()


def test_transformers_engine_agrees_with_the_trainer(tiny_model_dir: Path, tmp_path: Path) -> None:
    check_engine_agrees_with_trainer("transformers", tiny_model_dir, tmp_path)


@pytest.mark.vllm
def test_vllm_engine_agrees_with_the_trainer(tiny_model_dir: Path, tmp_path: Path) -> None:
    check_engine_agrees_with_trainer("vllm", tiny_model_dir, tmp_path, max_model_len=256, gpu_memory_utilization=0.2)
