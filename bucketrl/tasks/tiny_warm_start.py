"""A warm start for the built-in model: next-token training of all its weights on plain text, as a hub model has read
text before anyone fine-tunes it.

toy:arabic-math needs it. A randomly initialised model does not learn sums from a reward: its answer barely depends on
the question, the format credit concentrates every sample on one digit within ~20 steps, and a group whose samples
are all one digit has no signal left (docs/arabic.md measures it; with labels instead of a reward the same LoRA learns
the table in ~200 steps: ``bench/arabic_math_probe.py sft``). After this warm start the model has seen the sums, but
never a question in the task's form: not the chat template, not ``\\boxed{``, not an Arabic question with its answer.
What the run then learns is to answer the chat-form question in the box, in Eastern Arabic digits.

The text: the tokenizer's shipped corpus (:func:`bucketrl.tasks.tiny_tokenizer.corpus_lines`) and ``a + b = s`` for
a, b in 0-9, in Western and in Eastern Arabic digits. The same model for a seed.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bucketrl.numerals import eastern
from bucketrl.tasks import tiny_tokenizer

LR = 3e-3
BATCH = 32


def sums_text(both_systems: bool = True) -> list[str]:
    """``a + b = s`` for a, b in 0-9 in Western digits, and (``both_systems``) in Eastern Arabic digits too."""
    lines = []
    for a in range(10):
        for b in range(10):
            lines.append(f"{a} + {b} = {a + b}")
            if both_systems:
                lines.append(f"{eastern(a)} + {eastern(b)} = {eastern(a + b)}")
    return lines


def warm_start_text() -> list[str]:
    return tiny_tokenizer.corpus_lines() + sums_text()


def warm_start(
    model_dir: Path,
    steps: int,
    *,
    seed: int = 0,
    lines: list[str] | None = None,
    log: Callable[[str], None] | None = None,
) -> float:
    """Train every weight of the model in ``model_dir`` for ``steps`` steps of :data:`BATCH` lines of ``lines``
    (default :func:`warm_start_text`), AdamW at :data:`LR` decaying linearly to 0, and save it in place. Returns the
    last step's loss."""
    import torch

    if steps < 1:
        raise ValueError(f"warm start steps must be >= 1, got {steps}")
    threads = torch.get_num_threads()
    # One thread: as fast for a model this small, never spinning against the other processes of a loaded machine,
    # and the same sums on any machine (the model is the same for a seed).
    torch.set_num_threads(1)
    try:
        return _train(model_dir, steps, seed, lines or warm_start_text(), log)
    finally:
        torch.set_num_threads(threads)


def _train(model_dir: Path, steps: int, seed: int, lines: list[str], log: Callable[[str], None] | None) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    with quiet_progress():
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    encoded = [tok(line)["input_ids"] + [tok.eos_token_id] for line in lines]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    rng = random.Random(seed)
    t0 = time.monotonic()
    loss = torch.tensor(float("nan"))
    model.train()
    for step in range(steps):
        ids, labels = _batch([encoded[rng.randrange(len(encoded))] for _ in range(BATCH)], tok.pad_token_id)
        loss = model(input_ids=ids, attention_mask=(labels != -100).long(), labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        for group in opt.param_groups:  # linear decay: the last steps settle instead of jumping
            group["lr"] = LR * (1 - step / steps)
        if log and (step % 100 == 0 or step == steps - 1):
            log(f"warm start step {step + 1}/{steps}: loss {loss.item():.3f} ({time.monotonic() - t0:.0f} s)")
    with quiet_progress():
        model.save_pretrained(model_dir, safe_serialization=True)
    return float(loss.item())


def _batch(rows: list[list[int]], pad: int) -> tuple[Any, Any]:
    import torch

    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad)
    labels = torch.full((len(rows), width), -100)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = labels[i, : len(row)] = torch.tensor(row)
    return ids, labels


@contextmanager
def quiet_progress() -> Iterator[None]:
    """No progress bars: one small shard's are noise in `bucketrl up`'s start-up lines."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
