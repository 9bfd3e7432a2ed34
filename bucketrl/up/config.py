"""What ``bucketrl up`` runs: :class:`UpConfig` (the command's options) and the run spec it implies.

With no options this is the measured demo: the built-in tiny Qwen2 (``<dir>/model``, built locally), the
toy ``digits`` task (:mod:`bucketrl.tasks.toy`), lr ``DEMO_LR`` for ``DEMO_MAX_STEPS`` steps. ``model``,
``dataset`` and ``reward`` select a real setup; every run-spec knob left ``None`` keeps the default.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from bucketrl.wire.common import ID_PATTERN

if TYPE_CHECKING:
    from bucketrl.up.processes import RestartPolicy

Engine = Literal["transformers", "vllm"]


class UpConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run: str = Field("demo", pattern=ID_PATTERN)
    dir: Path | None = Field(None, description="Run directory; default ./runs/<run>.")
    generators: int = Field(2, ge=0, le=64)
    engine: Engine = "transformers"
    # Per-generator engines (e.g. ["transformers", "vllm"]); default: `engine` for all.
    generator_engines: list[Engine] | None = None
    model: str | None = Field(None, description="Base model path or hub name; None = the built-in tiny model.")
    dataset: str | None = Field(None, description="Dataset URI; None = toy:<DEFAULT_TASK>.")
    reward: str | None = Field(None, description="Reward name; None = toy for toy datasets, else math.")
    reward_kwargs: dict[str, Any] = Field(default_factory=dict)
    max_steps: int | None = Field(None, ge=1)
    lr: float | None = Field(None, gt=0)
    group_size: int | None = Field(None, ge=2)
    groups_per_step: int | None = Field(None, ge=1)
    max_staleness: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, gt=0)
    max_new_tokens: int | None = Field(None, ge=1)
    lora_r: int | None = Field(None, ge=1)
    queue_capacity: int | None = Field(None, ge=1)
    sync_every: int = Field(1, ge=1)
    checkpoint_every: int = Field(10, ge=1)
    seed: int = 0
    port: int | None = Field(None, ge=1, le=65535, description="Proxy port; default a free one.")
    bucket_url: str | None = Field(None, description="Default file://<dir>/bucket; s3://... works too.")
    redis_url: str | None = Field(None, description="External Redis; default an embedded redis-server.")
    threads: int = Field(1, ge=1, le=256, description="torch threads per worker process.")
    # everysec: a Redis crash may lose its last second (the proxy rebuilds from the bucket); always: none.
    redis_fsync: Literal["everysec", "always"] = "everysec"
    prompt_lease_ttl_s: float = Field(60.0, gt=1.0, description="A killed generator's prompts return after this.")
    # Give up on a service only when it keeps dying quickly: this many deaths within restart_window_s.
    restart_max_deaths: int = Field(5, ge=1, description="Deaths within restart_window_s that end the run.")
    restart_window_s: float = Field(60.0, gt=0, description="The window of restart_max_deaths, in seconds.")
    # Extra BUCKETRL_* variables for every worker / the trainer / the generators / the proxy.
    worker_env: dict[str, str] = Field(default_factory=dict)
    trainer_env: dict[str, str] = Field(default_factory=dict)
    generator_env: dict[str, str] = Field(default_factory=dict)
    proxy_env: dict[str, str] = Field(default_factory=dict)

    @field_validator("generator_engines")
    @classmethod
    def _non_empty(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not v:
            raise ValueError("generator_engines must name at least one engine (or be omitted)")
        return v

    @property
    def run_dir(self) -> Path:
        return (self.dir if self.dir is not None else Path("runs") / self.run).resolve()

    @property
    def builtin_model(self) -> bool:
        return self.model is None

    @property
    def dataset_uri(self) -> str:
        from bucketrl.tasks.toy import DEFAULT_TASK

        return self.dataset or f"toy:{DEFAULT_TASK}"

    @property
    def is_demo(self) -> bool:
        """The measured default: tiny model on a toy task."""
        return self.builtin_model and self.dataset_uri.startswith("toy:")

    @property
    def restart_policy(self) -> RestartPolicy:
        from bucketrl.up.processes import RestartPolicy

        return RestartPolicy(self.restart_max_deaths, self.restart_window_s)

    def engine_of(self, index: int) -> Engine:
        if self.generator_engines:
            return self.generator_engines[index % len(self.generator_engines)]
        return self.engine

    def effective_max_steps(self) -> int:
        from bucketrl.tasks.toy import DEMO_MAX_STEPS

        return self.max_steps or (DEMO_MAX_STEPS if self.is_demo else 200)

    def effective_lr(self) -> float:
        from bucketrl.tasks.toy import DEMO_LR

        return self.lr or (DEMO_LR if self.is_demo else 1e-5)


def _vocab_size(model: str) -> int:
    from transformers import AutoConfig  # only for a user-named model

    config = AutoConfig.from_pretrained(model)
    text = getattr(config, "get_text_config", lambda: config)()
    return int(text.vocab_size)


def build_run_spec(cfg: UpConfig, model_dir: Path | None) -> dict[str, Any]:
    """The run spec as a dict (``dataset.size`` is left out for non-toy datasets: the trainer counts them)."""
    from bucketrl.tasks.tiny_model import VOCAB_SIZE
    from bucketrl.tasks.toy import DEFAULT_SIZE, TASKS, default_run_spec

    uri = cfg.dataset_uri
    toy_task = uri.removeprefix("toy:") if uri.startswith("toy:") else None
    if toy_task is not None and toy_task not in TASKS:
        raise ValueError(f"--dataset {uri}: unknown toy task; choose one of {', '.join('toy:' + t for t in TASKS)}")
    base_model = str(model_dir) if cfg.builtin_model else str(cfg.model)
    spec: dict[str, Any] = default_run_spec(base_model, task=toy_task or "digits").model_dump(mode="json")
    spec["vocab_size"] = VOCAB_SIZE if cfg.builtin_model else _vocab_size(base_model)
    if toy_task is None:
        # A real dataset: the toy's sampling settings make no sense; use common GRPO defaults.
        spec["dataset"] = {"uri": uri, "prompt_field": "prompt", "answer_field": "answer"}
        spec["sampling"] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 512}
        spec["reward"] = {"name": cfg.reward or "math", "kwargs": dict(cfg.reward_kwargs)}
        spec["queue_capacity_groups"] = 256
    else:
        spec["dataset"]["size"] = DEFAULT_SIZE
        if cfg.reward:
            spec["reward"] = {"name": cfg.reward, "kwargs": dict(cfg.reward_kwargs)}
        elif cfg.reward_kwargs:
            spec["reward"]["kwargs"].update(cfg.reward_kwargs)
    if cfg.group_size is not None:
        spec["group_size"] = cfg.group_size
    if cfg.groups_per_step is not None:
        spec["groups_per_step"] = cfg.groups_per_step
    if cfg.max_staleness is not None:
        spec["max_staleness"] = cfg.max_staleness
    if cfg.temperature is not None:
        spec["sampling"]["temperature"] = cfg.temperature
    if cfg.max_new_tokens is not None:
        spec["sampling"]["max_new_tokens"] = cfg.max_new_tokens
        if spec["reward"]["name"] == "toy":
            spec["reward"]["kwargs"]["length"] = cfg.max_new_tokens
    if cfg.lora_r is not None:
        spec["lora"]["r"] = cfg.lora_r
        spec["lora"]["alpha"] = 2.0 * cfg.lora_r
    if cfg.queue_capacity is not None:
        spec["queue_capacity_groups"] = cfg.queue_capacity
    spec["queue_capacity_groups"] = max(spec["queue_capacity_groups"], spec["groups_per_step"])
    _validate(spec)
    return spec


def _validate(spec: dict[str, Any]) -> None:
    from bucketrl.wire import RunSpec

    probe = json.loads(json.dumps(spec))
    probe["dataset"].setdefault("size", 1)
    RunSpec.model_validate(probe)  # raises pydantic.ValidationError naming the field
