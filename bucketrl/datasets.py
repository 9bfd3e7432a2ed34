"""Datasets: the prompts (and reference answers) of a run, loaded the same way by trainer and generators.

``load_examples(spec, client)`` understands four kinds of ``dataset.uri``:

    toy:<task>            the built-in toy task (bucketrl.tasks.toy), ``dataset.size`` examples
    /path/data.jsonl      a JSONL file (also file:///path/data.jsonl), one JSON object a line
    bucket:<name>         a JSONL file the trainer uploaded to the run (``PUT /v1/runs/{run}/dataset``),
                          downloaded through the proxy; ``bucket:dataset.jsonl`` is that file
    /path/dir             a local Hugging Face dataset: a directory written by ``save_to_disk``, or one of
    /path/data.parquet    data files (parquet, csv, json[l], arrow) ``datasets.load_dataset`` reads, or one
                          such file; ``dataset.split`` picks the split (needs the ``hf`` extra)
    <hf name>             a Hugging Face ``datasets`` name, only if it is already in the local cache
                          (no download: HF_DATASETS_OFFLINE is forced)

Fields come from ``dataset.prompt_field`` / ``dataset.answer_field`` (an answer is optional; numbers
become strings). Chat format: the prompt field (or ``messages`` when the row has no prompt field) is a list
of ``{"role", "content"}`` messages; a final assistant message is the reference answer when the row has no
answer field, and the conversation before it goes through the model's chat template. A row without a
prompt is an error naming the line. The prompt cursor on the proxy
hands out indices ``0..size-1``, so an example's ``index`` is its position in the file.

:func:`describe_dataset` builds a :class:`DatasetSpec` with ``size`` counted (the trainer uses it when it
creates a run). :func:`prompt_token_ids` turns a prompt into token ids, through the tokenizer's chat
template when it has one.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bucketrl import errors
from bucketrl.rollout.example import Example
from bucketrl.tasks.tiny_tokenizer import CHAT_TEMPLATE as BUILT_IN_CHAT_TEMPLATE
from bucketrl.tasks.toy import PREFILL, toy_examples
from bucketrl.wire import DatasetSpec

if TYPE_CHECKING:
    from bucketrl.client import ProxyClient


def _as_answer(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, bool | int | float):
        return str(value)
    return json.dumps(value, sort_keys=True)


# A chat-format row holds its conversation here when the prompt field is absent.
CHAT_FIELD = "messages"


def _chat_turns(value: Any, where: str) -> tuple[tuple[str, str], ...] | None:
    """``value`` as ((role, content), ...) if it is a list of chat messages, else None (not chat format)."""
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) for m in value):
        return None
    turns = []
    for j, m in enumerate(value):
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise errors.Invalid(f"{where}: message {j + 1} needs string 'role' and 'content' fields")
        turns.append((role, content))
    return tuple(turns)


def _chat_example(index: int, turns: tuple[tuple[str, str], ...], answer: Any, where: str) -> Example:
    """A conversation ending with an assistant turn: that turn is the reference answer (unless the row has one)
    and the policy answers the conversation before it."""
    if turns[-1][0] == "assistant":
        if answer is None:
            answer = turns[-1][1]
        turns = turns[:-1]
    users = [c for r, c in turns if r == "user"]
    if not users:
        raise errors.Invalid(f"{where}: the conversation has no 'user' message for the policy to answer")
    return Example(index=index, prompt=users[-1], answer=_as_answer(answer), messages=turns)


def _rows_to_examples(rows: list[dict[str, Any]], spec: DatasetSpec, where: str) -> list[Example]:
    """Plain rows (``prompt_field`` a string) or chat rows (``prompt_field``, or ``messages`` when that field is
    absent, a list of {"role", "content"} messages)."""
    out: list[Example] = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise errors.Invalid(f"{where}: row {i + 1} is not a JSON object")
        prompt = row.get(spec.prompt_field)
        if prompt is None and spec.prompt_field not in row:
            prompt = row.get(CHAT_FIELD)
        answer = row.get(spec.answer_field)
        turns = _chat_turns(prompt, f"{where}: row {i + 1}")
        if turns is not None:
            out.append(_chat_example(i, turns, answer, f"{where}: row {i + 1}"))
            continue
        if not isinstance(prompt, str) or not prompt:
            found = ", ".join(repr(k) for k in list(row)[:20]) or "none"
            raise errors.Invalid(
                f"{where}: row {i + 1} has no non-empty string field {spec.prompt_field!r} (nor chat messages); "
                f"its fields are {found}",
                code="dataset_prompt_field",
            )
        out.append(Example(index=i, prompt=prompt, answer=_as_answer(answer)))
    return out


def parse_jsonl(data: bytes | str, spec: DatasetSpec, where: str) -> list[Example]:
    """Parse JSONL text; blank lines are skipped; a bad line is an ``Invalid`` naming its line number."""
    text = data.decode("utf-8", errors="strict") if isinstance(data, bytes) else data
    rows: list[dict[str, Any]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise errors.Invalid(f"{where}: line {lineno} is not JSON: {exc.msg}") from exc
    return _rows_to_examples(rows, spec, where)


def _toy(spec: DatasetSpec) -> list[Example]:
    task = spec.uri.removeprefix("toy:")
    try:
        # Each split is its own deterministic draw ("train" keeps seed 0): a held-out split for evaluation.
        rows = toy_examples(task or "", spec.size, seed=0 if spec.split == "train" else spec.split)
    except (KeyError, ValueError) as exc:
        raise errors.Invalid(f"dataset {spec.uri!r}: {exc}") from exc
    fields = spec.model_copy(update={"prompt_field": "prompt", "answer_field": "answer"})
    # Plain toy prompts stay plain whatever the model's template (a chat-form toy task goes through it).
    prefill = PREFILL.get(task, "")
    return [replace(e, raw=e.messages is None, prefill=prefill) for e in _rows_to_examples(rows, fields, spec.uri)]


# Single files read through Hugging Face ``datasets`` rather than as JSONL.
HF_FILE_SUFFIXES = (".parquet", ".csv", ".arrow")


def _local_path(uri: str) -> Path | None:
    if uri.startswith("file://"):
        return Path(uri.removeprefix("file://"))
    if uri.endswith((".jsonl", ".json", *HF_FILE_SUFFIXES)) or uri.startswith(("/", "./", "../")):
        return Path(uri)
    return None


def _bucket(spec: DatasetSpec, client: ProxyClient | None) -> list[Example]:
    name = spec.uri.removeprefix("bucket:")
    if name != "dataset.jsonl":
        raise errors.Invalid(f"dataset {spec.uri!r}: the run's bucket holds one dataset, 'bucket:dataset.jsonl'")
    if client is None:
        raise errors.Invalid(f"dataset {spec.uri!r} is downloaded through the proxy: pass a ProxyClient")
    download = getattr(client, "download_dataset", None)
    if download is None:
        raise errors.Invalid("this bucketrl client cannot download datasets (ProxyClient.download_dataset missing)")
    return parse_jsonl(download(), spec, spec.uri)


def _huggingface(spec: DatasetSpec, local: Path | None = None) -> list[Example]:
    """A hub name from the local cache, or a local dataset (``local``): never a download."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # cache only: a worker never downloads at run time
    try:
        import datasets
    except ImportError as exc:
        kind = "a local Hugging Face dataset" if local is not None else "a Hugging Face datasets name"
        raise errors.Invalid(
            f"dataset {spec.uri!r} is {kind} (not 'toy:<task>', a .jsonl file or 'bucket:dataset.jsonl'); reading it "
            "needs the `datasets` package, which is not installed (pip install 'bucketrl[hf]')"
        ) from exc
    # In case it was imported before the variable was set: datasets reads HF_HUB_OFFLINE (HF_DATASETS_OFFLINE is its
    # old alias); with only the alias set, a name not cached cost five retried requests to the hub (23 s offline).
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    try:
        if local is None:
            ds = datasets.load_dataset(spec.uri, split=spec.split)
        elif _saved_to_disk(local):
            ds = datasets.load_from_disk(str(local))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[spec.split]
        elif local.is_dir():  # a directory of data files: the packaged builder is picked from their type
            ds = datasets.load_dataset(str(local), split=spec.split)
        else:  # one file: its suffix names the builder (parquet, csv, arrow)
            ds = datasets.load_dataset(local.suffix.lstrip("."), data_files=str(local), split=spec.split)
    except Exception as exc:  # datasets raises many types for "not cached" / "no such split"
        where = (
            "cannot be read as a Hugging Face dataset"
            if local is not None
            else "is not in the local Hugging Face cache and downloads are disabled"
        )
        raise errors.Invalid(f"dataset {spec.uri!r} (split {spec.split!r}) {where}: {exc}") from exc
    return _rows_to_examples([dict(r) for r in ds], spec, spec.uri)


