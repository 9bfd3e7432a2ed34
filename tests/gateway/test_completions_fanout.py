"""The gateway's completion path under TRL's load: 128 requests in flight at once (TRL's default
``max_inflight_tasks`` is 128) are all queued as jobs together, not one after another, and each answer comes back
in vLLM's shape exactly as TRL's rollout worker reads it (``choices[0].token_ids``, ``.logprobs.token_logprobs``).

The generator here is a stand-in (``ProxyClient`` with the generator role, leasing and answering jobs over the real
proxy): it holds every answer until it has leased all 128 jobs, which a gateway that serialised requests would never
let it do. The real generator serving jobs is driven in ``test_trl_contract.py``.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path

import aiohttp

from bucketrl.wire.completion_jobs import CompletionChoice, CompletionJobResult, LeasedCompletionJob
from tests.gateway.support import running_gateway
from tests.generator.helpers import make_adapter, run_spec
from tests.proxy.harness import ProxyHarness, running
from tests.support.services import RedisServer

IN_FLIGHT = 128


def stand_in_generator(proxy: ProxyHarness, run: str, stop: threading.Event, leased: list[LeasedCompletionJob]) -> None:
    gen = proxy.client(run, "generator")
    while len(leased) < IN_FLIGHT and not stop.is_set():
        leased.extend(gen.lease_completion_jobs("gen-stand-in", max_jobs=256, loaded_versions=[1], wait_s=1).jobs)
    for lj in leased:  # the answer encodes the prompt, so a mix-up between requests shows
        p = lj.job.prompt_token_ids
        choice = CompletionChoice(token_ids=[p[0], p[0] + 1], logprobs=[-0.25, -0.5], finish_reason="length")
        gen.post_completion_result(
            CompletionJobResult(
                request_id=lj.job.request_id, worker_id="gen-stand-in", version=lj.job.version, choices=[choice]
            )
        )


async def trl_requests(url: str, model: str) -> list[dict]:
    """The payload TRL's ``_generate_one_turn`` sends, from one aiohttp session, as its rollout worker does."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=IN_FLIGHT)) as session:

        async def one(i: int) -> dict:
            payload = {
                "model": model, "prompt": [i % 60, 1, 2], "max_tokens": 2, "temperature": 1.0, "top_p": 1.0,
                "top_k": 0, "repetition_penalty": 1.0, "n": 1, "return_token_ids": True, "logprobs": 0,
                "seed": random.getrandbits(63),
            }  # fmt: skip
            async with session.post(f"{url}/v1/completions", json=payload) as resp:
                resp.raise_for_status()
                return await resp.json()

        return await asyncio.gather(*(one(i) for i in range(IN_FLIGHT)))


def test_128_in_flight_are_queued_together(redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path) -> None:
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as proxy:
        proxy.client("trl", "trainer").put_run(run_spec(tiny_model_dir))
        with running_gateway(proxy, "trl", tmp_path) as url:
            import requests

            load = {
                "lora_name": "trl-policy-v1",
                "lora_path": str(make_adapter(tiny_model_dir, tmp_path / "a", seed=1)),
            }
            assert requests.post(f"{url}/v1/load_lora_adapter", json=load).status_code == 200
            stop, leased = threading.Event(), []
            gen = threading.Thread(target=stand_in_generator, args=(proxy, "trl", stop, leased), daemon=True)
            gen.start()
            t0 = time.monotonic()
            try:
                answers = asyncio.run(asyncio.wait_for(trl_requests(url, "trl-policy-v1"), 120))
            finally:
                stop.set()
                gen.join(30)
            print(f"{IN_FLIGHT} completions through the gateway: {time.monotonic() - t0:.2f}s")
    assert len(leased) == IN_FLIGHT and {lj.job.version for lj in leased} == {1}
    for i, out in enumerate(answers):
        choice = out["choices"][0]
        assert choice["token_ids"] == [i % 60, i % 60 + 1]
        assert choice["logprobs"]["token_logprobs"] == [-0.25, -0.5]
        assert out["model"] == "trl-policy-v1" and out["object"] == "text_completion"
