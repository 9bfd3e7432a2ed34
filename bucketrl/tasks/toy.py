"""Built-in toy tasks that a randomly initialised tiny model learns on CPU in minutes.

The demo (``bucketrl up``) trains the tiny Qwen2 of :mod:`bucketrl.tasks.tiny_model` from random
weights, so the task must be learnable by a LoRA on a model that knows nothing. Each task asks for a
short string of characters that satisfy a rule stated in the prompt, and the reward is *graded*: the
fraction of the first ``length`` characters that satisfy it (a completion that stops early is not
rewarded for the characters it did not write). Uniformly random digits and letters score ~0.08-0.1 (the
untrained model, which samples all 320 tokens of its vocabulary, ~0.02); a model that has learnt the rule
scores ~1.0.

Tasks (``toy:<task>`` dataset URIs, ``toy`` reward with ``{"task": <task>}``):

- ``digits``  (default) prompt ``"even:"``, ``"odd:"``, ``"low:"`` or ``"high:"``; answer with digits
              of that kind (even 02468, odd 13579, low 01234, high 56789). Credit 1 per digit of the
              right kind, ``near`` (0.1) per other digit. Ignoring the prompt caps the reward at 0.55.
- ``parity``  prompt ``"347:"``; digits of the same parity as the number's last digit (answer
              ``"odd"``). Same credit; reading the parity off a number is much slower to learn.
- ``copy``    prompt ``"k:"``; repeat the letter (answer ``"k"``). Credit 1 per copy, ``near`` per
              other lowercase letter. Far harder from random weights; not used by the demo.
- ``arabic-math`` a chat-format question in Arabic (``"ما ناتج ٣ + ٤؟ ضع الجواب داخل \\boxed{}"``) through
              the model's chat template, the policy's turn begun with ``\\boxed{`` (:data:`PREFILL`); the answer
              is the sum in Eastern Arabic digits (``"٧"``, sums 0-9). Partial credit (:func:`arabic_math_reward`):
              0.3 for an Eastern Arabic digit first, 0.2 for closing the box right after one number, 0.5 for
              the right number; ``bench/arabic_math.py`` reports the strict ``math`` reward beside it.
- ``tools``   multi-turn (run spec ``env`` ``toy:tools``, :mod:`bucketrl.envs.toy_tools`): prompt ``"q?"``, answer
              a digits rule drawn at random per row, which only the ``lookup`` tool tells; the model must call
              it, then answer with digits of that kind in a later turn.

Why the demo samples at temperature 0.2: with tied embeddings (init std 0.02) and the final RMSNorm
outside LoRA's reach, the tiny model's logit vector has norm <= ~4 at temperature 1, too flat to put
most of the mass on 5 of its 320 tokens (the byte-level BPE's; 10 are digits); dividing by 0.2 lifts that
ceiling while the untrained policy still samples broadly (random-policy reward ~0.02 at step 0). 0.3 was
enough for the 64-token character vocabulary; with 320 tokens it learnt about 5x slower (an e2e run of 30
steps: 0.012 -> 0.083, against 0.024 -> 0.660 at 0.2).

    python -m bucketrl.tasks.toy parity 5     # print five examples with their rewards for random text
"""

from __future__ import annotations

import random
import string
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bucketrl.wire import RunSpec

from bucketrl.numerals import EASTERN_DIGITS, eastern, normalise_numerals
from bucketrl.tasks.tiny_model import VOCAB_SIZE
from bucketrl.wire import DatasetSpec, EnvSpec, EpisodeSpec, LoraSpec, RewardSpec, RunSpec, SamplingSpec

DEFAULT_TASK = "digits"
DEFAULT_SIZE = 1024  # prompts in one pass of a toy dataset
DEFAULT_LENGTH = 8  # characters the reward looks at (= the demo's max_new_tokens)
NEAR_CREDIT = 0.1  # credit for a character of the right kind but the wrong value
# Trainer settings of the demo (``bucketrl up``): measured with a standalone GRPO loop on the tiny model,
# lr 3e-4 moves the digits task from ~0.1 (steps 1-20) to ~0.97 (steps 60-90); lr 1e-3 learns it within
# ~15 steps, too fast to see a curve.
DEMO_LR = 3e-4
DEMO_MAX_STEPS = 100
# toy:tools learns two things (call, then use the result): more steps (bench/toy_tools.py measures it).
TOOLS_DEMO_MAX_STEPS = 100

