"""The pieces of a user's own run that need no services: chat datasets, reward failure kinds, the preflight's
model checks, the trainer's stop on unscorable rewards, and the summary over a resumed run's whole history."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bucketrl import errors
from bucketrl.datasets import parse_jsonl, prompt_token_ids
from bucketrl.preflight import ConfigError, check_context, default_max_new_tokens, lora_targets
from bucketrl.rewards import RewardItem, RewardPool
from bucketrl.rollout.reward_kinds import classify_reward
from bucketrl.up.report import summarize, windows
from bucketrl.up.watch import RunWatcher
from bucketrl.wire import DatasetSpec, RewardSpec

FIX = "tests.generator.reward_fixtures"


def test_chat_rows_become_conversations_with_the_last_assistant_turn_as_answer(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    rows = [
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
        {"prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}], "answer": 7},
        {"prompt": "plain text", "answer": "x"},
    ]
    spec = DatasetSpec(uri="x.jsonl", size=3)
    ex = parse_jsonl("\n".join(json.dumps(r) for r in rows), spec, "x.jsonl")
    assert ex[0].prompt == "2+2?" and ex[0].answer == "4" and ex[0].chat() == [{"role": "user", "content": "2+2?"}]
    assert ex[1].prompt == "hi" and ex[1].answer == "7" and len(ex[1].chat() or []) == 2
    assert ex[2].messages is None and ex[2].prompt == "plain text"
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    assert prompt_token_ids(tok, ex[1].prompt, ex[1].chat()) == tok.encode("<system>Be terse.<user>hi")
    with pytest.raises(errors.Invalid, match="no 'user' message"):
        parse_jsonl(json.dumps({"messages": [{"role": "assistant", "content": "4"}]}), spec, "x")
    with pytest.raises(errors.Invalid, match="its fields are 'question', 'solution'"):
        parse_jsonl(json.dumps({"question": "q", "solution": "s"}), spec, "x")


def test_reward_results_are_classified_and_strings_are_errors() -> None:
    assert classify_reward(0.5) == (0.5, None, None)
    assert classify_reward(True)[0] == 1.0
    assert classify_reward("1.0")[:2] == (None, "non_numeric")
    assert classify_reward(float("nan"))[:2] == (None, "non_finite")
    assert classify_reward(None)[:2] == (None, "none")


def test_pool_says_why_each_completion_has_no_reward() -> None:
    with RewardPool(RewardSpec(name=f"{FIX}:garbage"), workers=1) as pool:
        got = pool.score_detailed([RewardItem(c, None, "") for c in ("nan", "str", "fine")])
    assert [r.kind for r in got] == ["non_finite", "non_numeric", None]
    assert "str '1.0'" in (got[1].message or "") and got[2].value == 0.5
    with RewardPool(RewardSpec(name=f"{FIX}:raises"), workers=1) as pool:
        got = pool.score_detailed([RewardItem("bad", None, ""), RewardItem("ok", None, "")])
    assert got[0].kind == "exception" and "this reward always fails" in (got[0].message or "")
    assert got[1].value == 1.0


def test_lora_targets_exist_and_gpt2_conv1d_counts_as_linear() -> None:
    from transformers import GPT2Config

    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    assert lora_targets(cfg, "all-linear") == ["c_attn", "c_fc", "c_proj"]
    with pytest.raises(ConfigError, match="--lora-target-modules: q_proj not in the model; its linear layers"):
        lora_targets(cfg, ["q_proj"])
    assert lora_targets(cfg, ["c_attn"]) == ["c_attn"]


def test_context_default_and_check() -> None:
    assert default_max_new_tokens(512, 40) == 472
    assert default_max_new_tokens(32768, 40) == 512
    check_context(512, 40, 3, 472)
    with pytest.raises(ConfigError, match=r"row 3, 40 tokens.*lower --max-new-tokens to at most 472"):
        check_context(512, 40, 3, 473)


def _delivery(rewards: list[float | None], errors_: dict[str, str]):  # -> Delivery
    from bucketrl.wire import Delivery

    comps = [{"token_ids": [1], "logprobs": [-1.0], "reward": r} for r in rewards]
    group = {"prompt_id": "0-0", "prompt_index": 0, "prompt_token_ids": [1], "completions": comps}
    group["reward_errors"] = errors_
    return Delivery.model_validate({"delivery_id": "d", "version": 1, "groups": [group], "worker_id": "g"})


def test_trainer_stops_when_most_completions_have_no_reward() -> None:
    from bucketrl.trainer.settings import TrainerSettings
    from bucketrl.trainer.worker import TrainerWorker

    worker = TrainerWorker(TrainerSettings(max_unscorable_fraction=0.5), echo=lambda _t: None)
    worker._check_rewards([_delivery([1.0, None, 0.0, 1.0], {"exception": "ValueError: x"})])  # 25 %: trains
    with pytest.raises(ConfigError, match=r"could not score 5/8 .*exception: ValueError: x; non_numeric: str"):
        worker._check_rewards([_delivery([None] * 4, {"non_numeric": "str"})])
    never = TrainerWorker(TrainerSettings(max_unscorable_fraction=1.0), echo=lambda _t: None)
    never._check_rewards([_delivery([None] * 4, {"timeout": "t"})])  # 1 = never stop


def test_windows_never_overlap_on_short_runs() -> None:
    assert windows(list(range(10))) == ([0, 1, 2, 3, 4], [5, 6, 7, 8, 9])
    assert windows(list(range(100)))[0] == list(range(20)) and windows(list(range(100)))[1] == list(range(80, 100))
    assert windows([1.0]) == ([1.0], [1.0]) and windows([]) == ([], [])


def test_summary_averages_leave_out_start_up() -> None:
    """The first steps wait for model loads and the generators' first adapter: the means are over the rest."""
    now = time.time()
    w = RunWatcher("http://127.0.0.1:9", "demo", "t")
    metrics = lambda k: {"reward": 0.1, "perf/step_s": 10.0 if k <= 3 else 0.5, "perf/rollout_wait_s": 30.0 * (k == 1)}  # noqa: E731
    w._merge([{"worker_id": "trainer", "role": "trainer", "ts": now + k, "step": k, "metrics": metrics(k)}
              for k in range(1, 21)])  # fmt: skip
    figures = summarize(w, wall_s=1.0)
    assert figures["step_s_mean"] == pytest.approx(0.5) and figures["rollout_wait_s_mean"] == pytest.approx(0.0)
    assert figures["steps"] == 20


