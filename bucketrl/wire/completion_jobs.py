"""Completion jobs: single completion requests (not GRPO groups) queued through the proxy to the generator pool.

An external trainer (TRL's ``AsyncGRPOTrainer`` through ``bucketrl gateway``) asks for completions of its own
prompts, each pinned to an adapter version (or the base model). The proxy queues the job in Redis; a generator
that has (or can load) the version leases it, samples, and posts the result; the asker long-polls for it. A
generator that dies mid-job lets its lease expire and the job is offered again, so the asker sees latency, not an
error; the first result posted wins and later ones are ignored (exactly one answer per job).
"""

from typing import Literal

from pydantic import Field

from bucketrl.wire.common import (
    MAX_COMPLETION_TOKENS,
    MAX_LOADED_VERSIONS,
    MAX_PROMPT_TOKENS,
    LeaseId,
    RequestId,
    Version,
    WireModel,
    WorkerId,
)

MAX_JOB_SAMPLES = 64  # n per job: TRL asks for 1 per request; agents at most a handful
MAX_JOBS_PER_LEASE = 256


class CompletionJobRequest(WireModel):
    """What the asker queues. ``request_id`` is the job's id: a retry with the same id is the same job."""

    request_id: RequestId
    version: Version | None = Field(None, description="The adapter version to sample with; None: the base model.")
    prompt_token_ids: list[int] = Field(min_length=1, max_length=MAX_PROMPT_TOKENS)
    max_tokens: int = Field(16, ge=1, le=MAX_COMPLETION_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_JOB_SAMPLES)
    ttl_s: float = Field(
        600.0, gt=0.0, le=86_400.0, description="How long the proxy keeps the job (and its answer) at most."
    )


class CompletionJobAccepted(WireModel):
    request_id: RequestId
    state: Literal["queued", "leased", "done"]


class CompletionChoice(WireModel):
    token_ids: list[int] = Field(max_length=MAX_COMPLETION_TOKENS)
    logprobs: list[float] = Field(max_length=MAX_COMPLETION_TOKENS, description="Behaviour logprob per token.")
    finish_reason: Literal["stop", "length", "abort"]


class CompletionJobResult(WireModel):
    """Posted by the generator that sampled the job; answered to the asker."""

    request_id: RequestId
    worker_id: WorkerId
    version: Version | None
    choices: list[CompletionChoice] = Field(min_length=1, max_length=MAX_JOB_SAMPLES)


class CompletionJobLeaseRequest(WireModel):
    """A generator asks for jobs it can serve: those of versions it has loaded first, then any (it loads them)."""

    worker_id: WorkerId
    max_jobs: int = Field(32, ge=1, le=MAX_JOBS_PER_LEASE)
    loaded_versions: list[int] = Field(default_factory=list, max_length=MAX_LOADED_VERSIONS)
    ttl_s: float = Field(60.0, gt=0.0, le=3600.0, description="Unanswered by then, the job is offered again.")
    wait_s: float = Field(0.0, ge=0.0, le=60.0, description="Long-poll for jobs instead of answering empty.")
    base_model: bool = Field(True, description="The caller serves base-model jobs (version None) too.")


class LeasedCompletionJob(WireModel):
    lease_id: LeaseId
    job: CompletionJobRequest


class CompletionJobLease(WireModel):
    jobs: list[LeasedCompletionJob] = Field(default_factory=list, max_length=MAX_JOBS_PER_LEASE)
