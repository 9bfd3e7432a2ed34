"""TRL 1.16's real ``AsyncGRPOTrainer`` trains on CPU through ``bucketrl up --external-trainer --gateway-port 0``
(Redis, the proxy, a ``file://`` bucket, two generator processes and the gateway, as a user starts them): its
weight syncs become committed versions in the bucket that the generators serve, its rollouts are the generators'
completions, a generator SIGKILLed mid-run does not stop it, and the toy reward rises clear of its noise within
24 steps. Only TRL's two CUDA-only calls are replaced (``tests/gateway/trl_cpu.py``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback
from trl.experimental.async_grpo import AsyncGRPOTrainer

from bucketrl.client import ProxyClient
from bucketrl.wire import SamplingSpec
from tests.gateway.trl_cpu import cpu_varlen_attention, patch_trl_for_cpu, trl_trainer
from tests.generator.helpers import teacher_forced_logprobs

STEPS = 32
# 4 groups of 8 completions of 8 tokens a step (two steps' worth in flight): 256 tokens, so one step's mean reward
# (the even-id share) has a standard deviation of about 0.038 when nothing learns (0.036 to 0.040 in three runs with
# learning_rate=0; a coin flip per token gives 0.5 / 16 = 0.031). Learning lifts it from about 0.47 to about 0.63
# over the last steps (the cap for this model is about 0.67: trl_cpu.even_ids_reward). bench/trl_reward.py runs
# the same settings.
# Temperature 0.4: the cap scales with the logit range over the temperature, and the even half of the byte-level
# BPE's 320 tokens has a mean embedding about sqrt(5) times shorter than the even half of the 64 tokens the tiny
# model had when these figures were measured (at temperature 1 it then rose only 0.505 -> 0.529 in 24 steps).
LEARNS = {
    "group": 8,
    "prompts_per_step": 4,
    "completion_tokens": 8,
    "learning_rate": 5e-2,
    "max_inflight": 64,
    "temperature": 0.4,
}
# The mean reward of the last 12 steps beats that of the first 4 by MARGIN: 2.7 standard deviations of that
# difference when nothing learns (0.038 * sqrt(1/4 + 1/12) = 0.022), under a 0.5% chance to pass by luck. With
# learning_rate=0 the test fails there (docs/trl.md). 24 steps with the last 8 once fell short on a loaded fresh-clone
# run (0.514 -> 0.569): the BPE model learns more slowly, and 8 more steps give it room.
FIRST, LAST, MARGIN = 4, 12, 0.06

REPO = Path(__file__).resolve().parents[2]


def test_cpu_tree_attention_is_each_samples_causal_attention() -> None:
    """The stand-in for FA3: two samples sharing a 3-token prefix, packed as TRL packs them (segment 0: the prefix;
    segments 1, 2: each branch, whose key path is prefix + branch), give each sample's dense causal attention."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    q, k, v = (torch.randn(3 + 2 + 3, h, dim) for h in (heads, kv_heads, kv_heads))
    kv_index = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7])
    out = cpu_varlen_attention(
        q, k[kv_index], v[kv_index], torch.tensor([0, 3, 5, 8]), torch.tensor([0, 3, 8, 14]), 3, 6, softmax_scale=0.5
    )
    for sample in ([0, 1, 2, 3, 4], [0, 1, 2, 5, 6, 7]):
        idx = torch.tensor(sample)
        qs, ks, vs = (
            q[idx].transpose(0, 1),
            k[idx].repeat_interleave(2, 1).transpose(0, 1),
            v[idx].repeat_interleave(2, 1).transpose(0, 1),
        )
        dense = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.5).transpose(0, 1)
        assert torch.allclose(out[idx], dense, atol=1e-5)


@pytest.mark.slow  # 134-170 s on a shared 2-core machine: up's preflight, two generators, TRL's 24 steps
def test_async_grpo_trainer_through_bucketrl_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    patch_trl_for_cpu(monkeypatch.setattr)
    # TRL's process shares two cores with two generators, the proxy, Redis and the gateway: with torch's default
    # threads its forward and backward over ~300 tokens took 3 to 14 s a step (oversubscribed), with one 0.25 to 0.6 s.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_through_up(tmp_path)
    finally:
        torch.set_num_threads(threads)