def test_summary_shows_unscorable_completions_and_the_first_error_of_each_kind() -> None:
    from rich.console import Console

    from bucketrl.up.report import summary_table
    from bucketrl.wire import RunStatus

    now = time.time()
    note = {"reward_error/non_numeric": "the reward function returned str '1.0', not a number"}
    w = RunWatcher("http://127.0.0.1:9", "demo", "t")
    w._merge([{"worker_id": "trainer", "role": "trainer", "ts": now + k, "step": k,
               "metrics": {"reward": 0.1, "reward/unscorable_frac": 0.25 * k}} for k in range(1, 4)])  # fmt: skip
    w.status = RunStatus.model_validate(
        {
            "run": "demo", "latest_version": 3, "versions": [], "queue": {"groups": 0, "capacity": 64},
            "prompts_inflight": 0, "trainer": {"epoch": 1, "step": 3}, "metrics": {},
            "workers": [{"worker_id": "gen-0", "role": "generator", "last_seen_s": 0.1,
                         "notes": note}],
        }
    )  # fmt: skip
    console = Console(width=160, record=True, force_terminal=False)
    console.print(summary_table(summarize(w, wall_s=1.0)))
    text = console.export_text()
    assert "completions without a reward (mean / worst step)" in text and "50.0% / 75.0%" in text
    assert "first reward error: non_numeric" in text and "str '1.0', not a number" in text


def _push(step: int, reward: float, ts: float) -> dict:
    return {"worker_id": "trainer", "role": "trainer", "ts": ts, "step": step, "metrics": {"reward": reward}}


def test_summary_covers_every_session_of_a_resumed_run(tmp_path: Path) -> None:
    """The first session saw steps 1-30; the proxy's stream only keeps the last pushes, so the second session
    sees 31-50 there: its summary must still be over steps 1-50 (the issue's 319 of 400 steps)."""
    now = time.time()
    first = RunWatcher("http://127.0.0.1:9", "demo", "t")
    first._merge([_push(k, 0.1, now + k) for k in range(1, 31)])
    first.save(tmp_path)
    second = RunWatcher("http://127.0.0.1:9", "demo", "t")
    second.load_history(tmp_path)
    second._merge([_push(k, 0.9, now + 100 + k) for k in range(25, 51)])  # repeats 25-30 after a resume
    figures = summarize(second, wall_s=1.0)
    assert figures["steps"] == 50
    assert figures["reward_first20"] == pytest.approx(0.1)  # the run's own first steps, not the session's
    assert figures["reward_last20"] == pytest.approx(0.9)


