"""Datasets: JSONL files with configurable fields, bucket datasets, HF names (cache only), prompt building."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bucketrl import errors
from bucketrl.datasets import (
    describe_dataset,
    examples_for_run,
    load_examples,
    parse_jsonl,
    prompt_token_ids,
)
from bucketrl.wire import DatasetSpec


def _write(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return path


def test_jsonl_with_custom_fields(tmp_path: Path) -> None:
    f = _write(tmp_path / "d.jsonl", [{"q": "1+1=", "a": 2}, {"q": "2+2=", "a": "4"}, {"q": "hi"}])
    spec = DatasetSpec(uri=str(f), prompt_field="q", answer_field="a", size=3)
    ex = load_examples(spec)
    assert [(e.index, e.prompt, e.answer) for e in ex] == [(0, "1+1=", "2"), (1, "2+2=", "4"), (2, "hi", None)]
    assert load_examples(spec.model_copy(update={"uri": f"file://{f}"})) == ex


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ('{"prompt": "a"}\n{not json}\n', "line 2 is not JSON"),
        ('{"prompt": "a"}\n{"question": "b"}\n', "row 2 has no non-empty string field 'prompt'"),
        ('{"prompt": ""}\n', "row 1 has no"),
        ('{"prompt": 5}\n', "row 1 has no"),
        ("[1, 2]\n", "row 1 is not a JSON object"),
    ],
)
def test_bad_jsonl_is_a_clear_error(tmp_path: Path, content: str, needle: str) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(errors.Invalid, match=needle):
        load_examples(DatasetSpec(uri=str(f), size=1))


def test_missing_file_and_size_mismatch(tmp_path: Path) -> None:
    with pytest.raises(errors.Invalid, match="does not exist"):
        load_examples(DatasetSpec(uri=str(tmp_path / "nope.jsonl"), size=1))
    f = _write(tmp_path / "d.jsonl", [{"prompt": str(i)} for i in range(3)])
    assert [e.prompt for e in examples_for_run(DatasetSpec(uri=str(f), size=2))] == ["0", "1"]
    with pytest.raises(errors.Invalid, match=r"dataset\.size=5"):
        examples_for_run(DatasetSpec(uri=str(f), size=5))


def test_describe_dataset_counts(tmp_path: Path) -> None:
    f = _write(tmp_path / "d.jsonl", [{"p": str(i)} for i in range(7)])
    spec = describe_dataset(str(f), prompt_field="p")
    assert spec.size == 7 and spec.prompt_field == "p"


def test_hf_name_not_cached_is_a_clear_error() -> None:
    import datasets  # imported before the loader sets its variables, as in a worker that read another dataset first

    assert datasets.config.HF_HUB_OFFLINE is False  # (this machine's environment does not set it)
    with pytest.raises(errors.Invalid, match="not in the local Hugging Face cache and downloads are disabled") as e:
        load_examples(DatasetSpec(uri="some-org/definitely-not-cached-dataset", size=1))
    # Offline from the first request: before, datasets' old alias alone was set, and the hub was asked five times
    # (23 s of retries here, where no name resolves) before the same error.
    assert "OfflineModeIsEnabled" in str(e.value), e.value


ROWS = [{"question": f"{i}+{i}", "solution": 2 * i, "extra": "x"} for i in range(5)]


def _spec(uri: str, **kw: object) -> DatasetSpec:
    fields = {"uri": uri, "prompt_field": "question", "answer_field": "solution", "size": 1, **kw}
    return DatasetSpec.model_validate(fields)


def test_local_hugging_face_datasets_are_read_with_their_split(tmp_path: Path) -> None:
    """What a user mounts next to a worker with no hub access: a ``save_to_disk`` directory (one split or a
    DatasetDict), a directory of data files, or one parquet / csv file."""
    import datasets

    want = [(r["question"], str(r["solution"])) for r in ROWS]
    train = datasets.Dataset.from_list(ROWS)
    test = datasets.Dataset.from_list(ROWS[:2])
    train.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "dict"))
    (tmp_path / "files" / "data").mkdir(parents=True)
    train.to_parquet(str(tmp_path / "files" / "data" / "train-00000.parquet"))
    train.to_csv(str(tmp_path / "rows.csv"), index=False)
    cases = {
        str(tmp_path / "one"): want,
        str(tmp_path / "dict"): want,
        f"file://{tmp_path / 'files'}": want,
        str(tmp_path / "files" / "data" / "train-00000.parquet"): want,
        str(tmp_path / "rows.csv"): want,
    }
    for uri, rows in cases.items():
        got = load_examples(_spec(uri))
        assert [(e.prompt, e.answer) for e in got] == rows, uri
        assert [e.index for e in got] == list(range(len(rows)))
    assert [e.prompt for e in load_examples(_spec(str(tmp_path / "dict"), split="test"))] == ["0+0", "1+1"]
    assert describe_dataset(str(tmp_path / "dict"), prompt_field="question").size == 5
    # A split that is not there, or a field that is not there, is a clear error naming the dataset.
    with pytest.raises(errors.Invalid, match="split 'validation'"):
        load_examples(_spec(str(tmp_path / "dict"), split="validation"))
    with pytest.raises(errors.Invalid, match="nope"):
        load_examples(_spec(str(tmp_path / "one"), prompt_field="nope"))
    with pytest.raises(errors.Invalid, match="does not exist"):
        load_examples(_spec(str(tmp_path / "missing.jsonl")))


def test_bucket_dataset_needs_a_client_and_the_one_name() -> None:
    with pytest.raises(errors.Invalid, match="ProxyClient"):
        load_examples(DatasetSpec(uri="bucket:dataset.jsonl", size=1))
    with pytest.raises(errors.Invalid, match=r"bucket:dataset\.jsonl"):
        load_examples(DatasetSpec(uri="bucket:other.jsonl", size=1))


def test_parse_jsonl_bytes_and_non_utf8() -> None:
    spec = DatasetSpec(uri="x", size=1)
    assert parse_jsonl(b'{"prompt": "\xc3\xa9"}\n', spec, "x")[0].prompt == "é"
    with pytest.raises(UnicodeDecodeError):
        parse_jsonl(b'{"prompt": "\xff"}\n', spec, "x")


def test_prompt_token_ids_plain_and_chat_template(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    # The built-in model's ChatML wraps a chat-format row and ends with the generation prompt...
    messages = [{"role": "user", "content": "1+2="}]
    templated = prompt_token_ids(tok, "1+2=", messages)
    assert tok.decode(templated) == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    assert templated[0] == tok.bos_token_id
    assert prompt_token_ids(tok, "1+2=", messages, raw=True) == templated  # raw is for plain prompts
    # ...but leaves a plain prompt as written.
    assert tok.decode(prompt_token_ids(tok, "1+2=")) == "1+2="
    # Another model's template wraps plain prompts too, except a raw one (the toy tasks' plain prompts).
    tok.chat_template += "{#- another model -#}"
    assert prompt_token_ids(tok, "1+2=")[: len(templated)] == templated
    assert tok.decode(prompt_token_ids(tok, "1+2=", raw=True)) == "1+2="
    toy = load_examples(DatasetSpec(uri="toy:digits", size=3))
    assert all(e.raw for e in toy)
    assert tok.decode(prompt_token_ids(tok, toy[0].prompt, toy[0].chat(), raw=toy[0].raw)) == toy[0].prompt
    tok.chat_template = None
    assert tok.decode(prompt_token_ids(tok, "1+2=")) == "1+2="


def test_toy_dataset() -> None:
    from bucketrl.tasks.toy import DEFAULT_TASK

    spec = DatasetSpec(uri=f"toy:{DEFAULT_TASK}", size=5)
    ex = load_examples(spec)
    assert len(ex) == 5 and all(e.prompt and e.answer is not None for e in ex)
    assert [e.index for e in ex] == list(range(5))
    assert load_examples(spec) == ex  # deterministic: trainer and generators agree
    with pytest.raises(errors.Invalid):
        load_examples(DatasetSpec(uri="toy:no-such-task", size=5))
