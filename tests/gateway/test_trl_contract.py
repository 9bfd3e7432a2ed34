"""TRL's own ``VLLMClient`` (trl 1.16.0, the ``trl`` extra) against ``bucketrl gateway`` on a real proxy and Redis.

If a TRL upgrade changes the HTTP contract the gateway speaks (``bucketrl/gateway/__init__.py``), this fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
from accelerate import PartialState
from trl.experimental.async_grpo.vllm_client import VLLMClient

from bucketrl.wire import SamplingSpec
from tests.gateway.support import running_gateway
from tests.generator.helpers import RANK, make_adapter, run_spec, teacher_forced_logprobs
from tests.generator.worker_support import start_generator
from tests.proxy.harness import ProxyHarness, running
from tests.support.services import RedisServer


def vllm_client(url: str) -> VLLMClient:
    PartialState()  # TRL logs through accelerate, which needs its state (the trainer makes one)
    return VLLMClient(url, server_timeout=30)


@pytest.fixture()
def proxy(redis_server: RedisServer, tmp_path: Path) -> ProxyHarness:
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as h:
        yield h


def completions_on_a_real_generator(proxy: ProxyHarness, url: str, model_dir: Path, adapter: Path, tmp: Path) -> None:
    """A generator serving completion jobs (a real process, transformers engine): TRL's exact payload, answered
    with the adapter's exact behaviour logprobs; and vLLM's batch form (a list of prompts, n > 1) in order."""
    gen = start_generator(proxy, "trl", tmp / "gen.log", serve_completion_jobs=1, worker_id="gen-0", seed=0)
    try:
        trl_payload = {
            "model": "trl-policy-v1", "prompt": [3, 4, 5], "max_tokens": 6, "temperature": 1.0, "top_p": 1.0,
            "top_k": 0, "repetition_penalty": 1.0, "n": 1, "return_token_ids": True, "logprobs": 0, "seed": 7,
        }  # fmt: skip
        out = requests.post(f"{url}/v1/completions", json=trl_payload, timeout=120)
        assert out.status_code == 200, out.text
        choice = out.json()["choices"][0]
        tokens, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        assert 1 <= len(tokens) <= 6 and len(logprobs) == len(tokens)
        ref = teacher_forced_logprobs(model_dir, adapter, [3, 4, 5], tokens, SamplingSpec(temperature=1.0))
        assert max(abs(a - b) for a, b in zip(ref, logprobs, strict=True)) < 1e-3
        batch = dict(trl_payload, prompt=[[1, 2], [9, 8, 7]], n=2)
        choices = requests.post(f"{url}/v1/completions", json=batch, timeout=120).json()["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2, 3]
        assert [c["prompt_token_ids"] for c in choices] == [[1, 2], [1, 2], [9, 8, 7], [9, 8, 7]]
    finally:
        gen.terminate()
        gen.wait(30)


@pytest.mark.slow  # real processes for seconds: make test, not make test-fast
def test_probes_adapter_load_and_restart(proxy: ProxyHarness, tiny_model_dir: Path, tmp_path: Path) -> None:
    spec = run_spec(tiny_model_dir, max_staleness=3)
    proxy.client("trl", "trainer").put_run(spec)
    adapter = make_adapter(tiny_model_dir, tmp_path / "trl-policy-v1", seed=1)
    with running_gateway(proxy, "trl", tmp_path) as url:
        client = vllm_client(url)
        client.wait_for_server_ready(poll_interval_s=0.1)
        assert client.get_max_model_len() == spec.episode.max_episode_tokens
        info = client.get_server_info()
        assert info["lora_config"]["max_lora_rank"] == RANK
        assert info["lora_config"]["max_loras"] >= spec.max_staleness + 2
        assert info["parallel_config"]["data_parallel_size"] == 1
        assert client.get_dtype().startswith("torch.")
        assert client.get_world_size() == 1
        client.pause()
        client.load_lora_adapter("trl-policy-v1", str(adapter))
        client.resume()
        # Committed through the proxy: the run's version 1 is these bytes.
        latest = proxy.client("trl", "generator").wait_for_version(after=0, wait_s=0)
        assert latest is not None and latest.version == 1
        client.load_lora_adapter("trl-policy-v1", str(adapter))  # a retried load: same version, no new one
        assert proxy.client("trl", "generator").wait_for_version(after=1, wait_s=0) is None
        with pytest.raises(Exception, match="400"):  # other bytes under a loaded name (vLLM: already loaded)
            client.load_lora_adapter("trl-policy-v1", str(make_adapter(tiny_model_dir, tmp_path / "b", seed=2)))
        with pytest.raises(Exception, match=r"400.*holds no adapter_config\.json"):  # not TRL's misleading 404 text
            client.load_lora_adapter("trl-policy-v2", str(tmp_path / "nowhere"))
        completions_on_a_real_generator(proxy, url, tiny_model_dir, adapter, tmp_path)
        bad = requests.post(f"{url}/v1/completions", json={"model": "trl-policy-v9", "prompt": [1, 2], "max_tokens": 2})
        assert bad.status_code == 404
        assert bad.json()["error"] == {
            "message": "The model `trl-policy-v9` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    # A restarted gateway still knows the name (its state file), and unload ends it.
    with running_gateway(proxy, "trl", tmp_path) as url:
        models = [m["id"] for m in requests.get(f"{url}/v1/models").json()["data"]]
        assert models == [spec.base_model, "trl-policy-v1"]
        client = vllm_client(url)
        client.unload_lora_adapter("trl-policy-v1")
        gone = requests.post(f"{url}/v1/completions", json={"model": "trl-policy-v1", "prompt": [1], "max_tokens": 1})
        assert gone.status_code == 404
    # A gateway that lost its state file (died between the proxy's commit and its own write) adopts the committed
    # version holding these bytes instead of publishing them twice.
    with running_gateway(proxy, "trl", tmp_path, state=tmp_path / "lost.json") as url:
        vllm_client(url).load_lora_adapter("trl-policy-v1", str(adapter))
        assert proxy.client("trl", "generator").wait_for_version(after=1, wait_s=0) is None