@pytest.mark.parametrize("command", ["trainer", "generator"])
def test_a_worker_without_a_proxy_url_says_so(command: str, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "BUCKETRL_PROXY_URL"}
    env.update({"BUCKETRL_OUTAGE_BUDGET_S": "1", "BUCKETRL_RUN_SPEC": ""})
    proc = subprocess.Popen(
        [sys.executable, "-m", "bucketrl.cli", command],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        first = proc.stdout.readline() if proc.stdout else ""
    finally:
        proc.kill()
        proc.wait(30)
    assert f"bucketrl {command}: BUCKETRL_PROXY_URL is unset" in first and "trying http://127.0.0.1:8000" in first


def test_status_without_options_finds_the_last_up_here_or_says_which_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from bucketrl.cli import app
    from bucketrl.status_cli import last_up_dir, record_last_up

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("BUCKETRL_PROXY_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    out = CliRunner().invoke(app, ["status"])
    assert out.exit_code == 2 and "pass --dir <run directory>" in out.output
    run_dir = tmp_path / "runs" / "demo"
    run_dir.mkdir(parents=True)
    (run_dir / "endpoint.json").write_text(json.dumps({"proxy_url": "http://127.0.0.1:9", "run": "demo"}))
    (run_dir / "tokens").write_text("viewer:v\n")
    (run_dir / "stopped.json").write_text(json.dumps({"service": "gen-0", "reason": "--reward x: no callable"}))
    record_last_up(run_dir)
    assert last_up_dir() == run_dir
    out = CliRunner().invoke(app, ["status"])
    assert out.exit_code == 1, out.output
    assert "gen-0 stopped on a configuration error: --reward x: no callable" in out.output
    assert "http://127.0.0.1:9" in out.output


def test_a_resume_without_options_repeats_the_first_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`bucketrl up --dir D` (the printed resume command) runs with D's saved options, not the demo's (a
    custom-dataset run resumed as the toy task used to fail on the immutable spec)."""
    from bucketrl.up.config import UpConfig, load_saved_options, save_options

    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"prompt": "p", "answer": "a"}\n')
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_options(UpConfig(dir=run_dir, dataset="d.jsonl", reward="exact", max_steps=7, reward_kwargs={"strip": True}))
    saved = load_saved_options(None, run_dir)
    assert saved["dataset"] == str(tmp_path / "d.jsonl")  # absolute: a resume from elsewhere finds it
    assert saved["reward"] == "exact" and saved["max_steps"] == 7 and saved["reward_kwargs"] == {"strip": True}
    resumed = UpConfig(**{**saved, "dir": run_dir, "max_steps": 9})  # an option given overrides
    assert resumed.max_steps == 9 and resumed.upload_path == tmp_path / "d.jsonl"


def test_run_spec_file_with_options_over_it(tmp_path: Path) -> None:
    from bucketrl.up.config import UpConfig, build_run_spec

    data = tmp_path / "d.jsonl"
    data.write_text('{"q": "p", "a": "1"}\n')
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(
        json.dumps(
            {
                "base_model": "Qwen/Qwen2.5-0.5B-Instruct",
                "vocab_size": 151936,
                "group_size": 4,
                "lora": {"r": 8, "alpha": 16},
                "sampling": {"max_new_tokens": 64, "temperature": 0.9},
                "reward": {"name": "regex", "kwargs": {"pattern": "\\d+"}},
                "dataset": {"uri": str(data), "prompt_field": "q", "answer_field": "a"},
                "loss": {"objective": "decoupled"},
            }
        )
    )
    spec = build_run_spec(UpConfig(dir=tmp_path, run_spec=spec_file, group_size=8, answer_field="b"), None)
    assert spec["base_model"] == "Qwen/Qwen2.5-0.5B-Instruct" and spec["vocab_size"] == 151936
    assert spec["group_size"] == 8  # the option wins
    assert spec["lora"]["r"] == 8 and spec["lora"]["target_modules"] == "all-linear"  # merged with the defaults
    assert spec["sampling"] == {"temperature": 0.9, "top_p": 1.0, "top_k": -1, "max_new_tokens": 64}
    assert spec["reward"] == {"name": "regex", "kwargs": {"pattern": "\\d+"}}
    # The file's local JSONL is uploaded like --dataset's: the spec names the run's copy.
    assert spec["dataset"]["uri"] == "bucket:dataset.jsonl" and spec["dataset"]["prompt_field"] == "q"
    assert spec["dataset"]["answer_field"] == "b" and spec["loss"]["objective"] == "decoupled"
    with pytest.raises(ValueError, match=r"--run-spec .*not JSON"):
        (tmp_path / "bad.json").write_text("{")
        build_run_spec(UpConfig(dir=tmp_path, run_spec=tmp_path / "bad.json"), None)


def test_gpt2_trains_lora_on_its_conv1d_layers(tmp_path: Path, tiny_model_dir: Path) -> None:
    """GPT-2 has no nn.Linear but the head: `all-linear` used to find nothing. Its Conv1D layers get LoRA now,
    and the adapter the trainer writes loads in plain PEFT."""
    from peft import PeftModel
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from bucketrl.trainer.model import PolicyModel
    from bucketrl.wire import RunSpec

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = {"bos_token_id": tok.eos_token_id, "eos_token_id": tok.eos_token_id}
    GPT2LMHeadModel(
        GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=1, n_head=2, **ids)
    ).save_pretrained(tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    spec = RunSpec.model_validate(
        {
            "base_model": str(tmp_path / "gpt2"),
            "reward": {"name": "toy"},
            "dataset": {"uri": "toy:digits", "size": 8},
            "vocab_size": len(tok),
        }
    )
    snap = PolicyModel(spec).adapter_snapshot()
    assert json.loads(snap.config_json)["target_modules"] == ["c_attn", "c_fc", "c_proj"]
    PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2"), str(snap.write(tmp_path / "ad")))


def test_line_mode_shows_reward_errors_before_the_first_step() -> None:
    """--no-live: a reward that hangs may keep the first step minutes away; its first error shows at step 0."""
    from rich.console import Console

    from bucketrl.up.launcher import _print_line
    from bucketrl.wire import RunStatus

    w = RunWatcher("http://127.0.0.1:9", "demo", "t")
    w.status = RunStatus.model_validate(
        {
            "run": "demo",
            "latest_version": 1,
            "versions": [],
            "queue": {"groups": 0, "capacity": 64},
            "prompts_inflight": 8,
            "workers": [
                {"worker_id": "gen-0", "role": "generator", "last_seen_s": 0.1, "phase": "generating",
                 "notes": {"reward_error/timeout": "the reward function ran past 10s (BUCKETRL_REWARD_TIMEOUT_S)"}},
            ],
            "trainer": {"epoch": 1, "step": 0},
            "metrics": {},
        }
    )  # fmt: skip
    console = Console(width=80, record=True, force_terminal=False)
    _print_line(console, w, 10)
    text = console.export_text()
    assert "step 0/10" in text and "gen-0: generating" in text
    assert "REWARD ERRORS (timeout: the reward function ran past 10s" in text


def test_live_view_shows_phases_failing_rewards_and_an_unbroken_address() -> None:
    from rich.console import Console

    from bucketrl.up.live import render
    from bucketrl.wire import RunStatus

    w = RunWatcher("http://127.0.0.1:9", "demo", "t")
    w.last_error = "404 unknown_run: unknown run 'demo'"
    assert w.waiting_for() == "the trainer is creating the run"  # a normal start is not an alarm
    w.status = RunStatus.model_validate(
        {
            "run": "demo",
            "latest_version": 3,
            "versions": [],
            "queue": {"groups": 0, "capacity": 64},
            "prompts_inflight": 0,
            "workers": [
                {"worker_id": "gen-0", "role": "generator", "last_seen_s": 0.1, "phase": "generating",
                 "notes": {"reward_error/exception": "ValueError: cannot parse"}},
                {"worker_id": "trainer", "role": "trainer", "last_seen_s": 0.1, "phase": "training"},
            ],
            "trainer": {"epoch": 1, "step": 2},
            "metrics": {"trainer": {"reward/unscorable_frac": 0.75}},
        }
    )  # fmt: skip
    token = "vie-" + "x" * 60
    url = f"http://127.0.0.1:41234/ui?run=demo#token={token}"
    console = Console(width=80, record=True, force_terminal=False)
    services = {"gen-0": "running pid 1", "trainer": "running pid 2"}
    console.print(render(w, run="demo", max_steps=10, started=time.monotonic(), dashboard=url, services=services))
    text = console.export_text()
    assert "generating" in text and "training" in text
    assert "75%" in text and "ValueError: cannot" in text  # (wrapped in 80 columns)
    # No token cut in pieces: the panel (cropped to the terminal) shows the address without it.
    assert token[:8] not in text and "dashboard http://127.0.0.1:41234/ui?run=demo (link with token: above)" in text
