"""What limits toy:arabic-math's learning (issue 34): the model's capacity, or the reward's signal?

Two probes beside ``bench/arabic_math_sync.py`` (the reinforcement loop):

    PYTHONPATH=. .venv/bin/python bench/arabic_math_probe.py sft --steps 300
    PYTHONPATH=. .venv/bin/python bench/arabic_math_probe.py build /tmp/warm --pretrain-steps 600 --text sums
    PYTHONPATH=. .venv/bin/python bench/arabic_math_sync.py --model-dir /tmp/warm --temperature 1.0

``sft``: the task's own LoRA (r 16, all linear layers) on the built-in model, trained with labels instead of a
reward: cross-entropy of the right Eastern digit after the task's prompt (chat template, ``\\boxed{``), 64 examples a
step, lr 1e-3. Prints the greedy accuracy on every sum the task asks (55: 0-9) every 50 steps. If it learns, the LoRA
can hold the table and what is missing is the reward's signal.

``build``: a model directory for ``arabic_math_sync.py --model-dir``: the built-in model (or another shape, with
``--layers`` / ``--hidden-size``), optionally warm-started (``bucketrl.tasks.tiny_warm_start``) on a text:
``task``, what toy:arabic-math's model gets (the tokenizer's shipped corpus and ``a + b = s`` for a, b in 0-9 in
both digit systems); ``sums``, the sums alone; ``west``, the corpus and the sums in Western digits only;
``questions``, the task's text and ``ما ناتج a + b؟ الناتج s.``. None of it is in the task's chat form.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

LR = 1e-3
BATCH = 64


def pretrain_lines(text: str) -> list[str]:
    """The warm start's text: ``task`` is what toy:arabic-math's model gets (the corpus and the sums in both digit
    systems); the others are variants measured beside it."""
    from bucketrl.numerals import eastern
    from bucketrl.tasks import tiny_tokenizer
    from bucketrl.tasks.tiny_warm_start import sums_text, warm_start_text

    if text == "task":
        return warm_start_text()
    if text == "sums":
        return sums_text()
    if text == "west":
        return tiny_tokenizer.corpus_lines() + sums_text(both_systems=False)
    questions = [f"ما ناتج {eastern(a)} + {eastern(b)}؟ الناتج {eastern(a + b)}." for a in range(10) for b in range(10)]
    return warm_start_text() + questions


def build(out: Path, *, pretrain_steps: int, text: str, layers: int, hidden_size: int, seed: int) -> None:
    from bucketrl.tasks.tiny_model import build_tiny_model
    from bucketrl.tasks.tiny_warm_start import warm_start

    model_dir = build_tiny_model(
        out, seed=seed, layers=layers, hidden_size=hidden_size, intermediate_size=2 * hidden_size
    )
    if pretrain_steps:
        warm_start(model_dir, pretrain_steps, seed=seed, lines=pretrain_lines(text), log=print)
    print(model_dir)


def sft(steps: int, seed: int) -> None:
    import tempfile

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bucketrl.datasets import prompt_token_ids
    from bucketrl.tasks.tiny_model import build_tiny_model
    from bucketrl.tasks.toy import PREFILL, eastern

    torch.manual_seed(seed)
    model_dir = build_tiny_model(Path(tempfile.mkdtemp(prefix="arabic-probe-")) / "model", seed=seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    rows = []
    for total in range(10):
        for a in range(total + 1):
            question = f"ما ناتج {eastern(a)} + {eastern(total - a)}؟ ضع الجواب داخل \\boxed{{}}"
            prompt = prompt_token_ids(
                tok, question, [{"role": "user", "content": question}], prefill=PREFILL["arabic-math"]
            )
            rows.append((prompt, tok(eastern(total))["input_ids"][0]))
    every = torch.tensor([r[0] for r in rows])
    answers = torch.tensor([r[1] for r in rows])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    rng = random.Random(seed)
    t0 = time.monotonic()
    for step in range(1, steps + 1):
        batch = [rows[rng.randrange(len(rows))] for _ in range(BATCH)]
        logits = model(input_ids=torch.tensor([b[0] for b in batch])).logits[:, -1]
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor([b[1] for b in batch]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 50 == 0:
            with torch.no_grad():
                accuracy = (model(input_ids=every).logits[:, -1].argmax(-1) == answers).float().mean().item()
            print(
                f"sft step {step}: loss {loss.item():.3f}, greedy accuracy on the {len(rows)} sums {accuracy:.3f} "
                f"({time.monotonic() - t0:.0f} s)",
                flush=True,
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="probe", required=True)
    s = sub.add_parser("sft", help="supervised LoRA on the task's prompts: can it hold the table?")
    s.add_argument("--steps", type=int, default=300)
    s.add_argument("--seed", type=int, default=0)
    b = sub.add_parser("build", help="a model directory for arabic_math_sync.py --model-dir")
    b.add_argument("out", type=Path)
    b.add_argument("--pretrain-steps", type=int, default=0)
    b.add_argument("--text", choices=("task", "sums", "west", "questions"), default="task")
    b.add_argument("--layers", type=int, default=2)
    b.add_argument("--hidden-size", type=int, default=128)
    b.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    import torch

    torch.set_num_threads(2)
    if a.probe == "sft":
        sft(a.steps, a.seed)
    else:
        build(
            a.out, pretrain_steps=a.pretrain_steps, text=a.text, layers=a.layers, hidden_size=a.hidden_size, seed=a.seed
        )


if __name__ == "__main__":
    main()
