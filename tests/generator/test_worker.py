"""The generator worker loop against a real proxy (uvicorn in a thread), real Redis and a file:// bucket.

- in-process worker (transformers engine): every submitted group validates and carries exactly what the
  trainer recomputes; a newly published version is picked up and reported; stop releases everything.
- real processes: SIGTERM exits 0 quickly and releases its prompts; a SIGKILLed generator's prompts are
  issued again once their leases expire.
"""

from __future__ import annotations

import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from bucketrl import errors
from bucketrl.generator.worker import GeneratorWorker
from bucketrl.preflight import ConfigError
from bucketrl.tarball import pack_dir
from bucketrl.wire import Delivery, RewardSpec, RunSpec, SamplingSpec
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
            text = tok.decode(c.token_ids, skip_special_tokens=True)  # type: ignore[attr-defined]
            assert c.reward == float(len(text))  # the run's reward function, applied to the decoded completion
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
            lease = worker._lease_prompts

            def held_lease(n: int) -> list:  # the proxy "answers" only when the test says so
                blocked.set()
                release.wait(120)
                return lease(n)

            worker._lease_prompts = held_lease  # type: ignore[method-assign]
            assert blocked.wait(120)
            # Now the loop waits for prompts, holding v1 as its version. v2 and v3 arrive: v1 leaves the window.
            trainer.publish_adapter(2, pack_dir(adapters[2]))
            trainer.publish_adapter(3, pack_dir(adapters[1]))
            wait_until(lambda: 3 in loaded() and 1 not in loaded(), 60, "v1 retired while the loop waits")
            assert worker.thread.is_alive()  # type: ignore[attr-defined]
            worker._lease_prompts = lease  # type: ignore[method-assign]
            release.set()
            failed = worker.failure  # type: ignore[attr-defined]
            consumer.wait_for(lambda ds: bool(failed) or any(d.version == 3 for d in ds), 120)
        assert not failed, failed
        assert worker.thread.is_alive()  # type: ignore[attr-defined]


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
