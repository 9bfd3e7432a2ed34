"""Preflight: check a run's configuration in seconds, before anything starts, with one line saying what to change.

``bucketrl up`` runs :func:`check_run` before it starts a process; every worker runs it again at its start
(with the run spec it got from the proxy), and exits with :data:`EXIT_CONFIG` (2) on a :class:`ConfigError`.
The checks, in the order a user meets them:

1. the model: its config and tokenizer are readable (a local directory, or a name in the Hugging Face cache);
2. the dataset: it parses, the prompt field exists (the message lists the fields a row has), a chat-format
   dataset has a model with a chat template;
3. LoRA: every target module exists in the model (built on the meta device: no weights are read), and
   ``all-linear`` finds layers (GPT-2's ``Conv1D`` counts as linear);
4. the context window: the longest prompt plus ``max_new_tokens`` fits the model's context (and the
   generator's ``BUCKETRL_MAX_MODEL_LEN``); :func:`default_max_new_tokens` picks a default that fits;
5. the reward: it imports, accepts ``reward.kwargs``, and one call on the first dataset row (with the row's
   answer as the completion) returns a number or None within the reward timeout;
6. a multi-turn run's environment (``env.name``): it imports, is a class with ``rollout``, and is built from
   ``env.kwargs`` (:func:`check_env`; ``bucketrl up`` checks it with the reward, before the model);
7. the tokenizer reads the dataset back (:func:`check_tokenizer_coverage`): prompts and answers encoded and
   decoded again lose no more than 1 % of their characters (dropped, or read as the unknown or padding token).
   A character-level tokenizer (the built-in model's before issue 34), which knows no Arabic, dropped every Arabic
   letter, and a run on Arabic data trained on the digits without a word (``dataset.allow_lossy_tokenizer``,
   ``--allow-lossy-tokenizer``: the user knows, train anyway).

``names`` maps each check to what the user changes: ``bucketrl up`` passes its flags (``--reward``), the
workers the run spec's fields (``reward.name``).
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import importlib.util
import inspect
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bucketrl import errors
from bucketrl.datasets import load_examples, prompt_token_ids
from bucketrl.envs.loader import make_env
from bucketrl.envs.protocol import EXTERNAL
from bucketrl.rewards import validate_reward
from bucketrl.rollout.reward_kinds import classify_reward

EXIT_CONFIG = 2
# The line a worker prints before it exits 2; `bucketrl up` shows the worker's reason from it.
CONFIG_ERROR_PREFIX = "configuration error: "

UP_NAMES = {
    "model": "--model",
    "dataset": "--dataset",
    "prompt_field": "--prompt-field",
    "answer_field": "--answer-field",
    "reward": "--reward",
    "reward_kwargs": "--reward-kwargs",
    "env": "--env",
    "env_kwargs": "--env-kwargs",
    "lora": "--lora-target-modules",
    "max_new_tokens": "--max-new-tokens",
    "context": "--max-new-tokens",
    "allow_lossy_tokenizer": "--allow-lossy-tokenizer",
}
SPEC_NAMES = {
    "model": "base_model (run spec) or BUCKETRL_MODEL_PATH",
    "dataset": "dataset.uri (run spec)",
    "prompt_field": "dataset.prompt_field (run spec)",
    "answer_field": "dataset.answer_field (run spec)",
    "reward": "reward.name (run spec)",
    "reward_kwargs": "reward.kwargs (run spec)",
    "env": "env.name (run spec)",
    "env_kwargs": "env.kwargs (run spec)",
    "lora": "lora.target_modules (run spec)",
    "max_new_tokens": "sampling.max_new_tokens (run spec)",
    "context": "sampling.max_new_tokens (run spec) or BUCKETRL_MAX_MODEL_LEN",
    "allow_lossy_tokenizer": "dataset.allow_lossy_tokenizer: true (run spec)",
}
# A model without a known context: what the longest prompt plus max_new_tokens may use.
FALLBACK_CONTEXT = 2048
DEFAULT_MAX_NEW_TOKENS = 512
REWARD_CALL_TIMEOUT_S = 10.0
# Prompts (the longest by characters) tokenized to find the longest in tokens.
LONGEST_CANDIDATES = 256
# Rows (spread over the dataset) whose text the tokenizer check reads: a big dataset stays a second's work.
COVERAGE_ROWS = 2000
# The share of the dataset's characters the tokenizer may read as its unknown or padding token: a stray emoji
# or control character is no reason to stop a run, a script the tokenizer does not know is.
MAX_UNKNOWN_SHARE = 0.01


class ConfigError(ValueError):
    """A user's configuration is wrong; the message names what to change."""


