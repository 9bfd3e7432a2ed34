"""Trainer settings: every field from a ``BUCKETRL_*`` environment variable (CLI options may override).

    BUCKETRL_PROXY_URL=http://proxy:8000 BUCKETRL_TOKEN=... BUCKETRL_RUN=demo \\
    BUCKETRL_RUN_SPEC=/etc/bucketrl/run.json BUCKETRL_MAX_STEPS=500 bucketrl trainer

``BUCKETRL_RUN_SPEC`` is either a path to a JSON file or the JSON itself. Given, the trainer creates the run
(or confirms it: same spec -> fine, a changed immutable field -> a clear error). Omitted, the run must
already exist on the proxy. ``dataset.size`` may be left out of the spec: the trainer then counts the
dataset with :func:`bucketrl.datasets.load_examples`. ``BUCKETRL_DATASET_FILE`` uploads a local JSONL file as
the run's dataset (``dataset.uri = "bucket:dataset.jsonl"``), so generators need no path of their own.

Imports without torch (pydantic only).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from bucketrl.settings import WorkerSettings
from bucketrl.trainer.trackers import check_report_to
from bucketrl.wire.runs import RunSpec


class TrainerSettings(WorkerSettings):
    """Everything ``bucketrl trainer`` reads. The run spec (model, LoRA, G, loss...) lives on the proxy."""

    run_spec: str = Field(
        "",
        description="BUCKETRL_RUN_SPEC: a RunSpec as a JSON file path or inline JSON; empty = the run must exist.",
    )
    dataset_file: str = Field(
        "",
        description="BUCKETRL_DATASET_FILE: a local JSONL file the trainer uploads as the run's dataset (the spec's "
        "dataset.uri must then be 'bucket:dataset.jsonl'); generators download it through the proxy.",
    )
    # Optimizer (AdamW over the LoRA parameters only).
    lr: float = Field(1e-5, gt=0.0, le=1.0, description="BUCKETRL_LR: peak learning rate of AdamW.")
    weight_decay: float = Field(0.0, ge=0.0, description="BUCKETRL_WEIGHT_DECAY: AdamW decoupled weight decay.")
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="BUCKETRL_ADAM_BETA1.")
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0, description="BUCKETRL_ADAM_BETA2.")
    adam_eps: float = Field(1e-8, gt=0.0, description="BUCKETRL_ADAM_EPS.")
    max_grad_norm: float = Field(
        1.0, ge=0.0, description="BUCKETRL_MAX_GRAD_NORM: clip the global gradient norm to this; 0 = no clipping."
    )
    # Learning-rate schedule: linear warmup, then constant, linear or cosine decay to min_lr_ratio * lr.
    warmup_steps: int = Field(0, ge=0, description="BUCKETRL_WARMUP_STEPS: steps of linear warmup from lr/warmup.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="BUCKETRL_LR_SCHEDULE: shape after warmup (linear and cosine decay over max_steps)."
    )
    min_lr_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="BUCKETRL_MIN_LR_RATIO: floor of the decay, as a fraction of lr."
    )
    # Loop.
    max_steps: int = Field(1000, ge=1, description="BUCKETRL_MAX_STEPS: optimizer steps of the whole run.")
    sync_every: int = Field(1, ge=1, description="BUCKETRL_SYNC_EVERY: publish a new adapter version every N steps.")
    checkpoint_every: int = Field(
        10, ge=1, description="BUCKETRL_CHECKPOINT_EVERY: checkpoint (then ack the consumed rollouts) every N steps."
    )
    micro_token_budget: int = Field(
        8192,
        ge=1,
        description="BUCKETRL_MICRO_TOKEN_BUDGET: padded tokens (sequences x longest) per micro-batch; "
        "lower it on out-of-memory errors.",
    )
    max_unscorable_fraction: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="BUCKETRL_MAX_UNSCORABLE_FRACTION: stop the run (exit 2, with the reward's first error of each "
        "kind) when more than this share of the completions the reward was given in the last 3 steps (fewer at the "
        "start: the first step's alone) had no reward (1 = never stop). Failed episodes are not the reward's: "
        "BUCKETRL_MAX_FAILED_EPISODE_FRACTION.",
    )
    max_failed_episode_fraction: float = Field(
        0.9,
        ge=0.0,
        le=1.0,
        description="BUCKETRL_MAX_FAILED_EPISODE_FRACTION: multi-turn runs: stop the run (exit 2, naming the agent's "
        "first error of each kind) when more than this share of the episodes of the last 3 steps failed (the agent "
        "reported an error, timed out, hit episode.max_turns; never trained); over half, each step warns.",
    )
    claim_wait_s: float = Field(
        2.0, gt=0.0, le=60.0, description="BUCKETRL_CLAIM_WAIT_S: long-poll of one claim (bounds SIGTERM latency)."
    )
    max_rollout_wait_s: float = Field(
        0.0, ge=0.0, description="BUCKETRL_MAX_ROLLOUT_WAIT_S: give up (exit 1) if a step waits longer; 0 = forever."
    )
    audit_log: str = Field(
        "",
        description="BUCKETRL_AUDIT_LOG: append a JSON line per start/resume/step/checkpoint (epoch, step, delivery "
        "ids) to this local file; empty = off. What the restart tests check invariant 4 with.",
    )
    log_level: str = Field("info", description="BUCKETRL_LOG_LEVEL: python logging level of the trainer.")
    mismatch_max_samples: int = Field(
        8,
        ge=0,
        description="BUCKETRL_MISMATCH_MAX_SAMPLES: per step, up to this many STALE samples get an extra no-grad "
        "forward under the exact version that generated them, so mismatch/logprob_abs_diff/{worker} is reported "
        "even when no sample is on-policy; 0 = on-policy samples only (free).",
    )
    final_eval_wait_s: float = Field(
        60.0,
        ge=0.0,
        le=3600.0,
        description="BUCKETRL_FINAL_EVAL_WAIT_S: at max_steps, wait up to this long for the generators to evaluate "
        "the final version (when the run's eval covers it) so its result reaches the trackers; 0 = do not wait.",
    )
    # Experiment trackers (bucketrl/trainer/trackers.py).
    report_to: str = Field(
        "none",
        description="BUCKETRL_REPORT_TO: TRL's report_to: comma-separated tensorboard, wandb, trackio; none; or all "
        "(every installed one). The libraries are the 'trackers' extra; a failing tracker never stops training.",
    )
    tracker_dir: str = Field(
        "runs",
        description="BUCKETRL_TRACKER_DIR: local directory of tracker files: TensorBoard event files in "
        "<dir>/tensorboard/<run>, wandb's files, trackio's database (<dir>/trackio unless TRACKIO_DIR is set).",
    )
    tracker_project: str = Field(
        "bucketrl", min_length=1, description="BUCKETRL_TRACKER_PROJECT: the wandb / trackio project name."
    )
    # Model.
    seed: int = Field(0, description="BUCKETRL_SEED: seeds LoRA init and the python/numpy/torch RNGs.")
    device: str = Field("auto", description="BUCKETRL_DEVICE: auto (cuda if available), cpu, cuda, cuda:1 ...")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="BUCKETRL_DTYPE: base model weights' dtype (LoRA weights stay float32)."
    )
    gradient_checkpointing: bool = Field(
        False, description="BUCKETRL_GRADIENT_CHECKPOINTING: trade compute for activation memory."
    )
    # Data parallelism (only read under torchrun; see bucketrl/trainer/distributed.py).
    dist_timeout_s: float = Field(
        900.0,
        gt=0.0,
        description="BUCKETRL_DIST_TIMEOUT_S: under torchrun, a collective that waits longer than this (a rank died "
        "or hangs) ends the job; keep it above BUCKETRL_OUTAGE_BUDGET_S, which rank 0 may spend riding out a proxy "
        "outage while the others wait.",
    )
    dist_heartbeat_s: float = Field(
        10.0,
        gt=0.0,
        description="BUCKETRL_DIST_HEARTBEAT_S: under torchrun, rank 0 tells the other ranks it is alive this often "
        "while it waits for rollouts (must be well below BUCKETRL_DIST_TIMEOUT_S).",
    )
    shard_base: bool = Field(
        False,
        description="BUCKETRL_SHARD_BASE: under torchrun, shard the frozen base model across the ranks with FSDP2 "
        "(fully_shard per transformer block): each rank holds 1/N of the base, for a base that does not fit one "
        "device; the LoRA adapter stays replicated and the update is the unsharded one. No effect in one process.",
    )
    work_dir: str = Field(
        "",
        description="BUCKETRL_WORK_DIR: local scratch where adapter/checkpoint files are written before they are "
        "packed and uploaded (nothing stays there); empty = the system temp dir.",
    )

    @field_validator("run_spec")
    @classmethod
    def _parsable(cls, v: str) -> str:
        if v.strip():
            # Raise at start-up, naming the setting: parse it and validate it as a RunSpec (a missing
            # dataset.size is filled in later by counting the dataset, so it is not an error here).
            data = _run_spec_dict(v)
            probe = json.loads(json.dumps(data))
            if isinstance(probe.get("dataset"), dict):
                probe["dataset"].setdefault("size", 1)
            try:
                RunSpec.model_validate(probe)
            except ValidationError as exc:
                raise ValueError(f"BUCKETRL_RUN_SPEC is not a valid run spec: {exc}") from exc
        return v

    @field_validator("report_to")
    @classmethod
    def _trackers_installed(cls, v: str) -> str:

        check_report_to(v)
        return v

    @model_validator(mode="after")
    def _heartbeat_below_timeout(self) -> TrainerSettings:
        if self.dist_heartbeat_s * 2 > self.dist_timeout_s:
            raise ValueError(
                f"BUCKETRL_DIST_HEARTBEAT_S ({self.dist_heartbeat_s}) must be at most half of BUCKETRL_DIST_TIMEOUT_S "
                f"({self.dist_timeout_s}): the other ranks would time out while rank 0 waits for rollouts"
            )
        return self

    @model_validator(mode="after")
    def _checkpoint_reachable(self) -> TrainerSettings:
        if self.lr_schedule != "constant" and self.warmup_steps >= self.max_steps:
            raise ValueError(
                f"BUCKETRL_WARMUP_STEPS ({self.warmup_steps}) must be < BUCKETRL_MAX_STEPS ({self.max_steps}) "
                f"for a decaying lr_schedule"
            )
        return self

    def run_spec_dict(self) -> dict[str, Any] | None:
        """The run spec as given (a dict, not yet validated: ``dataset.size`` may still be missing)."""
        return _run_spec_dict(self.run_spec) if self.run_spec.strip() else None

    def lr_factor(self, step: int) -> float:
        """Multiplier of ``lr`` for the optimizer step that makes ``step`` -> ``step + 1`` (0-based)."""

        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.lr_schedule == "constant":
            return 1.0
        span = max(1, self.max_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        shape = 1.0 - progress if self.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


def _run_spec_dict(value: str) -> dict[str, Any]:
    text = value.strip()
    if not text.startswith("{"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise ValueError(f"BUCKETRL_RUN_SPEC: {text!r} is neither inline JSON nor an existing file")
        text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"BUCKETRL_RUN_SPEC is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError("BUCKETRL_RUN_SPEC must be a JSON object (a RunSpec)")
    return data
