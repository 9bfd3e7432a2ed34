"""toy:arabic-math's learning without the pipeline: bucketrl's own Learner and transformers engine in one process,
synchronous (every group sampled by the current version), 0.2-0.6 s a step on 2 cores. For trying settings in a
minute or two before a `bucketrl up` run (bench/arabic_math.py) measures them; the figures are not the pipeline's
(no staleness, no second generator).

    PYTHONPATH=. .venv/bin/python bench/arabic_math_sync.py --steps 150 --temperature 0.3
    PYTHONPATH=. .venv/bin/python bench/arabic_math_sync.py --tokenizer old.json   # another tokenizer.json

Prints the mean reward every 10 steps, the greedy held-out answers (partial and strict `math` reward, the first
answers) every --eval-every steps, and a JSON line: the mean reward of the first and the last 20 steps.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", type=Path, help="a tokenizer.json to build the model with (default: the shipped)")
    p.add_argument("--model-dir", type=Path, help="a built model to start from (default: build the tiny one)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.2)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the task's")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--kl", type=float, default=0.0, help="loss.kl_coef")
    p.add_argument("--entropy-coef", type=float, default=None, help="loss.entropy_coef (default: the task's)")
    p.add_argument("--scale-rewards", choices=("group", "none"), default="group")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=50)
    a = p.parse_args()

    import torch
    from transformers import AutoTokenizer

    from bucketrl.datasets import load_examples, prompt_token_ids
    from bucketrl.generator.engines.factory import make_engine
    from bucketrl.generator.settings import GeneratorSettings
    from bucketrl.rewards import math_reward
    from bucketrl.tasks import tiny_tokenizer
    from bucketrl.tasks.tiny_model import build_tiny_model
    from bucketrl.tasks.toy import PREFILL, arabic_math_reward, default_run_spec
    from bucketrl.trainer.learner import Learner, StepGroup
    from bucketrl.trainer.settings import TrainerSettings
    from bucketrl.wire import Completion, DatasetSpec, RolloutGroup

    torch.set_num_threads(1)
    if a.tokenizer:
        tiny_tokenizer.TOKENIZER_JSON = a.tokenizer.resolve()
    work = Path(tempfile.mkdtemp(prefix="arabic-math-sync-"))
    model_dir = a.model_dir or build_tiny_model(work / "model")
    spec = default_run_spec(model_dir, task="arabic-math")
    spec = spec.model_copy(
        update={
            "group_size": a.group_size,
            "groups_per_step": a.groups_per_step,
            "sampling": spec.sampling.model_copy(
                update={
                    "temperature": a.temperature,
                    "top_k": a.top_k,
                    "max_new_tokens": a.max_new_tokens or spec.sampling.max_new_tokens,
                }
            ),
            "lora": spec.lora.model_copy(update={"r": a.lora_r, "alpha": 2.0 * a.lora_r}),
            "loss": spec.loss.model_validate(
                {
                    **spec.loss.model_dump(),
                    "scale_rewards": a.scale_rewards,
                    "kl_coef": a.kl,
                    **({} if a.entropy_coef is None else {"entropy_coef": a.entropy_coef}),
                }
            ),
        }
    )
    learner = Learner(spec, TrainerSettings(device="cpu", lr=a.lr, seed=a.seed, max_steps=a.steps))
    engine = make_engine(GeneratorSettings(engine="transformers", seed=a.seed), spec)
    tok = AutoTokenizer.from_pretrained(model_dir)
    train = load_examples(DatasetSpec(uri="toy:arabic-math", size=1024))
    test = load_examples(DatasetSpec(uri="toy:arabic-math", size=100, split="test"))

    def ids(ex: Any) -> list[int]:
        return prompt_token_ids(tok, ex.prompt, ex.chat(), raw=ex.raw, prefill=ex.prefill)

    def evaluate() -> tuple[float, float, list[str]]:
        model = learner.policy.model
        model.eval()
        partial, strict, texts = [], [], []
        for ex in test:
            x = ids(ex)
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([x]), do_sample=False, max_new_tokens=6, pad_token_id=tok.pad_token_id
                )
            text = tok.decode(out[0, len(x) :].tolist(), skip_special_tokens=False)
            partial.append(arabic_math_reward(text, ex.answer))
            strict.append(math_reward(PREFILL["arabic-math"] + text.split("<|im_end|>")[0], ex.answer) or 0.0)
            texts.append(text[:3])
        model.train()
        return statistics.fmean(partial), statistics.fmean(strict), texts[:8]

    rewards: list[float] = []
    t0 = time.monotonic()
    try:
        for step in range(a.steps):
            adapter = learner.policy.save_adapter(work / f"v{step}")
            engine.load_adapter(f"v{step}", step, adapter)
            if step:
                engine.unload_adapter(f"v{step - 1}")
            batch = [train[(step * a.groups_per_step + i) % len(train)] for i in range(a.groups_per_step)]
            prompts = [ids(ex) for ex in batch]
            out = engine.generate(prompts, adapter=f"v{step}", n=a.group_size, sampling=spec.sampling)
            groups, scores = [], []
            for i, (ex, prompt, samples) in enumerate(zip(batch, prompts, out, strict=True)):
                completions = []
                for s in samples:
                    r = arabic_math_reward(tok.decode(s.token_ids, skip_special_tokens=False), ex.answer)
                    scores.append(r)
                    completions.append(
                        Completion(token_ids=s.token_ids, logprobs=s.logprobs, reward=r, finish_reason=s.finish_reason)
                    )
                group = RolloutGroup(
                    prompt_id=f"{step}-{i}", prompt_index=i, prompt_token_ids=prompt, completions=completions
                )
                groups.append(StepGroup(group, step, "sync"))
            learner.train_step(groups, policy_version=step)
            rewards.append(statistics.fmean(scores))
            if (step + 1) % 10 == 0:
                print(f"step {step + 1}: reward {statistics.fmean(rewards[-10:]):.3f} ({time.monotonic() - t0:.0f} s)")
            if (step + 1) % a.eval_every == 0:
                partial, strict, texts = evaluate()
                print(f"  held-out greedy: partial {partial:.3f}, strict math {strict:.3f}, e.g. {texts}", flush=True)
    finally:
        engine.close()
        shutil.rmtree(work, ignore_errors=True)
    first, last = statistics.fmean(rewards[:20]), statistics.fmean(rewards[-20:])
    print(json.dumps({"first20": round(first, 3), "last20": round(last, 3), **vars(a)}, default=str))


if __name__ == "__main__":
    main()
