"""The generator worker loop against a real proxy (uvicorn in a thread), real Redis and a file:// bucket.

- in-process worker (transformers engine): every submitted group validates and carries exactly what the
  trainer recomputes; a newly published version is picked up and reported; stop releases everything.
- real processes: SIGTERM exits 0 quickly and releases its prompts; a SIGKILLed generator's prompts are
  issued again once their leases expire.
"""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from bucketrl import errors
from bucketrl.generator.worker import GeneratorWorker
from bucketrl.preflight import ConfigError
from bucketrl.rollout.detokenize import complete_text
from bucketrl.tarball import pack_dir
from bucketrl.wire import DatasetSpec, Delivery, EvalSpec, RewardSpec, RunSpec, SamplingSpec
from tests.generator.helpers import make_adapter, teacher_forced_logprobs
from tests.generator.worker_support import (
    PROMPTS,
    Consumer,
    create_run,
    running_worker,
    start_generator,
    wait_until,
    worker_settings,
)
from tests.proxy.harness import ProxyHarness, make_tar, running
from tests.support.services import RedisServer

FIX = "tests.generator.reward_fixtures"


@pytest.fixture()
def proxy(redis_server: RedisServer, tmp_path: Path) -> Iterator[ProxyHarness]:
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as h:
        yield h


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("worker-adapters")
    return {v: make_adapter(tiny_model_dir, root / f"v{v}", seed=10 + v) for v in (1, 2)}


def check_delivery(d: Delivery, spec: RunSpec, model_dir: Path, adapters: dict[int, Path], tok: object) -> None:
    assert d.worker_id == "gen-a"
    for g in d.groups:
        assert g.prompt_id.endswith(f"-{g.prompt_index}")
        assert g.prompt_token_ids == tok.encode(PROMPTS[g.prompt_index])  # type: ignore[attr-defined]
        assert len(g.completions) == spec.group_size
        for c in g.completions:
            # The run's reward function, applied to the completion's text (a token cut inside a character held back).
            assert c.reward == float(len(complete_text(tok, c.token_ids)))
            assert len(c.token_ids) <= spec.sampling.max_new_tokens
            ref = teacher_forced_logprobs(
                model_dir, adapters[d.version], g.prompt_token_ids, c.token_ids, spec.sampling
            )
            assert max(abs(a - b) for a, b in zip(ref, c.logprobs, strict=True)) < 1e-3


def test_worker_submits_valid_groups_and_follows_new_versions(
    proxy: ProxyHarness, tiny_model_dir: Path, adapters: dict[int, Path]
) -> None:
    trainer, spec = create_run(proxy, "w1", tiny_model_dir, adapters[1])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    viewer = proxy.client("w1", "viewer")
    with running_worker(worker_settings(proxy, "w1", "gen-a")) as worker, Consumer(trainer) as consumer:
        first = consumer.wait_for(lambda ds: sum(len(d.groups) for d in ds) >= 4, 180)
        assert {d.version for d in first} == {1}
        for d in first:
            check_delivery(d, spec, tiny_model_dir, adapters, tok)

        trainer.publish_adapter(2, pack_dir(adapters[2]))
        later = consumer.wait_for(lambda ds: any(d.version == 2 for d in ds), 120)
        for d in later:
            if d.version == 2:
                check_delivery(d, spec, tiny_model_dir, adapters, tok)
        me = wait_until(
            lambda: next(
                (w for w in viewer.status().workers if w.worker_id == "gen-a" and 2 in w.loaded_versions), None
            ),
            10,
            "gen-a reports v2 loaded",
        )
        assert me.role == "generator"
        metrics = viewer.status().metrics.get("gen-a", {})
        for name in (
            "rollout/generated_tok_s",
            "rollout/backpressure_s",
            "rollout/inflight",
            "rollout/unscorable_total",
            "sync/adapter_load_s",
            "reward",
        ):
            assert name in metrics, (name, sorted(metrics))
        assert metrics["policy/version"] == 2
        # The worker samples with the settings it started with, and its batches say so: a change of the run's
        # sampling does not relabel them (the trainer recomputes logprobs with what the batch records).
        assert all(d.sampling == spec.sampling for d in consumer.deliveries)
        trainer.put_run(spec.model_copy(update={"sampling": spec.sampling.model_copy(update={"temperature": 3.0})}))
        accepted_before = viewer.status().queue.accepted_total  # groups after these were submitted after the change
        after = consumer.wait_for(lambda ds: sum(len(d.groups) for d in ds) > accepted_before, 120)
        assert all(d.sampling == spec.sampling for d in after), [d.sampling for d in after]
        worker.request_stop()
        worker.thread.join(60)  # type: ignore[attr-defined]
        assert not worker.thread.is_alive(), "worker did not stop"  # type: ignore[attr-defined]
    status = viewer.status()
    assert status.prompts_inflight == 0  # everything submitted or released, nothing left to expire
    assert all(v.leases == 0 for v in status.versions), status.versions
    # Each prompt was accepted at most once per pass (idempotent submits, no double leases).
    accepted = [g.prompt_id for d in consumer.deliveries for g in d.groups]
    assert len(accepted) == len(set(accepted))


