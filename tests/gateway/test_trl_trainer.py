"""TRL 1.16's real ``AsyncGRPOTrainer`` trains on CPU through ``bucketrl gateway`` (a real proxy, Redis, bucket
and generator process): its weight syncs become committed versions that the generator serves, and its rollouts are
the generator's completions. Only TRL's two CUDA-only calls are replaced (``tests/gateway/trl_cpu.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file
from trl.experimental.async_grpo import AsyncGRPOTrainer

from bucketrl.wire import SamplingSpec
from tests.gateway.support import running_gateway
from tests.gateway.trl_cpu import cpu_varlen_attention, patch_trl_for_cpu, trl_trainer
from tests.generator.helpers import run_spec, teacher_forced_logprobs
from tests.generator.worker_support import start_generator
from tests.proxy.harness import ProxyHarness, running
from tests.support.services import RedisServer

STEPS = 2


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


@pytest.mark.slow  # ~1.5 min on a loaded 2-core machine: TRL spawns its rollout process, a generator starts
def test_async_grpo_trainer_through_the_gateway(
    redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    patch_trl_for_cpu(monkeypatch.setattr)
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as proxy:
        spec = run_spec(tiny_model_dir, max_staleness=2)
        proxy.client("trl", "trainer").put_run(spec)
        gen = start_generator(proxy, "trl", tmp_path / "gen.log", serve_completion_jobs=1, worker_id="gen-0", seed=0)
        try:
            with running_gateway(proxy, "trl", tmp_path) as url:
                trainer = trl_trainer(tiny_model_dir, url, tmp_path / "out", steps=STEPS)
                trainer.train()
                served_by_the_pool(proxy, url, tiny_model_dir, tmp_path / "out", trainer)
        finally:
            gen.terminate()
            gen.wait(30)


def served_by_the_pool(proxy: ProxyHarness, url: str, model_dir: Path, out: Path, trainer: AsyncGRPOTrainer) -> None:
    history = trainer.state.log_history
    syncs = [h["perf/weight_sync_s"] for h in history if "perf/weight_sync_s" in h]
    assert len(syncs) >= 1 and all(s > 0 for s in syncs), history
    # TRL trained on the pool's completions: rollouts with tokens and rewards reached the loss.
    assert any(h.get("completions/mean_length", 0) > 0 for h in history), history
    # v1 at train begin, one more after each step: every sync is a committed version in the bucket.
    last = STEPS + 1
    latest = proxy.client("trl", "generator").wait_for_version(after=0, wait_s=0)
    assert latest is not None and latest.version == last
    adapter = out / ".vllm_lora" / f"trl-policy-v{last}"
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    assert any(t.abs().sum() > 0 for n, t in weights.items() if "lora_B" in n)  # trained away from PEFT's B=0
    # The generator serves the trained version: its behaviour logprobs are those of TRL's saved adapter.
    payload = {"model": f"trl-policy-v{last}", "prompt": [4, 40, 5, 43], "max_tokens": 6, "temperature": 1.0}
    payload |= {"return_token_ids": True, "logprobs": 0}  # what TRL's rollout worker sends and reads
    choice = requests.post(f"{url}/v1/completions", json=payload, timeout=120).json()["choices"][0]
    ref = teacher_forced_logprobs(model_dir, adapter, [4, 40, 5, 43], choice["token_ids"], SamplingSpec())
    got = choice["logprobs"]["token_logprobs"]
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) < 1e-3
    base = teacher_forced_logprobs(
        model_dir, out / ".vllm_lora" / "trl-policy-v1", [4, 40, 5, 43], choice["token_ids"], SamplingSpec()
    )
    assert max(abs(a - b) for a, b in zip(base, got, strict=True)) > 1e-3  # and it is not the untrained policy
