"""Run the Arabic toy task (`bucketrl up --dataset toy:arabic-math`) and print its reward at the start vs the end,
and the strict `math` reward beside the task's partial credit: greedy answers of the untrained and the trained
policy to held-out questions, scored both ways.

    .venv/bin/python bench/arabic_math.py                     # a fresh run directory under /tmp
    .venv/bin/python bench/arabic_math.py --keep              # keep it (plots: <dir>/reward.png, pipeline.png)
    .venv/bin/python bench/arabic_math.py --json out.json     # the figures as JSON too
    .venv/bin/python bench/arabic_math.py -- --max-steps 200  # extra `bucketrl up` options after --

Target (issue 34): the run, model build included, within 10 minutes on a 2-core machine; the mean reward of its
last 20 steps >= 0.6 and >= 2x that of its first 20 steps. Exit code 0 when met, 1 otherwise.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

from up_run import timed_up  # bench/up_run.py: run as `python bench/...`, its folder is on sys.path

from bucketrl.datasets import load_examples, prompt_token_ids
from bucketrl.rewards import math_reward
from bucketrl.tasks.toy import PREFILL, arabic_math_reward
from bucketrl.wire import DatasetSpec

TARGET_WALL_S = 600.0
TARGET_LAST20 = 0.6
TARGET_RATIO = 2.0
HELD_OUT = 100  # questions of the task's "test" split (a draw of its own)


def strict_math_reward(completion: str, answer: str) -> float:
    """The built-in ``math`` reward of the whole answer the policy wrote (its turn began with ``\\boxed{``)."""
    return math_reward(PREFILL["arabic-math"] + completion.split("<|im_end|>", 1)[0], answer) or 0.0


def greedy_scores(model_dir: Path, adapter: Path | None) -> dict[str, Any]:
    """Partial and strict rewards of the greedy answers to :data:`HELD_OUT` held-out questions."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    partial, strict, answers = [], [], []
    for ex in load_examples(DatasetSpec(uri="toy:arabic-math", size=HELD_OUT, split="test")):
        ids = prompt_token_ids(tok, ex.prompt, ex.chat(), raw=ex.raw, prefill=ex.prefill)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=6, pad_token_id=tok.pad_token_id)
        text = tok.decode(out[0, len(ids) :].tolist(), skip_special_tokens=False)
        assert ex.answer is not None
        partial.append(arabic_math_reward(text, ex.answer))
        strict.append(strict_math_reward(text, ex.answer))
        answers.append(text)
    return {"partial": statistics.fmean(partial), "strict": statistics.fmean(strict), "examples": answers[:5]}


def main() -> int:
    args, run_dir, wall, s = timed_up(__doc__, "arabic-math", ["--dataset", "toy:arabic-math"])
    if s is None:
        return 1
    first, last = s["reward_first20"], s["reward_last20"]
    ok = wall <= TARGET_WALL_S and last >= TARGET_LAST20 and last >= TARGET_RATIO * first
    adapter = run_dir / "bucket" / "runs" / "demo" / "adapters" / f"v{s['latest_version']}" / "files"
    before = greedy_scores(run_dir / "model", None)
    after = greedy_scores(run_dir / "model", adapter)
    figures = {
        "steps": s["steps"],
        "wall_s": wall,
        "reward_first20": first,
        "reward_last20": last,
        "held_out_partial_before": before["partial"],
        "held_out_strict_before": before["strict"],
        "held_out_partial_after": after["partial"],
        "held_out_strict_after": after["strict"],
        "target_met": ok,
    }
    print()
    print(f"steps                          {s['steps']}  (policy versions {s['latest_version']})")
    print(f"wall time, model build to end  {wall:.1f} s   (target <= {TARGET_WALL_S:.0f} s)")
    print(f"reward, first 20 steps         {first:.3f}")
    print(f"reward, last 20 steps          {last:.3f}   (target >= {TARGET_LAST20} and >= {TARGET_RATIO}x first)")
    print(f"held-out, greedy, untrained    partial {before['partial']:.3f}, strict math {before['strict']:.3f}")
    print(f"held-out, greedy, trained      partial {after['partial']:.3f}, strict math {after['strict']:.3f}")
    print(f"  e.g. after \\boxed{{:         {after['examples']}")
    print(f"target {'MET' if ok else 'MISSED'}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    if args.keep or args.dir:
        print(f"run directory: {run_dir} (reward.png, pipeline.png, summary.json, logs/)")
    else:
        shutil.rmtree(run_dir.parent, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