def test_broken_versions_are_skipped_and_the_previous_one_keeps_serving(
    proxy: ProxyHarness, tiny_model_dir: Path, adapters: dict[int, Path], tmp_path: Path
) -> None:
    """Invariant 7: an adapter the engine cannot load, or a tar that is no adapter, never stops a generator."""
    trainer, _ = create_run(proxy, "w4", tiny_model_dir, adapters[1])
    viewer = proxy.client("w4", "viewer")
    garbage = tmp_path / "garbage"
    shutil.copytree(adapters[1], garbage)
    # Well-formed PEFT files (the proxy's publish check passes them) whose tensors have the wrong shapes.
    weights = garbage / "adapter_model.safetensors"
    save_file({k: torch.zeros(1) for k in load_file(str(weights))}, str(weights))

    def failures() -> float:
        return viewer.status().metrics.get("gen-b", {}).get("sync/adapter_failures_total", 0)

    with running_worker(worker_settings(proxy, "w4", "gen-b")), Consumer(trainer) as consumer:
        consumer.wait_for(lambda ds: len(ds) >= 1, 180)
        trainer.publish_adapter(2, pack_dir(garbage))  # the engine cannot load it
        wait_until(lambda: failures() >= 1, 60, "v2 refused")
        n = len(consumer.deliveries)
        consumer.wait_for(lambda ds: len(ds) >= n + 2, 60)  # still producing on v1 (inside the window)
        # Not an adapter at all: refused at publish (issue 12), so generators never see it.
        with pytest.raises(errors.Invalid, match=r"adapter_config\.json"):
            trainer.publish_adapter(3, make_tar({"README.md": b"no adapter here"}))
        # v1 is now outside the staleness window: the worker waits instead of producing stale groups.
        trainer.publish_adapter(3, pack_dir(adapters[2]))
        consumer.wait_for(lambda ds: any(d.version == 3 for d in ds), 120)
        assert {d.version for d in consumer.deliveries} == {1, 3}
        wait_until(
            lambda: any(w.worker_id == "gen-b" and w.loaded_versions == [3] for w in viewer.status().workers),
            20,
            "v1 unloaded once out of the window and unused",
        )