TASKS = ("digits", "parity", "copy", "tools", "arabic-math")
# The start of the policy's turn, written for it after the chat template's generation prompt.
PREFILL: dict[str, str] = {"arabic-math": "\\boxed{"}
# Chat-format toy tasks (through the chat template): the rest are plain prompts the model continues as written.
CHAT_TASKS = frozenset(PREFILL)
# Tokens a max_new_tokens budget of the Arabic task must hold: a digit (one token for an Eastern digit, two bytes for a
# Persian one), "}" and an end, with room for a second digit.
ARABIC_MAX_NEW_TOKENS = 6
ARABIC_DEMO_MAX_STEPS = 800
# The format (an Eastern digit, then "}") is learnt at the demo's lr; the sums need a faster one to show in minutes.
ARABIC_DEMO_LR = 1e-3
# Steps of the built-in model's warm start for this task (bucketrl.tasks.tiny_warm_start: a random model does not
# learn sums from a reward); ~45-75 s on 2 cores, the loss ~0.3 by then (the corpus and the table learnt).
ARABIC_WARM_START_STEPS = 600
# The warm-started model is sure of itself: at 0.2 every sample of a group is the same answer and a group has no
# signal; at 1.0 its samples still differ in the answer digit (docs/arabic.md).
ARABIC_TEMPERATURE = 1.0
# Partial credit of arabic_math_reward: an Eastern Arabic digit first, the right number, the box closed after it.
ARABIC_CREDIT = {"system": 0.3, "value": 0.5, "closed": 0.2}
# Multi-turn toy tasks: their environment (run spec env.name) and episode limits.
ENV_TASKS = {"tools": "toy:tools"}
# Model turns a toy:tools episode may take (bucketrl.envs.toy_tools): call, answer, and one spare (a second call
# or a retry).
TOOLS_MAX_TURNS = 3

# The digits each rule asks for.
RULES: dict[str, frozenset[str]] = {
    "even": frozenset("02468"),
    "odd": frozenset("13579"),
    "low": frozenset("01234"),
    "high": frozenset("56789"),
}
_EOS = "<|endoftext|>"
_IM_END = "<|im_end|>"
_DIGITS = frozenset(string.digits)
_LETTERS = frozenset(string.ascii_lowercase)


def _example(task: str, rng: random.Random) -> dict[str, Any]:
    if task == "parity":
        number = rng.randrange(0, 1000)
        return {"prompt": f"{number}:", "answer": "odd" if number % 2 else "even"}
    if task == "digits":
        rule = rng.choice(sorted(RULES))
        return {"prompt": f"{rule}:", "answer": rule}
    if task == "copy":
        letter = rng.choice(string.ascii_lowercase)
        return {"prompt": f"{letter}:", "answer": letter}
    if task == "arabic-math":
        # The sum first, uniform over 0-9: no single answer is right more than a tenth of the time.
        total = rng.randrange(10)
        a = rng.randrange(total + 1)
        question = f"ما ناتج {eastern(a)} + {eastern(total - a)}؟ ضع الجواب داخل \\boxed{{}}"
        return {"prompt": [{"role": "user", "content": question}], "answer": eastern(total)}
    if task == "tools":
        # The key is what the user asks about; the rule is independent of it: only the tool knows.
        return {"prompt": f"{rng.choice(string.ascii_lowercase)}?", "answer": rng.choice(sorted(RULES))}
    raise ValueError(f"unknown toy task {task!r}; choose one of {', '.join(TASKS)}")


