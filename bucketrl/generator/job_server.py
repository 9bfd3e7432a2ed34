"""Serving completion jobs (``BUCKETRL_SERVE_COMPLETION_JOBS``): an external trainer's completions, not GRPO groups.

In this mode the worker leases no prompts. Its main thread loops: lease jobs (long-polled, its loaded versions
first), make sure each job's version is loaded (the adapter-sync thread loads the newest; an older one is
fetched and loaded here, through the same version book, so its lease is renewed and it is retired when idle),
sample the jobs of one version and the same sampling settings in ONE engine call, and post each job's exact
token ids and behaviour logprobs. The proxy hands out only jobs of published versions, so a job is never held
here waiting for one. A job that fails here is left to its lease: it expires and another generator gets it.

Base-model jobs (``version`` None) are not served yet: the engine seam samples only with a loaded adapter, so
this worker leases with ``base_model=False`` and such jobs wait for a generator that serves them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Protocol

from bucketrl import errors
from bucketrl.client import ProxyClient
from bucketrl.generator.adapters import VersionBook, fetch_adapter
from bucketrl.generator.settings import GeneratorSettings
from bucketrl.rollout.engine import Engine
from bucketrl.wire import SamplingSpec
from bucketrl.wire.completion_jobs import CompletionChoice, CompletionJobRequest, CompletionJobResult

log = logging.getLogger(__name__)

# A job lease long-polls this long (the proxy caps it at its max_wait_s); the loop re-checks stop meanwhile.
JOB_WAIT_S = 2.0


def sampling_of(job: CompletionJobRequest) -> SamplingSpec:
    """The engine's sampling settings for a job; temperature 0 is greedy (top_k 1: SamplingSpec needs t > 0)."""
    if job.temperature == 0.0:
        return SamplingSpec(temperature=1.0, top_k=1, top_p=1.0, max_new_tokens=job.max_tokens)
    return SamplingSpec(temperature=job.temperature, top_p=job.top_p, max_new_tokens=job.max_tokens)


class Host(Protocol):
    """What the job server uses of its :class:`~bucketrl.generator.worker.GeneratorWorker`."""

    worker_id: str
    settings: GeneratorSettings
    client: ProxyClient
    engine: Engine | None
    book: VersionBook
    stop_event: threading.Event
    _cache_dir: Path | None

    def sync_versions(self) -> None: ...


class JobServer:
    def __init__(self, worker: Host) -> None:
        self.w = worker
        self.served = 0

    def loop(self) -> None:
        w = self.w
        while not w.stop_event.is_set():
            w.sync_versions()
            try:
                lease = w.client.lease_completion_jobs(
                    w.worker_id,
                    max_jobs=w.settings.completion_jobs_per_lease,
                    loaded_versions=w.book.loaded_versions(),
                    ttl_s=w.settings.completion_job_ttl_s,
                    wait_s=JOB_WAIT_S,
                    base_model=False,
                )
            except errors.BucketRLError as exc:
                log.warning("completion job lease: %s %s", exc.code, exc.message)
                w.stop_event.wait(1.0)
                continue
            batches: dict[tuple[int, float, float, int, int], list[CompletionJobRequest]] = defaultdict(list)
            for leased in lease.jobs:
                job = leased.job
                if job.version is not None:
                    batches[(job.version, job.temperature, job.top_p, job.max_tokens, job.n)].append(job)
            for (version, *_), jobs in batches.items():
                if w.stop_event.is_set():
                    return  # unanswered jobs: their leases expire and another generator gets them
                self._serve(version, sampling_of(jobs[0]), jobs[0].n, jobs)

    def _ensure_loaded(self, version: int) -> bool:
        """``version`` in the engine; an older one than the adapter-sync thread follows is fetched here."""
        w = self.w
        assert w.engine is not None and w._cache_dir is not None
        if version in w.book.loaded_versions():
            return True
        t0 = time.monotonic()
        try:
            lease = w.client.lease_version(w.worker_id, version, ttl_s=w.settings.version_lease_ttl_s)
            path = fetch_adapter(w.client, version, w._cache_dir)
            w.book.add(version, lease.lease_id, path, time.monotonic() - t0)
            w.engine.load_adapter(w.book.name(version), version, path)
        except (errors.BucketRLError, OSError) as exc:
            log.warning("completion jobs of v%d: the version could not be loaded (%s)", version, exc)
            w.book.drop(version)
            return False
        w.book.mark_loaded(version)
        return True

    def _serve(self, version: int, sampling: SamplingSpec, n: int, jobs: list[CompletionJobRequest]) -> None:
        w = self.w
        assert w.engine is not None
        if not self._ensure_loaded(version):
            return
        w.book.begin(version)  # in use: not retired under the call
        try:
            groups = w.engine.generate(
                [j.prompt_token_ids for j in jobs],
                adapter=w.book.name(version),
                n=n,
                sampling=sampling,
                while_running=w.sync_versions,
            )
        except errors.BucketRLError as exc:
            log.warning("completion jobs of v%d: sampling failed (%s)", version, exc.message)
            return
        finally:
            w.book.end(version)
        for job, samples in zip(jobs, groups, strict=True):
            choices = [
                CompletionChoice(token_ids=s.token_ids, logprobs=s.logprobs, finish_reason=s.finish_reason)
                for s in samples
            ]
            result = CompletionJobResult(
                request_id=job.request_id, worker_id=w.worker_id, version=version, choices=choices
            )
            try:
                w.client.post_completion_result(result)
                self.served += 1
            except errors.BucketRLError as exc:
                log.warning("completion job %s: result refused (%s %s)", job.request_id, exc.code, exc.message)