@dataclass
class Report:
    """What the preflight found (``bucketrl up`` prints it)."""

    rows: int = 0
    chat: bool = False
    fields: list[str] = field(default_factory=list)
    context: int | None = None
    longest_prompt_tokens: int = 0
    longest_prompt_row: int = 0
    lora_targets: list[str] = field(default_factory=list)
    reward_value: float | None = None
    vocab_size: int = 0
    max_new_tokens: int = 0
    chose_max_new_tokens: bool = False

    def lines(self) -> list[str]:
        out = [
            f"dataset    {self.rows} rows, {'chat messages' if self.chat else 'text prompts'}; fields "
            + ", ".join(self.fields),
            f"context    longest prompt {self.longest_prompt_tokens} tokens (row {self.longest_prompt_row}) + "
            f"max_new_tokens {self.max_new_tokens}{' (chosen to fit)' if self.chose_max_new_tokens else ''} "
            f"<= {self.context or FALLBACK_CONTEXT}",
            f"lora       {', '.join(self.lora_targets)}",
        ]
        return out


# -- the model -----------------------------------------------------------------------------------------


def _hf_load(loader: Any, model: str, what: str, names: dict[str, str]) -> Any:
    """``loader.from_pretrained(model)``: a local directory, else the Hugging Face cache, else a download."""
    local = Path(model).expanduser()
    if local.exists():
        if not local.is_dir():
            raise ConfigError(f"{names['model']} {model}: not a model directory")
        try:
            return loader.from_pretrained(str(local))
        except Exception as exc:  # transformers raises OSError/ValueError/KeyError for unreadable models
            raise ConfigError(f"{names['model']} {model}: cannot read its {what}: {_short(exc)}") from exc
    if model.startswith(("/", "./", "../", "~")):
        raise ConfigError(f"{names['model']} {model}: no such directory")
    try:
        return loader.from_pretrained(model, local_files_only=True)
    except Exception:
        pass
    try:  # not cached: a download, unless HF_HUB_OFFLINE forbids it
        return loader.from_pretrained(model)
    except Exception as exc:
        raise ConfigError(
            f"{names['model']} {model}: not a local directory and its {what} cannot be loaded from the Hugging "
            f"Face hub or cache ({_short(exc)})"
        ) from exc


def load_config_and_tokenizer(model: str, names: dict[str, str] = UP_NAMES) -> tuple[Any, Any]:
    if model.startswith(("/", "./", "../", "~")) and not Path(model).expanduser().exists():
        # Before importing transformers (seconds on a busy machine): a wrong path is the common mistake.
        raise ConfigError(f"{names['model']} {model}: no such directory")
    from transformers import AutoConfig, AutoTokenizer

    config = _hf_load(AutoConfig, model, "config", names)
    tokenizer = _hf_load(AutoTokenizer, model, "tokenizer", names)
    return config, tokenizer


def model_context(config: Any) -> int | None:
    """The model's context window (``max_position_embeddings`` or its kin), None when it does not say."""
    text = getattr(config, "get_text_config", lambda: config)()
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def vocab_size(config: Any) -> int:
    text = getattr(config, "get_text_config", lambda: config)()
    return int(text.vocab_size)


def linear_types() -> tuple[type, ...]:
    import torch

    types: list[type] = [torch.nn.Linear]
    try:
        from transformers.pytorch_utils import Conv1D  # GPT-2 style layers: linear, stored transposed

        types.append(Conv1D)
    except ImportError:
        pass
    return tuple(types)