def _saved_to_disk(path: Path) -> bool:
    """A directory ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` wrote."""
    return path.is_dir() and ((path / "state.json").exists() or (path / "dataset_dict.json").exists())


def load_examples(spec: DatasetSpec, client: ProxyClient | None = None) -> list[Example]:
    """The run's examples in index order (see the module docstring for the URI kinds).

    Toy tasks produce exactly ``spec.size`` examples; files are returned whole (the caller checks the size).
    """
    uri = spec.uri
    if uri.startswith("toy:"):
        return _toy(spec)
    if uri.startswith("bucket:"):
        return _bucket(spec, client)
    path = _local_path(uri)
    if path is not None:
        if path.is_dir() or (path.is_file() and path.suffix in HF_FILE_SUFFIXES):
            return _huggingface(spec, local=path)
        if not path.is_file():
            raise errors.Invalid(f"dataset file {str(path)!r} does not exist")
        return parse_jsonl(path.read_bytes(), spec, str(path))
    return _huggingface(spec)


def examples_for_run(spec: DatasetSpec, client: ProxyClient | None = None) -> list[Example]:
    """Exactly ``spec.size`` examples, or ``Invalid`` when the source holds fewer than the run was created with."""
    examples = load_examples(spec, client)
    if len(examples) < spec.size:
        raise errors.Invalid(
            f"dataset {spec.uri!r} has {len(examples)} examples but the run spec says dataset.size={spec.size}"
        )
    return examples[: spec.size]


