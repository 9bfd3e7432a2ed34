"""A real generator worker (transformers engine, the built-in tiny model) serving completion jobs through a real
proxy: jobs pinned to two versions are batched and answered with exact token ids and behaviour logprobs (the
trainer's teacher-forced ones), a job leased by a generator that died is answered by this one once the lease
lapses, and a base-model job is sampled with no adapter."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from bucketrl.tarball import pack_dir
from bucketrl.wire import SamplingSpec
from bucketrl.wire.completion_jobs import CompletionJobRequest, CompletionJobResult
from tests.generator.helpers import make_adapter, teacher_forced_logprobs
from tests.generator.worker_support import (
    REPO,
    create_run,
    generator_env,
    running_worker,
    wait_until,
    worker_settings,
)
from tests.proxy.harness import ProxyHarness, running
from tests.support.services import RedisServer


def base_logprobs(model_dir: Path, prompt: list[int], tokens: list[int]) -> list[float]:
    """The bare model's teacher-forced logprobs (temperature 1): what a base-model job must report."""
    import torch
    from transformers import AutoModelForCausalLM

    from bucketrl.logprobs import sampled_token_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return sampled_token_logprobs(logits, torch.tensor(tokens), 1.0, -1, 1.0).tolist()


@pytest.fixture()
def proxy(redis_server: RedisServer, tmp_path: Path) -> Iterator[ProxyHarness]:
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as h:
        yield h


def test_a_worker_serves_jobs_of_two_versions_and_a_dead_generators_job(
    proxy: ProxyHarness, tiny_model_dir: Path, tmp_path: Path
) -> None:
    adapters = {v: make_adapter(tiny_model_dir, tmp_path / f"v{v}", seed=20 + v) for v in (1, 2)}
    trainer, _ = create_run(proxy, "jobs", tiny_model_dir, adapters[1])
    trainer.publish_adapter(2, pack_dir(adapters[2]))
    trainer.publish_adapter(3, pack_dir(adapters[2]))  # the worker follows v3: v1 and v2 are fetched for their jobs
    prompt = AutoTokenizer.from_pretrained(str(tiny_model_dir))("1+2=")["input_ids"]
    jobs = [
        CompletionJobRequest(request_id="dead", version=2, prompt_token_ids=prompt, max_tokens=3),
        CompletionJobRequest(request_id="v1", version=1, prompt_token_ids=prompt, max_tokens=5, n=2),
        CompletionJobRequest(request_id="v1b", version=1, prompt_token_ids=prompt[:2], max_tokens=5, n=2),
        CompletionJobRequest(request_id="v2", version=2, prompt_token_ids=prompt, max_tokens=4, temperature=0.0),
        CompletionJobRequest(request_id="base", version=None, prompt_token_ids=prompt, max_tokens=4),
    ]
    trainer.submit_completion_job(jobs[0])
    dead = proxy.client("jobs", "generator")
    (lost,) = dead.lease_completion_jobs("gen-dead", max_jobs=1, ttl_s=1.0, base_model=False).jobs  # never answered
    assert lost.job.request_id == "dead"
    for job in jobs[1:]:
        trainer.submit_completion_job(job)

    settings = worker_settings(proxy, "jobs", "gen-jobs", serve_completion_jobs=True)
    with running_worker(settings):
        results: dict[str, CompletionJobResult] = {}
        deadline = time.monotonic() + 120
        while len(results) < len(jobs) and time.monotonic() < deadline:
            for job in jobs:
                if job.request_id not in results:
                    got = trainer.wait_completion_job(job.request_id, wait_s=1.0)
                    if got is not None:
                        results[job.request_id] = got
        assert sorted(results) == ["base", "dead", "v1", "v1b", "v2"]

    for job in jobs:
        res = results[job.request_id]
        assert (res.worker_id, res.version, len(res.choices)) == ("gen-jobs", job.version, job.n)
        for c in res.choices:
            assert 1 <= len(c.token_ids) <= job.max_tokens and len(c.logprobs) == len(c.token_ids)
            assert all(math.isfinite(x) and x <= 0.0 for x in c.logprobs)
    # The behaviour logprobs are the adapter's own: what the trainer recomputes by teacher forcing.
    sampling = SamplingSpec(temperature=1.0, max_new_tokens=5)
    c = results["v1"].choices[0]
    want = teacher_forced_logprobs(tiny_model_dir, adapters[1], prompt, c.token_ids, sampling)
    assert c.logprobs == pytest.approx(want, abs=2e-3)
    b = results["base"].choices[0]
    assert results["base"].version is None
    assert b.logprobs == pytest.approx(base_logprobs(tiny_model_dir, prompt, b.token_ids), abs=2e-3)
    assert b.logprobs != pytest.approx(
        teacher_forced_logprobs(tiny_model_dir, adapters[2], prompt, b.token_ids, sampling), abs=2e-3
    )


@pytest.mark.slow  # real processes for seconds: make test, not make test-fast
def test_a_generator_killed_holding_a_job_leaves_it_to_another(
    proxy: ProxyHarness, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Generator A, a real process started with the CLI flag, serves a job; then it is frozen (SIGSTOP) inside
    its next long-polled lease, so the proxy leases it the next job, and SIGKILLed: B answers that job."""
    trainer, _ = create_run(proxy, "kill", tiny_model_dir, make_adapter(tiny_model_dir, tmp_path / "v1", seed=7))
    prompt = AutoTokenizer.from_pretrained(str(tiny_model_dir))("1+2=")["input_ids"]
    log = tmp_path / "gen-a.log"
    with log.open("wb") as out:
        a = subprocess.Popen(
            [sys.executable, "-m", "bucketrl.cli", "generator", "--serve-completion-jobs"],
            env=generator_env(proxy, "kill", worker_id="gen-a", completion_job_ttl_s=2),
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        trainer.submit_completion_job(CompletionJobRequest(request_id="warm", version=1, prompt_token_ids=prompt))
        warm = wait_until(lambda: trainer.wait_completion_job("warm", wait_s=1.0), 120, "gen-a serving")
        assert warm.worker_id == "gen-a", log.read_text()
        time.sleep(0.5)  # gen-a is back in its 2 s long-poll for jobs
        a.send_signal(signal.SIGSTOP)
        job = CompletionJobRequest(request_id="orphan", version=1, prompt_token_ids=prompt, max_tokens=3)
        trainer.submit_completion_job(job)
        wait_until(lambda: trainer.submit_completion_job(job).state == "leased", 10, "the job leased to gen-a")
        a.kill()
        a.wait(30)
        with running_worker(worker_settings(proxy, "kill", "gen-b", serve_completion_jobs=True)):
            res = wait_until(lambda: trainer.wait_completion_job("orphan", wait_s=1.0), 60, "gen-b answering")
        assert res.worker_id == "gen-b" and 1 <= len(res.choices[0].token_ids) <= 3
    finally:
        if a.poll() is None:
            a.kill()
            a.wait(30)