def test_a_version_retired_during_the_prompt_wait_is_not_the_one_sampled_with(
    proxy: ProxyHarness, tiny_model_dir: Path, adapters: dict[int, Path]
) -> None:
    """The loop picks its version, then waits for prompts; while it waits it loads newer versions and retires
    those that left the staleness window. Sampling must use a version still loaded afterwards (the newest),
    not the one picked before the wait (a CI run once caught the KeyError this raised)."""
    trainer, _ = create_run(proxy, "w5", tiny_model_dir, adapters[1])  # max_staleness 1
    viewer = proxy.client("w5", "viewer")
    blocked, release = threading.Event(), threading.Event()

    def loaded() -> list[int]:
        me = next((w for w in viewer.status().workers if w.worker_id == "gen-r"), None)
        return me.loaded_versions if me is not None else []

    with running_worker(worker_settings(proxy, "w5", "gen-r", metrics_interval_s=0.1)) as worker:
        with Consumer(trainer) as consumer:
            consumer.wait_for(lambda ds: len(ds) >= 1, 180)  # sampling with v1
            lease = worker.lease_prompts

            def held_lease(n: int) -> list:  # the proxy "answers" only when the test says so
                blocked.set()
                release.wait(120)
                return lease(n)

            # Prompts that ride on a submit (RolloutBatch.next_prompts) skip lease_prompts: the hold would
            # then never be reached (a CI run timed out so), so every lease goes through it here.
            assert worker.submitter is not None
            lease_with_next = worker.submitter.lease_with_next
            worker.submitter.lease_with_next = lambda req: None  # type: ignore[method-assign]
            worker.lease_prompts = held_lease  # type: ignore[method-assign]
            assert blocked.wait(120)
            # Now the loop waits for prompts, holding v1 as its version. v2 and v3 arrive: v1 leaves the window.
            trainer.publish_adapter(2, pack_dir(adapters[2]))
            trainer.publish_adapter(3, pack_dir(adapters[1]))
            wait_until(lambda: 3 in loaded() and 1 not in loaded(), 60, "v1 retired while the loop waits")
            assert worker.thread.is_alive()  # type: ignore[attr-defined]
            worker.lease_prompts = lease  # type: ignore[method-assign]
            worker.submitter.lease_with_next = lease_with_next  # type: ignore[method-assign]
            release.set()
            failed = worker.failure  # type: ignore[attr-defined]
            consumer.wait_for(lambda ds: bool(failed) or any(d.version == 3 for d in ds), 120)
        assert not failed, failed
        assert worker.thread.is_alive()  # type: ignore[attr-defined]


@pytest.mark.slow  # real processes for seconds: make test, not make test-fast
def test_sigterm_exits_zero_and_releases_prompts(
    proxy: ProxyHarness, tiny_model_dir: Path, adapters: dict[int, Path], tmp_path: Path
) -> None:
    # A slow reward keeps the batch in flight when SIGTERM arrives; the prompt TTL is long, so only a
    # release (not an expiry) can bring prompts_inflight back to 0.
    create_run(
        proxy, "w2", tiny_model_dir, adapters[1], reward=RewardSpec(name=f"{FIX}:sleepy", kwargs={"seconds": 60})
    )
    viewer = proxy.client("w2", "viewer")
    log = tmp_path / "gen.log"
    proc = start_generator(
        proxy,
        "w2",
        log,
        worker_id="gen-term",
        reward_timeout_s=120,
        shutdown_timeout_s=2,
        prompt_lease_ttl_s=300,
        prompts_per_request=2,
    )
    try:
        wait_until(lambda: viewer.status().prompts_inflight >= 2 or proc.poll() is not None, 180, "prompts leased")
        assert proc.poll() is None, log.read_text()[-3000:]
        wait_until(
            lambda: any(w.worker_id == "gen-term" and w.loaded_versions == [1] for w in viewer.status().workers),
            30,
            "heartbeat with loaded_versions",
        )
        time.sleep(1.0)  # let it get into scoring
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log.read_text()
    assert rc == 0, out[-3000:]
    assert elapsed < 20, f"took {elapsed:.1f}s to stop"
    status = viewer.status()
    assert status.prompts_inflight == 0, out[-3000:]
    assert all(v.leases == 0 for v in status.versions)


