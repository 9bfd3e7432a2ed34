"""The behaviour every engine must show (used by test_engine_transformers.py and test_engine_vllm.py).

A test module subclasses :class:`EngineBehaviour` and provides module-scoped fixtures ``engine`` (with
adapters ``t-v1`` and ``t-v2`` loaded from ``adapters[1]`` / ``adapters[2]``), ``adapters`` and ``model_dir``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from bucketrl import errors
from bucketrl.rollout.engine import SampledCompletion
from bucketrl.tasks.tiny_model import EOS, VOCAB_SIZE, bpe_vocab
from bucketrl.tasks.tiny_tokenizer import IM_END, encode
from bucketrl.wire import SamplingSpec
from tests.generator.helpers import teacher_forced_logprobs

# The built-in model ends a completion at end-of-text or end-of-turn (as Qwen2.5 does).
EOS_IDS = {bpe_vocab()[EOS], bpe_vocab()[IM_END]}
PROMPTS = [encode(text) for text in ("1+2=", "a quick test: ", "99*9=")]
G = 4


def check_well_formed(groups: list[list[SampledCompletion]], n_prompts: int, n: int, max_new: int) -> None:
    assert len(groups) == n_prompts
    for group in groups:
        assert len(group) == n
        for s in group:
            assert 1 <= len(s.token_ids) <= max_new
            assert len(s.logprobs) == len(s.token_ids)
            assert all(0 <= t < VOCAB_SIZE for t in s.token_ids)
            assert all(math.isfinite(lp) and lp <= 0.0 for lp in s.logprobs)
            assert not EOS_IDS & set(s.token_ids[:-1]), "sampling must stop at the first EOS"
            if s.finish_reason == "stop":
                assert s.token_ids[-1] in EOS_IDS
            else:
                assert s.finish_reason == "length" and len(s.token_ids) == max_new


def max_logprob_gap(
    model_dir: Path, adapter_dir: Path, groups: list[list[SampledCompletion]], sampling: SamplingSpec
) -> float:
    gap = 0.0
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for s in group:
            ref = teacher_forced_logprobs(model_dir, adapter_dir, prompt, s.token_ids, sampling)
            gap = max(gap, max(abs(a - b) for a, b in zip(ref, s.logprobs, strict=True)))
    return gap


class EngineBehaviour:
    def test_groups_are_well_formed_and_stop_at_eos(self, engine: Any) -> None:
        # Hot sampling makes a stop likely (2 of 320 tokens end a completion): some completions stop, the rest hit
        # the length cap (each stops within 64 tokens with p ~ 1/3: P(none or all of 12 stop) < 1 %, seeded).
        sampling = SamplingSpec(temperature=2.0, max_new_tokens=64)
        groups = engine.generate(PROMPTS, adapter="t-v1", n=G, sampling=sampling)
        check_well_formed(groups, len(PROMPTS), G, 64)
        reasons = {s.finish_reason for g in groups for s in g}
        assert reasons == {"stop", "length"}
        # n=G samples of one prompt are independent draws, not copies.
        assert len({tuple(s.token_ids) for s in groups[0]}) > 1

    @pytest.mark.parametrize(
        "sampling",
        [
            SamplingSpec(temperature=1.0, max_new_tokens=12),
            SamplingSpec(temperature=0.7, max_new_tokens=12),
            SamplingSpec(temperature=0.8, top_k=8, top_p=0.9, max_new_tokens=12),
        ],
        ids=["t1", "t0.7", "t0.8-k8-p0.9"],
    )
    def test_logprobs_match_teacher_forcing(
        self, engine: Any, adapters: dict[int, Path], model_dir: Path, sampling: SamplingSpec
    ) -> None:
        """Invariant 6: the behaviour logprob is what the trainer recomputes (fp32: within 1e-3).

        With top-k/top-p, a token sampled outside the trainer's mask would recompute to -inf: a large gap.
        """
        groups = engine.generate(PROMPTS, adapter="t-v1", n=G, sampling=sampling)
        check_well_formed(groups, len(PROMPTS), G, sampling.max_new_tokens)
        assert max_logprob_gap(model_dir, adapters[1], groups, sampling) < 1e-3

    def test_each_adapter_name_serves_its_own_weights(
        self, engine: Any, adapters: dict[int, Path], model_dir: Path
    ) -> None:
        sampling = SamplingSpec(temperature=1.0, max_new_tokens=12)
        g1 = engine.generate(PROMPTS, adapter="t-v1", n=G, sampling=sampling)
        g2 = engine.generate(PROMPTS, adapter="t-v2", n=G, sampling=sampling)
        assert max_logprob_gap(model_dir, adapters[1], g1, sampling) < 1e-3
        assert max_logprob_gap(model_dir, adapters[2], g2, sampling) < 1e-3
        # The same tokens are far less (or more) likely under the other version's weights.
        assert max_logprob_gap(model_dir, adapters[2], g1, sampling) > 0.05

    def test_unknown_adapter_is_refused(self, engine: Any) -> None:
        with pytest.raises(errors.NotFound, match="t-v99"):
            engine.generate(PROMPTS, adapter="t-v99", n=2, sampling=SamplingSpec())
        assert sorted(engine.loaded_adapters())[:2] == ["t-v1", "t-v2"]

    def test_empty_prompt_list(self, engine: Any) -> None:
        assert engine.generate([], adapter="t-v1", n=2, sampling=SamplingSpec()) == []