def toy_examples(task: str, n: int = DEFAULT_SIZE, seed: int | str = 0) -> list[dict[str, Any]]:
    """``n`` deterministic examples ``{"prompt", "answer"}`` of ``task`` (same seed, same list); a chat task's
    prompt is a list of messages."""
    if task not in TASKS:
        raise ValueError(f"unknown toy task {task!r}; choose one of {', '.join(TASKS)}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = random.Random(f"{task}:{seed}")
    return [_example(task, rng) for _ in range(n)]


def _task_of(answer: str) -> str:
    """The task an answer belongs to, when the caller did not say (answers are self-describing)."""
    if answer in RULES:
        return "digits"  # parity answers ("even"/"odd") score exactly like digits rules
    if len(answer) == 1 and answer in _LETTERS:
        return "copy"
    if answer and all(c in EASTERN_DIGITS for c in answer):
        return "arabic-math"
    raise ValueError(f"cannot tell the toy task from answer {answer!r}; pass task=")


def _char_credit(task: str, ch: str, answer: str, near: float) -> float:
    if task in ("digits", "parity"):
        if ch not in _DIGITS:
            return 0.0
        return 1.0 if ch in RULES[answer] else near
    # copy
    if ch == answer:
        return 1.0
    return near if ch in _LETTERS else 0.0


def arabic_math_reward(completion: str, answer: str) -> float:
    """Partial credit in [0, 1] for the text after the prompt's ``\\boxed{`` (:data:`ARABIC_CREDIT`), each rung
    reachable before the next: the first character an Eastern Arabic digit; the box closed (half of it for a
    ``}`` anywhere, which random text writes often enough to be found; the rest when it follows a number as long
    as the answer: a model that learnt the format but not the sums scores 0.5); the number up to ``}`` (or the
    end) equal to ``answer`` once normalised (so ``7`` for ``٧`` earns the value, not the digit system)."""
    text = completion.split(_EOS, 1)[0].split(_IM_END, 1)[0]
    inside, brace, _ = text.partition("}")
    number = normalise_numerals(inside).strip()
    score = ARABIC_CREDIT["system"] * (inside[:1] != "" and inside[0] in EASTERN_DIGITS)
    if brace:
        score += ARABIC_CREDIT["closed"] * (0.5 + 0.5 * (number.isdigit() and len(number) == len(answer)))
    return score + ARABIC_CREDIT["value"] * (number == normalise_numerals(answer))


def toy_reward(
    completion: str,
    answer: str | None,
    *,
    task: str | None = None,
    length: int = DEFAULT_LENGTH,
    near: float = NEAR_CREDIT,
    **_: Any,
) -> float:
    """Graded reward in [0, 1]: mean credit of the first ``length`` characters of ``completion``.

    Extra keyword arguments (``prompt=`` and whatever the reward registry passes) are ignored.
    """
    if answer is None:
        raise ValueError("the toy reward needs the example's answer")
    task = task or _task_of(answer)
    if task not in TASKS:
        raise ValueError(f"unknown toy task {task!r}; choose one of {', '.join(TASKS)}")
    if task == "digits" and answer not in RULES:
        raise ValueError(f"digits answers are one of {', '.join(sorted(RULES))}, got {answer!r}")
    if task == "parity" and answer not in ("even", "odd"):
        raise ValueError(f"parity answers are 'even' or 'odd', got {answer!r}")
    if task == "copy" and not (len(answer) == 1 and answer in _LETTERS):
        raise ValueError(f"copy answers are one lowercase letter, got {answer!r}")
    if task == "arabic-math":
        if not answer or any(c not in EASTERN_DIGITS for c in answer):
            raise ValueError(f"arabic-math answers are Eastern Arabic digits, got {answer!r}")
        return arabic_math_reward(completion, answer)
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    text = completion.split(_EOS, 1)[0][:length]
    return sum(_char_credit(task, ch, answer, near) for ch in text) / length


def default_run_spec(model_dir: str | Path, *, task: str = DEFAULT_TASK, size: int = DEFAULT_SIZE) -> RunSpec:
    """The demo's run spec: the tiny model at ``model_dir``, the toy task, settings measured to learn."""
    if task not in TASKS:
        raise ValueError(f"unknown toy task {task!r}; choose one of {', '.join(TASKS)}")
    multi_turn: dict[str, Any] = {}
    if task in ENV_TASKS:
        multi_turn = {
            "env": EnvSpec(name=ENV_TASKS[task]),
            # call + answer + a spare; a few seconds per episode on 2 cores, so 60 s only catches a stuck one.
            "episode": EpisodeSpec(max_turns=TOOLS_MAX_TURNS, episode_timeout_s=60.0, max_episode_tokens=256),
        }
    arabic = task == "arabic-math"
    return RunSpec(
        base_model=str(model_dir),
        lora=LoraSpec(r=16, alpha=32.0, dropout=0.0, target_modules="all-linear"),
        group_size=8,
        max_staleness=4,
        sampling=SamplingSpec(
            temperature=ARABIC_TEMPERATURE if arabic else 0.2,
            top_p=1.0,
            top_k=-1,
            max_new_tokens=ARABIC_MAX_NEW_TOKENS if arabic else DEFAULT_LENGTH,
        ),
        # toy:tools' environment scores its episodes; the digits reward would score an answer it left unscored.
        reward=RewardSpec(
            name="toy",
            kwargs={"task": "arabic-math"}
            if arabic
            else {"task": "digits" if task in ENV_TASKS else task, "length": DEFAULT_LENGTH},
        ),
        dataset=DatasetSpec(uri=f"toy:{task}", size=size),
        vocab_size=VOCAB_SIZE,
        queue_capacity_groups=64,
        groups_per_step=8,
        **multi_turn,
    )


if __name__ == "__main__":
    _task = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_TASK
    _rng = random.Random(0)
    _chars = string.digits + string.ascii_lowercase + " +-*=?:.,"
    for ex in toy_examples(_task, int(sys.argv[2]) if len(sys.argv) > 2 else 5):
        text = "".join(_rng.choice(_chars) for _ in range(DEFAULT_LENGTH))
        reward = toy_reward(text, ex["answer"])
        print(f"{ex['prompt']!r:10} answer={ex['answer']!r:7} random={text!r} reward={reward:.3f}")