@pytest.mark.slow  # real processes for seconds: make test, not make test-fast
def test_sigkilled_generators_prompts_are_issued_again(
    proxy: ProxyHarness, tiny_model_dir: Path, adapters: dict[int, Path], tmp_path: Path
) -> None:
    create_run(
        proxy, "w3", tiny_model_dir, adapters[1], reward=RewardSpec(name=f"{FIX}:sleepy", kwargs={"seconds": 60})
    )
    viewer = proxy.client("w3", "viewer")
    log = tmp_path / "gen.log"
    proc = start_generator(
        proxy, "w3", log, worker_id="gen-kill", reward_timeout_s=120, prompt_lease_ttl_s=3, prompts_per_request=3
    )
    try:
        wait_until(lambda: viewer.status().prompts_inflight >= 3 or proc.poll() is not None, 180, "prompts leased")
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(1.0)
    finally:
        proc.kill()
        proc.wait()
    # Its leases are still live for up to 3 s; after that the same prompts come back first.
    other = proxy.client("w3", "generator")
    time.sleep(4.5)
    lease = other.lease_prompts("gen-other", 3, ttl_s=60)
    assert [(p.pass_, p.index) for p in lease.prompts] == [(0, 0), (0, 1), (0, 2)]


def test_worker_waits_for_its_run_and_refuses_a_config_it_cannot_serve(
    proxy: ProxyHarness, tiny_model_dir: Path, adapters: dict[int, Path]
) -> None:
    early = GeneratorWorker(worker_settings(proxy, "w5", "gen-c"))
    threading.Timer(1.5, early.request_stop).start()
    t0 = time.monotonic()
    assert early.run() == 0  # the run does not exist yet: it waits, and stops cleanly
    assert time.monotonic() - t0 < 10
    create_run(proxy, "w5", tiny_model_dir, adapters[1], sampling=SamplingSpec(max_new_tokens=16))
    cramped = GeneratorWorker(worker_settings(proxy, "w5", "gen-c", max_model_len=16))
    # The preflight's one line (the CLI prints it and exits 2): what does not fit and what to change.
    with pytest.raises(ConfigError, match="max_new_tokens 16 exceeds the context of 16 tokens: lower sampling"):
        cramped.run()
    assert proxy.client("w5", "viewer").status().prompts_inflight == 0


def _greedy_text(model_dir: Path, adapter_dir: Path, tok: Any, prompt: str, max_new: int) -> str:
    """Greedy decoding by hand (argmax per step, stop after EOS) with the adapter, the reference for eval."""
    from tests.generator.helpers import _peft_model

    model = _peft_model(str(model_dir), str(adapter_dir))
    cfg = model.get_base_model().config
    eos = getattr(model.get_base_model().generation_config, "eos_token_id", None) or cfg.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    ids, out = list(tok.encode(prompt)), []
    with torch.no_grad():
        for _ in range(max_new):
            t = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(t)
            out.append(t)
            if t in eos_ids:
                break
    return complete_text(tok, out)  # the text the evaluator scores (an incomplete last character held back)