def describe_dataset(
    uri: str,
    *,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    split: str = "train",
    toy_size: int = 256,
    client: ProxyClient | None = None,
) -> DatasetSpec:
    """A :class:`DatasetSpec` for ``uri`` with ``size`` = its number of examples (``toy_size`` for toy tasks)."""
    probe = DatasetSpec(uri=uri, prompt_field=prompt_field, answer_field=answer_field, split=split, size=toy_size)
    size = toy_size if uri.startswith("toy:") else len(load_examples(probe, client))
    if size < 1:
        raise errors.Invalid(f"dataset {uri!r} is empty")
    return probe.model_copy(update={"size": size})


def prompt_token_ids(
    tokenizer: Any, prompt: str, messages: list[dict[str, str]] | None = None, *, raw: bool = False, prefill: str = ""
) -> list[int]:
    """Token ids of ``prompt`` as the policy sees it: the chat template (user turn + generation prompt) when the
    tokenizer has one, the plain text otherwise, when ``raw`` (:attr:`Example.raw`, the toy tasks' plain prompts)
    and with the built-in model (its template is for chat-format rows: a plain prompt is continued as written, as
    TRL does); a chat-format example's ``messages`` always go through the template (the preflight refuses a chat
    dataset for a model without one). ``prefill`` (:attr:`Example.prefill`) follows, encoded on its own. Never
    empty."""
    template = getattr(tokenizer, "chat_template", None)
    if messages is not None or (not raw and template and template != BUILT_IN_CHAT_TEMPLATE):
        ids = tokenizer.apply_chat_template(
            messages if messages is not None else [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            tokenize=True,
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        ids = list(ids)
    else:
        ids = list(tokenizer.encode(prompt, add_special_tokens=True))
    if prefill:
        ids += tokenizer.encode(prefill, add_special_tokens=False)
    if not ids:
        fallback = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        ids = [int(fallback if fallback is not None else 0)]
    return [int(t) for t in ids]