def train_through_up(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with bucketrl_up(run_dir) as url:
        model_dir = run_dir / "model"  # up's built-in tiny model: the run's base_model, so TRL trains the same one
        trainer = trl_trainer(model_dir, url, tmp_path / "out", steps=STEPS, **LEARNS)
        killer = KillAGenerator(run_dir, after_step=1)
        trainer.add_callback(killer)
        trainer.train()
        reward_rose(trainer.state.log_history)
        assert killer.killed is not None, "no generator was killed mid-run"
        restarted = json.loads((run_dir / "services.json").read_text())
        assert restarted[killer.killed[0]] != killer.killed[1]  # up started the killed generator again
        served_by_the_pool(run_dir, url, model_dir, tmp_path / "out", trainer)


@contextmanager
def bucketrl_up(run_dir: Path, generators: int = 2) -> Iterator[str]:
    """``bucketrl up --external-trainer --gateway-port 0 --generators N`` as a subprocess; yields the gateway URL it
    printed (and wrote to endpoint.json); SIGTERM at the end, which must stop it cleanly (bench/trl_reward.py too)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUCKETRL_")}
    # A SIGKILLed generator's leased jobs go to the other one after this (60 s by default: too long for CI).
    env["BUCKETRL_COMPLETION_JOB_TTL_S"] = "15"
    cmd = [sys.executable, "-m", "bucketrl.cli", "up", "--dir", str(run_dir), "--no-live"]
    cmd += ["--external-trainer", "--gateway-port", "0", "--generators", str(generators)]
    log = run_dir.parent / "up.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 180
        while "  gateway    http" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        printed = log.read_text().split("  gateway    ", 1)[1].split()[0]
        assert printed == json.loads((run_dir / "endpoint.json").read_text())["gateway"]["url"]
        yield printed
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


class KillAGenerator(TrainerCallback):
    """SIGKILLs gen-0 (what an OOM kill looks like) once TRL has finished ``after_step``; records (name, pid)."""

    def __init__(self, run_dir: Path, after_step: int) -> None:
        self.run_dir, self.after_step = run_dir, after_step
        self.killed: tuple[str, int] | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.after_step and self.killed is None:
            pid = int(json.loads((self.run_dir / "services.json").read_text())["gen-0"])
            os.kill(pid, signal.SIGKILL)
            self.killed = ("gen-0", pid)


def reward_rose(history: list[dict[str, Any]]) -> None:
    rewards = [h["reward"] for h in history if "reward" in h]
    print("REWARDS", [round(r, 3) for r in rewards])
    assert len(rewards) == STEPS, history
    first, last = sum(rewards[:FIRST]) / FIRST, sum(rewards[-LAST:]) / LAST
    assert last - first > MARGIN, (first, last, rewards)


def served_by_the_pool(run_dir: Path, url: str, model_dir: Path, out: Path, trainer: AsyncGRPOTrainer) -> None:
    history = trainer.state.log_history
    print("HISTORY", [{k: v for k, v in h.items() if "reward" in k or k == "step"} for h in history])
    assert trainer.state.global_step == STEPS, history  # the kill did not stop TRL
    syncs = [h["perf/weight_sync_s"] for h in history if "perf/weight_sync_s" in h]
    assert len(syncs) >= 1 and all(s > 0 for s in syncs), history
    # TRL trained on the pool's completions: rollouts with tokens and rewards reached the loss.
    assert any(h.get("completions/mean_length", 0) > 0 for h in history), history
    # v1 at train begin, one more after each step: every sync is a committed version in the bucket.
    last = STEPS + 1
    tokens = dict(line.split(":", 1) for line in (run_dir / "tokens").read_text().split())
    proxy_url = json.loads((run_dir / "endpoint.json").read_text())["proxy_url"]
    with ProxyClient(proxy_url, "demo", tokens["generator"]) as client:
        latest = client.wait_for_version(after=0, wait_s=0)
    assert latest is not None and latest.version == last
    # The garbage collector keeps the versions inside the staleness window and those the gateway leases for TRL.
    adapters = run_dir / "bucket" / "runs" / "demo" / "adapters"
    kept = sorted(int(p.name[1:]) for p in adapters.iterdir() if p.name.startswith("v"))
    assert kept[-1] == last and last - 1 in kept, kept
    adapter = out / ".vllm_lora" / f"trl-policy-v{last}"
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    assert any(t.abs().sum() > 0 for n, t in weights.items() if "lora_B" in n)  # trained away from PEFT's B=0
    # The pool serves the trained version: its behaviour logprobs are those of TRL's saved adapter.
    payload = {"model": f"trl-policy-v{last}", "prompt": [4, 40, 5, 43], "max_tokens": 6, "temperature": 1.0}
    payload |= {"return_token_ids": True, "logprobs": 0}  # what TRL's rollout worker sends and reads
    choice = requests.post(f"{url}/v1/completions", json=payload, timeout=120).json()["choices"][0]
    ref = teacher_forced_logprobs(model_dir, adapter, [4, 40, 5, 43], choice["token_ids"], SamplingSpec())
    got = choice["logprobs"]["token_logprobs"]
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) < 1e-3
    # And it is not the untrained policy (PEFT's B=0 adapter: the base model).
    untrained = untrained_adapter(model_dir, out / "untrained")
    base = teacher_forced_logprobs(model_dir, untrained, [4, 40, 5, 43], choice["token_ids"], SamplingSpec())
    assert max(abs(a - b) for a, b in zip(base, got, strict=True)) > 1e-3


def untrained_adapter(model_dir: Path, out: Path) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.generator.helpers import RANK

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules="all-linear")).save_pretrained(out)
    return out