def test_eval_prompts_are_sampled_with_the_eval_settings_and_training_goes_on(
    proxy: ProxyHarness, tiny_model_dir: Path, adapters: dict[int, Path], tmp_path: Path
) -> None:
    """Evaluation during training on a real worker: greedy by default (each eval answer is the adapter's greedy
    completion, so the exact-match reward is 1.0 for every prompt; the run's temperature-1 sampling would almost
    never hit it), then ``n`` samples per prompt with the eval's own sampling (its max_new_tokens, not the run's)
    for pass@n; scored by the run's reward; training groups keep flowing meanwhile."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    size, max_new = 3, 8
    answers = [_greedy_text(tiny_model_dir, adapters[1], tok, p, max_new) for p in PROMPTS[:size]]
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text(
        "".join(json.dumps({"question": p, "solution": a}) + "\n" for p, a in zip(PROMPTS[:size], answers, strict=True))
    )
    eval_set = DatasetSpec(uri=str(eval_file), prompt_field="question", answer_field="solution", size=size)
    greedy = EvalSpec(every=1, size=size, dataset=eval_set)
    trainer, spec = create_run(
        proxy,
        "w-eval",
        tiny_model_dir,
        adapters[1],
        reward=RewardSpec(name="exact"),
        sampling=SamplingSpec(temperature=1.0, max_new_tokens=max_new),
        eval=greedy,
    )
    viewer = proxy.client("w-eval", "viewer")
    with running_worker(worker_settings(proxy, "w-eval", "gen-a")), Consumer(trainer) as consumer:
        (v1,) = wait_until(lambda: viewer.eval_results(), 180, "v1 evaluated")
        assert (v1.version, v1.prompts, v1.samples, v1.k) == (1, size, size, 1)
        assert (v1.reward_mean, v1.pass_at_1, v1.unscorable_frac) == (1.0, 1.0, 0.0), (v1, answers)
        assert v1.mean_length <= max_new
        # pass@n with the eval's own sampling settings, for the next version.
        sampled = greedy.model_copy(update={"n": 3, "sampling": SamplingSpec(temperature=1.0, max_new_tokens=2)})
        trainer.put_run(spec.model_copy(update={"eval": sampled}))
        trainer.publish_adapter(2, pack_dir(adapters[2]))
        v2 = wait_until(lambda: next((e for e in viewer.eval_results() if e.version == 2), None), 180, "v2 evaluated")
        assert (v2.prompts, v2.samples, v2.k) == (size, 3 * size, 3)
        assert 1.0 <= v2.mean_length <= 2.0  # the eval's max_new_tokens (2), not the run's (8)
        # Training went on: groups of both versions reached the trainer, and no eval prompt did.
        trained = consumer.wait_for(lambda ds: {d.version for d in ds} >= {1, 2}, 120)
        assert all(len(g.completions) == spec.group_size for d in trained for g in d.groups)
    status = viewer.status()
    assert [e.version for e in status.eval] == [1, 2]


def test_a_version_being_evaluated_stays_loaded_until_its_eval_is_done(
    proxy: ProxyHarness, tiny_model_dir: Path, adapters: dict[int, Path]
) -> None:
    """Eval takes one small batch per training batch, so a version's evaluation can outlast its staleness
    window. The generator keeps it loaded until the proxy has no prompt of it left: unloaded with the window
    (as before), nobody holds it any more and it is never evaluated (the demo lost v51 that way)."""
    size = 12  # 6 eval batches of prompts_per_request 2
    trainer, _ = create_run(
        proxy, "w-pin", tiny_model_dir, adapters[1], max_staleness=1, eval=EvalSpec(every=2, size=size, split="x")
    )
    # (the eval set is the run's bucket dataset: eval.dataset None reads it with the split, which a bucket
    # dataset ignores)
    viewer = proxy.client("w-pin", "viewer")
    with running_worker(worker_settings(proxy, "w-pin", "gen-a")) as worker, Consumer(trainer):
        wait_until(lambda: 1 in worker.book.pinned(), 180, "v1's evaluation started")
        assert not viewer.eval_results(), "v1 evaluated within one batch: the test needs a larger eval set"
        trainer.publish_adapter(2, pack_dir(adapters[2]))
        trainer.publish_adapter(3, pack_dir(adapters[1]))  # v1 leaves the window (newest 3, max_staleness 1)
        wait_until(lambda: 3 in worker.book.loaded_versions(), 120, "v3 loaded")
        v1 = wait_until(lambda: next((e for e in viewer.eval_results() if e.version == 1), None), 180, "v1 eval")
        assert v1.prompts == size
        wait_until(lambda: 1 not in worker.book.loaded_versions(), 60, "v1 unloaded once its eval was done")