def lora_targets(config: Any, targets: list[str] | str, names: dict[str, str] = UP_NAMES) -> list[str]:
    """The module-name suffixes LoRA will wrap; ConfigError when one does not exist or none is linear.

    The model is built on the meta device from its config (no weights read, no memory used)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:
        raise ConfigError(
            f"{names['model']}: not a causal language model transformers can build ({_short(exc)})"
        ) from exc
    linear = linear_types()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    available = sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if n and isinstance(m, linear) and m is not head}
    )
    if targets == "all-linear":
        if not available:
            raise ConfigError(f"{names['model']}: the model has no linear layers for LoRA to target")
        return available
    all_names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules() if n}
    missing = [t for t in targets if t not in all_names]
    if missing:
        raise ConfigError(
            f"{names['lora']}: {', '.join(missing)} not in the model; its linear layers are {', '.join(available)}"
        )
    return list(targets)


# -- the dataset and the context --------------------------------------------------------------------------


def check_dataset(spec: Any, client: Any = None, names: dict[str, str] = UP_NAMES) -> list[Any]:
    """Load the examples (``spec``: a DatasetSpec); ConfigError naming the flag to change."""

    try:
        examples = load_examples(spec, client)
    except errors.Invalid as exc:
        hint = f"; set {names['prompt_field']}" if exc.code == "dataset_prompt_field" else ""
        # The message already names the file (and the row): prefix only the option to change.
        raise ConfigError(f"{names['dataset']}: {exc.message}{hint}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{names['dataset']} {spec.uri}: cannot read it: {_short(exc)}") from exc
    if not examples:
        raise ConfigError(f"{names['dataset']} {spec.uri}: no rows")
    return examples


def longest_prompt(tokenizer: Any, examples: list[Any], names: dict[str, str] = UP_NAMES) -> tuple[int, int]:
    """(tokens, 1-based row) of the longest prompt as the policy sees it (chat template applied)."""

    if any(e.messages is not None for e in examples) and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"{names['dataset']}: chat-format rows (messages lists) need a model whose tokenizer has a chat "
            f"template; {names['model']} has none (use text prompts, or a model with a chat template)"
        )
    # Token counts follow character counts closely: tokenize only the longest texts (a big dataset stays quick).
    by_chars = sorted(examples, key=lambda e: -sum(len(c) for _, c in e.messages or (("", e.prompt),)))
    best, row = 0, 1
    for e in by_chars[:LONGEST_CANDIDATES]:
        try:
            n = len(prompt_token_ids(tokenizer, e.prompt, e.chat(), raw=e.raw, prefill=e.prefill))
        except Exception as exc:  # a template that rejects the conversation (roles it does not know, ...)
            raise ConfigError(
                f"{names['dataset']}: row {e.index + 1} does not go through the model's chat template: {_short(exc)}"
            ) from exc
        if n > best:
            best, row = n, e.index + 1
    return best, row


def _texts(example: Any) -> list[str]:
    """What the policy reads and writes of one row: its prompt (every message of a chat row) and its answer."""
    texts = [c for _, c in example.messages] if example.messages is not None else [example.prompt]
    return texts + ([example.answer] if example.answer else [])


def _read_back(tokenizer: Any, text: str) -> tuple[int, str]:
    """(characters of ``text`` the tokenizer loses, what it reads back): the text encoded and decoded again, both
    compared after the tokenizer's own normalisation (its normalizer, e.g. NFC or lower case) with whitespace runs
    as one space. A lost character is one the decoding does not have: dropped (a BPE without an unknown token
    drops what its vocabulary lacks) or replaced (by the unknown or padding token)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoded = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    normalizer = getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", None)

    def norm(s: str) -> str:
        # Sentencepiece-style normalizers write spaces as U+2581: whitespace is compared after them, not before.
        s = normalizer.normalize_str(s) if normalizer is not None else s
        return " ".join(s.replace("\u2581", " ").split())

    want, got = norm(text), norm(decoded)
    if want == got:
        return 0, decoded
    kept = sum(block.size for block in difflib.SequenceMatcher(None, want, got, autojunk=False).get_matching_blocks())
    return max(1, len(want) - kept), decoded


