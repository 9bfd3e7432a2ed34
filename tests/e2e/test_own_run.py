"""A user's own run, end to end, as they type it: `bucketrl up` on their model, chat dataset and reward module,
then `bucketrl export`; a reward that fails stops the run loudly; a SIGKILLed `up` leaves no process behind.

The model is not the built-in one: a small random-init Llama saved with a byte-level BPE tokenizer trained here
offline (the `tokenizers` library) and a ChatML chat template.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.chaos import alive

pytestmark = pytest.mark.slow

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

REWARD_MODULE = '''
def score(completion, answer, *, prompt, weight=1.0):
    """Graded: the share of the completion's characters that are digits (a random model can learn it)."""
    text = completion.strip()
    return weight * sum(c.isdigit() for c in text) / max(1, len(text))


def strict(completion, answer, *, prompt):
    """Scores only the exact answer; anything else is an error (the preflight call passes the answer)."""
    if completion.strip() != (answer or "").strip():
        raise ValueError(f"cannot parse {completion[:20]!r}")
    return 1.0


def hangs(completion, answer, *, prompt):
    """Scores the exact answer (the preflight's call); hangs on anything else, past every deadline."""
    if completion.strip() == (answer or "").strip():
        return 1.0
    import time

    time.sleep(3600)
'''


def _user_dir(tmp_path: Path) -> Path:
    """What a user has: a model directory, a chat-format JSONL dataset and a reward module."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    work = tmp_path / "user"
    work.mkdir()
    rows = []
    for i in range(24):
        a, b = i % 7, (i * 3) % 5
        rows.append(
            {
                "messages": [
                    {"role": "system", "content": "Answer with digits only."},
                    {"role": "user", "content": f"What is {a} plus {b}?"},
                    {"role": "assistant", "content": str(a + b)},
                ]
            }
        )
    (work / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "myreward.py").write_text(REWARD_MODULE)

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [m["content"] for r in rows for m in r["messages"]] + ["0123456789 plus minus answer digits"] * 4
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    model_dir = work / "my-llama"
    fast.save_pretrained(model_dir)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 64 (what vLLM's kernels support)
        num_key_value_heads=1,
        max_position_embeddings=256,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    import torch

    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    return work


def _cli(
    work: Path, *args: str, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bucketrl.cli", *args],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "XDG_STATE_HOME": str(work / ".state"), **(env or {})},
    )


def test_own_model_chat_dataset_and_reward_train_and_export(tmp_path: Path) -> None:
    work = _user_dir(tmp_path)
    run = _cli(
        work,
        "up",
        "--dir", "runs/mine",
        "--no-live",
        "--model", "my-llama",
        "--dataset", "chat.jsonl",
        "--reward", "myreward:score",
        "--reward-kwargs", '{"weight": 1.0}',
        "--lora-target-modules", "q_proj,v_proj",
        "--max-steps", "4",
        "--group-size", "4",
        "--groups-per-step", "2",
        "--max-new-tokens", "8",
        "--generators", "1",
        "--lr", "3e-3",
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "chat messages" in out  # the preflight saw the chat format
    # Piped (80 columns): the dashboard address and its token stay on one line, whole (copyable).
    viewer = dict(line.split(":", 1) for line in (work / "runs/mine/tokens").read_text().split())["viewer"]
    assert re.search(rf"dashboard\s+http://127\.0\.0\.1:\d+/ui\?run=demo#token={re.escape(viewer)}\n", out), out[:3000]
    summary = json.loads((work / "runs/mine/summary.json").read_text())
    assert summary["steps"] == 4, summary
    assert "final adapter: v" in out and "bucketrl export" in out
    spec = json.loads((work / "runs/mine/run_spec.json").read_text())
    assert spec["dataset"]["uri"] == "bucket:dataset.jsonl"  # uploaded: a generator elsewhere reads the run's copy
    assert spec["lora"]["target_modules"] == ["q_proj", "v_proj"]

    # `bucketrl status` with no options finds this run directory (the proxy is gone: it says so, exit 1).
    status = _cli(work, "status")
    endpoint = json.loads((work / "runs/mine/endpoint.json").read_text())
    assert status.returncode == 1 and endpoint["proxy_url"] in status.stderr, status.stderr

    exported = _cli(work, "export", "adapter-out")
    assert exported.returncode == 0, exported.stderr
    version = summary["latest_version"]
    assert f"wrote adapter v{version}" in exported.stdout
    _logprobs_match_the_trainer(work, spec, work / "adapter-out")


def _logprobs_match_the_trainer(work: Path, spec_dict: dict, adapter: Path) -> None:
    """The exported folder in plain PEFT computes the logprobs the trainer computes from its last checkpoint."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bucketrl.export import adapter_bytes_from_bucket
    from bucketrl.storage import open_store
    from bucketrl.storage.dirs import iter_bundle, list_dirs
    from bucketrl.trainer.batching import collate, group_samples
    from bucketrl.trainer.checkpoint import restore_checkpoint
    from bucketrl.trainer.learner import Learner
    from bucketrl.trainer.settings import TrainerSettings
    from bucketrl.wire import RunSpec
    from bucketrl.wire.rollouts import Completion, RolloutGroup

    assert spec_dict["base_model"] == str((work / "my-llama").resolve())  # a local model by its absolute path
    spec_dict["dataset"] = {**spec_dict["dataset"], "size": spec_dict["dataset"].get("size", 24)}
    spec = RunSpec.model_validate(spec_dict)
    bucket = f"file://{work / 'runs/mine/bucket'}"
    store = open_store(bucket)
    last = list_dirs(store, "runs/demo/checkpoints")[-1]
    learner = Learner(spec, TrainerSettings(device="cpu", lr=1e-3))
    restore_checkpoint(learner, b"".join(iter_bundle(store, f"runs/demo/checkpoints/{last}")))
    # The adapter is not the initial one: training moved it (LoRA B starts at zero).
    _, tar = adapter_bytes_from_bucket(bucket, "demo", None)
    assert tar

    tok = AutoTokenizer.from_pretrained(work / "my-llama")
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 3 plus 4?"}], add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    completion = tok.encode("7<|im_end|>", add_special_tokens=False)
    group = RolloutGroup(
        prompt_id="0-0",
        prompt_index=0,
        prompt_token_ids=prompt,
        completions=[Completion(token_ids=completion, logprobs=[-1.0] * len(completion), reward=0.0)],
    )
    mb = collate(group_samples(group, [0.0], [True], version=1, worker_id="w", eos_token_ids=set()), 0)
    with torch.no_grad():
        trainer_lp = learner.policy.token_logprobs(mb)[0][0, : len(completion)]
        base = AutoModelForCausalLM.from_pretrained(work / "my-llama", dtype=torch.float32)
        peft = PeftModel.from_pretrained(base, str(adapter)).eval()
        ids = torch.tensor([prompt + completion])
        logits = peft(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        peft_lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        lora_b = [p for n, p in peft.named_parameters() if "lora_B" in n]
    assert any(float(p.abs().max()) > 0 for p in lora_b), "the exported adapter is the untrained one"
    assert torch.allclose(trainer_lp, peft_lp, atol=1e-4), (trainer_lp, peft_lp)


def _reward_run_dir(work: Path) -> Path:
    """``work`` holding REWARD_MODULE and an 8-row dataset whose answer the model never writes: each reward passes
    the preflight (it is called on the reference answer) and meets its failure only on the model's completions."""
    (work / "myreward.py").write_text(REWARD_MODULE)
    (work / "data.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": "9" * 30}) + "\n" for i in range(8))
    )
    return work


def test_a_reward_that_fails_stops_the_run_with_its_message(tmp_path: Path) -> None:
    """The reward passes the preflight (it scores the reference answer) but raises on what the model writes:
    the trainer stops the run (exit 2) with the reward's message; `up` prints it and stops everything."""
    work = _reward_run_dir(tmp_path)
    t0 = time.monotonic()
    run = _cli(
        work,
        "up", "--dir", "runs/bad", "--no-live", "--dataset", "data.jsonl", "--reward", "myreward:strict",
        "--max-new-tokens", "4", "--generators", "1", "--group-size", "4", "--groups-per-step", "2",
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 2, out[-4000:]
    assert "configuration error" in out and "could not score" in out and "ValueError: cannot parse" in out, out[-3000:]
    assert "BUCKETRL_MAX_UNSCORABLE_FRACTION" in out
    assert "resume:" not in out and "after fixing it: bucketrl up --dir" in out  # a rerun as is fails the same way
    print(f"stopped after {time.monotonic() - t0:.0f}s")
    pids = json.loads((work / "runs/bad/services.json").read_text())
    assert not [n for n, pid in pids.items() if alive(pid)]
    # `bucketrl status` (no options: the last `up` from here) says why the run stopped.
    status = _cli(work, "status")
    assert "trainer stopped on a configuration error" in status.stderr, status.stderr


def test_a_reward_that_hangs_on_everything_stops_the_run_within_a_minute(tmp_path: Path) -> None:
    """A reward that passes the preflight but hangs on every completion: the run stops (exit 2) naming the timeout,
    within ~60 s of `up`'s start. It used to take one deadline per completion over 2 scoring processes: the first
    step's 64 completions, over 5 minutes of a silent-looking run at the default 10 s; now a batch costs its first
    2 rounds. The deadline here is 4 s (the user's setting, BUCKETRL_REWARD_TIMEOUT_S): what is tested is how many
    deadlines a batch waits out, and one per completion (64 x 4 s / 2 = 128 s) is still far past the bound."""
    work = _reward_run_dir(tmp_path)
    t0 = time.monotonic()
    run = _cli(
        work,
        "up", "--dir", "runs/hang", "--no-live", "--dataset", "data.jsonl", "--reward", "myreward:hangs",
        "--max-new-tokens", "4", "--generators", "1",
        timeout=240, env={"BUCKETRL_REWARD_TIMEOUT_S": "4"},
    )  # fmt: skip
    seconds = time.monotonic() - t0
    out = run.stdout + run.stderr
    assert run.returncode == 2, out[-4000:]
    assert "could not score" in out and "ran past 4s (BUCKETRL_REWARD_TIMEOUT_S)" in out, out[-3000:]
    print(f"stopped after {seconds:.0f}s")
    assert seconds < 90, f"took {seconds:.0f}s"  # start-up, then 2 rounds of 4 s deadlines
    pids = json.loads((work / "runs/hang/services.json").read_text())
    assert not [n for n, pid in pids.items() if alive(pid)]


def test_sigkill_of_up_leaves_no_process(tmp_path: Path) -> None:
    """Children die with `up` however it goes: here SIGKILL, which `up` cannot handle (the parent-death signal)."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bucketrl.cli", "up", "--dir", str(run_dir), "--no-live", "--generators", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "XDG_STATE_HOME": str(tmp_path / ".state")},
    )
    try:
        deadline = time.monotonic() + 300
        pids: dict[str, int] = {}
        while time.monotonic() < deadline and len(pids) < 4:
            time.sleep(1)
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                pids = json.loads((run_dir / "services.json").read_text())
        assert len(pids) == 4, pids
        time.sleep(3)  # all started, the workers loading
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        t0 = time.monotonic()
        while time.monotonic() < t0 + 60 and any(alive(p) for p in pids.values()):
            time.sleep(0.2)
        assert not [n for n, p in pids.items() if alive(p)], "services outlived a SIGKILLed `bucketrl up`"
        print(f"all services gone {time.monotonic() - t0:.1f}s after the SIGKILL")
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in json.loads((run_dir / "services.json").read_text()).values() if run_dir.exists() else []:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_closed_terminal_stops_every_service_within_seconds(tmp_path: Path) -> None:
    """SIGHUP (the terminal closed) in the middle of training: `up` stops as for Ctrl-C. Every worker honours the
    SIGTERM it gets within seconds (the trainer finishes its step and checkpoints, the generator submits or
    releases its batch), nothing is SIGKILLed, nothing is left running. (The issue: the trainer ignored SIGTERM
    for 25 s and a closed terminal left services spinning.)"""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bucketrl.cli", "up", "--dir", str(run_dir), "--no-live", "--generators", "1",
         "--max-steps", "500"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "XDG_STATE_HOME": str(tmp_path / ".state")},
    )  # fmt: skip
    audit = run_dir / "logs" / "trainer-audit.jsonl"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            steps = audit.read_text().count('"event": "step"') if audit.exists() else 0
            if steps >= 3:
                break
            time.sleep(0.5)
        assert proc.poll() is None and steps >= 3, "the run did not reach step 3"
        pids = json.loads((run_dir / "services.json").read_text())
        t0 = time.monotonic()
        proc.send_signal(signal.SIGHUP)
        while time.monotonic() < t0 + 90 and any(alive(p) for p in pids.values()):
            time.sleep(0.1)
        gone_s = time.monotonic() - t0
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in json.loads((run_dir / "services.json").read_text()).values() if run_dir.exists() else []:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    print(f"every service gone {gone_s:.1f}s after the SIGHUP")
    assert proc.returncode == 0, out[-3000:]
    assert not [n for n, p in pids.items() if alive(p)], out[-3000:]
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "stopped at step" in trainer_log, trainer_log[-3000:]  # a clean stop, checkpointed: not a SIGKILL
    # Workers get 60 s before a SIGKILL: well under that, every one of them stopped on its own.
    assert gone_s < 30, f"services took {gone_s:.1f}s to stop"
    assert "summary" in out


def test_a_generator_configuration_error_stops_up_at_once(tmp_path: Path) -> None:
    """A worker exiting 2 (here a generator whose reward does not import: `up`'s own preflight is off, as for a
    mistake only a worker can see) stops `up` at once with the worker's one-line reason; nothing restarts."""
    from rich.console import Console

    from bucketrl.up.config import UpConfig
    from bucketrl.up.launcher import run_up

    cfg = UpConfig(dir=tmp_path / "run", reward="nosuchmod:score", preflight=False, generators=1, max_steps=50)
    console = Console(record=True, width=80, force_terminal=False)
    t0 = time.monotonic()
    code = run_up(cfg, console=console, live=False)
    text = console.export_text()
    assert code == 2, text[-3000:]
    assert "gen-0 stopped on a configuration error: reward.name (run spec): " in text, text[-3000:]
    assert "cannot import 'nosuchmod'" in text
    assert "resume:" not in text
    print(f"stopped after {time.monotonic() - t0:.0f}s")
    stopped = json.loads((tmp_path / "run" / "stopped.json").read_text())
    assert stopped["service"] == "gen-0" and "nosuchmod" in stopped["reason"]
    log = (tmp_path / "run" / "logs" / "gen-0.log").read_text()
    assert log.count("start gen-0") == 1  # not restarted
    pids = json.loads((tmp_path / "run" / "services.json").read_text())
    assert not [n for n, pid in pids.items() if alive(pid)]