def check_tokenizer_coverage(tokenizer: Any, examples: list[Any], names: dict[str, str] = UP_NAMES) -> None:
    """ConfigError when the tokenizer loses more than :data:`MAX_UNKNOWN_SHARE` of the dataset's characters
    (:func:`_read_back`: a prompt or answer encoded and decoded again is not the text it was). Reads up to
    :data:`COVERAGE_ROWS` rows spread over the dataset."""
    step = max(1, len(examples) // COVERAGE_ROWS)
    total = lost = 0
    first: tuple[Any, str, str] | None = None
    for e in examples[::step][:COVERAGE_ROWS]:
        for text in _texts(e):
            n, decoded = _read_back(tokenizer, text)
            total, lost = total + len(text), lost + n
            if n and first is None:
                first = (e, text, decoded)
    if first is not None and lost > MAX_UNKNOWN_SHARE * total:
        e, text, decoded = first
        raise ConfigError(
            f"{names['dataset']}: the tokenizer of {names['model']} loses {100 * lost / total:.0f}% of the dataset's "
            f"characters, dropped or read as its unknown or padding token (row {e.index + 1}: {_clip(text)!r} reads "
            f"back as {_clip(decoded)!r}); use a model whose tokenizer covers them (a byte-level BPE such as "
            f"Qwen2.5's), or pass {names['allow_lossy_tokenizer']} to train on what it keeps"
        )


def _clip(text: str, n: int = 40) -> str:
    return text if len(text) <= n else text[: n - 1] + "\u2026"


def default_max_new_tokens(context: int | None, longest: int) -> int:
    """``DEFAULT_MAX_NEW_TOKENS``, lowered so the longest prompt still fits (at least 1)."""
    room = (context or FALLBACK_CONTEXT) - longest
    return max(1, min(DEFAULT_MAX_NEW_TOKENS, room))


def check_context(
    context: int | None, longest: int, row: int, max_new_tokens: int, names: dict[str, str] = UP_NAMES
) -> None:
    ctx = context or FALLBACK_CONTEXT
    if longest + max_new_tokens > ctx:
        room = ctx - longest
        fix = (
            f"lower {names['context']} to at most {room}"
            if room >= 1
            else f"shorten the prompts ({names['dataset']}) or use a model with a longer context"
        )
        raise ConfigError(
            f"the longest prompt (row {row}, {longest} tokens) plus max_new_tokens {max_new_tokens} exceeds the "
            f"context of {ctx} tokens: {fix}"
        )


# -- the reward ---------------------------------------------------------------------------------------------


def check_reward(
    reward: Any, example: Any, names: dict[str, str] = UP_NAMES, timeout_s: float = REWARD_CALL_TIMEOUT_S
) -> float | None:
    """Resolve ``reward`` (a RewardSpec), check its signature, call it once on ``example``; return the value."""

    fn = resolve_reward_checked(reward, names)
    completion = example.answer if example.answer is not None else ""
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["value"] = fn(completion, example.answer, prompt=example.prompt, **reward.kwargs)
        except BaseException as exc:  # the user's function: anything may come out
            box["error"] = exc

    # A daemon thread: a reward that hangs is reported, and this process exits without waiting for it.
    t = threading.Thread(target=call, name="preflight-reward", daemon=True)
    t.start()
    t.join(timeout_s)
    where = f"{names['reward']} {reward.name}"
    if t.is_alive():
        raise ConfigError(
            f"{where}: no answer within {timeout_s:g}s on dataset row {example.index + 1} "
            "(BUCKETRL_REWARD_TIMEOUT_S is the limit per completion)"
        )
    if "error" in box:
        exc = box["error"]
        raise ConfigError(f"{where} raised on dataset row {example.index + 1}: {type(exc).__name__}: {exc}"[:600])
    value, kind, message = classify_reward(box.get("value"))
    if kind in ("non_numeric", "non_finite"):
        raise ConfigError(f"{where}: {message} on dataset row {example.index + 1}; return a float (or None)")
    return value


def resolve_reward_checked(reward: Any, names: dict[str, str] = UP_NAMES) -> Any:
    """The reward function, importable and accepting (completion, answer, *, prompt, **reward.kwargs)."""

    try:
        fn = validate_reward(reward)
    except errors.Invalid as exc:
        which = names["reward_kwargs"] if "reward.kwargs" in exc.message else names["reward"]
        raise ConfigError(f"{which}: {exc.message}") from exc
    try:
        inspect.signature(fn).bind("completion", "answer", prompt="prompt", **reward.kwargs)
    except TypeError as exc:
        raise ConfigError(
            f"{names['reward']} {reward.name}: its signature does not take (completion, answer, *, prompt, "
            f"**kwargs): {exc}"
        ) from exc
    except ValueError:  # a builtin without a signature: the call decides
        pass
    return fn


# -- everything -------------------------------------------------------------------------------------------------


def check_run(
    spec: Any,
    *,
    model: str | None = None,
    names: dict[str, str] = UP_NAMES,
    client: Any = None,
    max_model_len: int | None = None,
    examples: list[Any] | None = None,
    choose_max_new_tokens: bool = False,
    reward: str = "call",
    reward_timeout_s: float = REWARD_CALL_TIMEOUT_S,
) -> Report:
    """Every check on a RunSpec (``model`` overrides ``spec.base_model``); ConfigError on the first problem.

    ``choose_max_new_tokens``: the user did not set it; pick :func:`default_max_new_tokens` (in the report).
    ``reward``: "call" (resolve, check the signature, call once: `bucketrl up`), "resolve" (no call: a generator,
    whose reward may legitimately take its whole BUCKETRL_REWARD_TIMEOUT_S; failures at run time are counted
    and stop the run past a threshold), "skip" (the trainer, which never runs the reward)."""
    model = model or spec.base_model
    report = Report()
    # Cheapest first: the dataset and the reward need no model (a mistake there stops in seconds).
    examples = examples if examples is not None else check_dataset(spec.dataset, client, names)
    report.rows = len(examples)
    report.chat = any(e.messages is not None for e in examples)
    report.fields = [spec.dataset.prompt_field if not report.chat else "messages"] + (
        [spec.dataset.answer_field] if any(e.answer is not None for e in examples) else []
    )
    if reward == "call":
        report.reward_value = check_reward(spec.reward, examples[0], names, timeout_s=reward_timeout_s)
    elif reward == "resolve":
        resolve_reward_checked(spec.reward, names)
    if reward != "skip" and getattr(spec, "env", None) is not None:
        check_env(spec.env, names)
    config, tokenizer = load_config_and_tokenizer(model, names)
    if not getattr(spec.dataset, "allow_lossy_tokenizer", False):
        check_tokenizer_coverage(tokenizer, examples, names)
    report.lora_targets = lora_targets(config, spec.lora.target_modules, names)
    report.longest_prompt_tokens, report.longest_prompt_row = longest_prompt(tokenizer, examples, names)
    context = model_context(config)
    if max_model_len is not None:
        context = min(context or max_model_len, max_model_len)
    report.context = context
    report.vocab_size = vocab_size(config)
    report.max_new_tokens = spec.sampling.max_new_tokens
    if choose_max_new_tokens:
        report.max_new_tokens = default_max_new_tokens(context, report.longest_prompt_tokens)
        report.chose_max_new_tokens = True
    check_context(context, report.longest_prompt_tokens, report.longest_prompt_row, report.max_new_tokens, names)
    return report


def check_env(env: Any, names: dict[str, str] = UP_NAMES) -> None:
    """A multi-turn run's environment: importable, a class with a ``rollout`` method, constructible from
    env.kwargs; and what it needs installed. The instance made to check is closed again (``aclose``)."""

    for module, extra in (("openai", "generator"), ("fastapi", "generator"), ("uvicorn", "generator")):
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"{names['env']} {env.name}: multi-turn runs need {module!r}: pip install 'bucketrl[{extra}]'"
            )
    if env.name == EXTERNAL:
        return
    try:
        instance = make_env(env.name, env.kwargs)
    except errors.Invalid as exc:
        # The constructor refused the kwargs: the option to change is the kwargs, not the name.
        which = names["env_kwargs"] if "env.kwargs" in exc.message else names["env"]
        raise ConfigError(f"{which}: {exc.message}") from None
    _close_env(instance)


def _close_env(instance: Any, timeout_s: float = 10.0) -> None:
    """Await the checked instance's ``aclose`` (what it holds open), on a loop of its own in a daemon thread:
    the caller may be inside an event loop, and an ``aclose`` that hangs must not hold up the check."""
    aclose = getattr(instance, "aclose", None)
    if aclose is None:
        return

    def run() -> None:

        # The user's code: a failing close is not a configuration error.
        with contextlib.suppress(BaseException):
            asyncio.run(asyncio.wait_for(aclose(), timeout_s))

    t = threading.Thread(target=run, name="preflight-env-close", daemon=True)
    t.start()
    t.join(timeout_s + 1.0)


def _short(exc: BaseException) -> str:
    """The first line of an exception's message, at most 300 characters (never a traceback)."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    return first[:300]
