"""What ``bucketrl up`` runs: :class:`UpConfig` (the command's options) and the run spec it implies.

With no options this is the measured demo: the built-in tiny Qwen2 (``<dir>/model``, built locally), the
toy ``digits`` task (:mod:`bucketrl.tasks.toy`), lr ``DEMO_LR`` for ``DEMO_MAX_STEPS`` steps. ``model``,
``dataset`` and ``reward`` select a real setup; every run-spec knob left ``None`` keeps the default.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from bucketrl.tasks.tiny_model import VOCAB_SIZE
from bucketrl.tasks.toy import (
    ARABIC_DEMO_LR,
    ARABIC_DEMO_MAX_STEPS,
    ARABIC_WARM_START_STEPS,
    DEFAULT_SIZE,
    DEFAULT_TASK,
    DEMO_LR,
    DEMO_MAX_STEPS,
    TASKS,
    TOOLS_DEMO_MAX_STEPS,
    default_run_spec,
)
from bucketrl.trainer.trackers import check_report_to
from bucketrl.up.processes import RestartPolicy
from bucketrl.up.runs import RunEntry
from bucketrl.wire import RunSpec
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
    # Multi-turn: the environment that runs the episodes (run spec env.name); toy:tools sets its own.
    env: str | None = Field(None, min_length=1, description="Environment: toy:tools, module:Class or external.")
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    openai_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="One OpenAI-compatible URL for agents on this loopback port (0: a free one), spreading episodes "
        "over every generator's endpoint (bucketrl agent-router); its URL and token go to <dir>/endpoint.json.",
    )
    run_spec: Path | None = Field(
        None, description="A run spec JSON file (what the trainer takes in production); options override it."
    )
    # Several runs on the one machine's generators (bucketrl.up.runs, docs/pool.md): one trainer each, the
    # generators in pool mode serving them all. None: the one run `run`.
    runs: list[RunEntry] | None = Field(None, min_length=1)
    prompt_field: str | None = Field(None, min_length=1, description="The dataset's prompt field (default prompt).")
    answer_field: str | None = Field(None, min_length=1, description="The dataset's answer field (default answer).")
    allow_lossy_tokenizer: bool | None = Field(
        None, description="Train even though the model's tokenizer reads some of the dataset as unknown tokens."
    )
    lora_target_modules: list[str] | None = Field(
        None, description="Module-name suffixes LoRA wraps (default all-linear)."
    )
    max_steps: int | None = Field(None, ge=1)
    lr: float | None = Field(None, gt=0)
    group_size: int | None = Field(None, ge=2)
    groups_per_step: int | None = Field(None, ge=1)
    max_staleness: int | None = Field(None, ge=0)
    # Evaluate versions 1, 1 + N, ... on EVAL_SIZE prompts of the dataset's "test" split (toy tasks: a held-out
    # draw), greedy; None: no evaluation.
    eval_every: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, gt=0)
    max_new_tokens: int | None = Field(None, ge=1)
    lora_r: int | None = Field(None, ge=1)
    queue_capacity: int | None = Field(None, ge=1)
    sync_every: int = Field(1, ge=1)
    checkpoint_every: int = Field(10, ge=1)
    seed: int = 0
    # TRL's report_to: the trainer's experiment trackers (tensorboard, wandb, trackio; comma-separated, none or all).
    # None: BUCKETRL_REPORT_TO if set, else TensorBoard when it is installed.
    report_to: str | None = Field(None, description="Experiment trackers (TRL's report_to).")
    port: int | None = Field(None, ge=1, le=65535, description="Proxy port; default a free one.")
    bucket_url: str | None = Field(None, description="Default file://<dir>/bucket; s3://... works too.")
    redis_url: str | None = Field(None, description="External Redis; default an embedded redis-server.")
    threads: int = Field(1, ge=1, le=256, description="torch threads per worker process.")
    trainer_procs: int = Field(
        1, ge=1, le=64, description="Trainer ranks: >1 runs the trainer under torchrun as that many CPU ranks (gloo)."
    )
    trainer_shard_base: bool = Field(
        False, description="Shard the trainer's frozen base across its ranks with FSDP2 (needs trainer_procs > 1)."
    )
    # always: a SIGKILLed Redis loses nothing it acknowledged (what the chaos test runs). everysec may lose its last
    # second of acknowledged writes (accepted submits, acks, publishes), and the proxy cannot tell: that is a
    # rollback, not a wipe (the ready flags survive), so nothing is rebuilt from the bucket.
    redis_fsync: Literal["everysec", "always"] = "always"
    prompt_lease_ttl_s: float = Field(60.0, gt=1.0, description="A killed generator's prompts return after this.")
    # Give up on a service only when it keeps dying quickly: this many deaths within restart_window_s.
    restart_max_deaths: int = Field(5, ge=1, description="Deaths within restart_window_s that end the run.")
    restart_window_s: float = Field(60.0, gt=0, description="The window of restart_max_deaths, in seconds.")
    # Extra BUCKETRL_* variables for every worker / the trainer / the generators / the proxy.
    worker_env: dict[str, str] = Field(default_factory=dict)
    trainer_env: dict[str, str] = Field(default_factory=dict)
    generator_env: dict[str, str] = Field(default_factory=dict)
    proxy_env: dict[str, str] = Field(default_factory=dict)
    # Check model, dataset, LoRA targets, context and reward before starting anything (bucketrl.preflight).
    preflight: bool = True
    # Someone else trains (TRL's AsyncGRPOTrainer through `bucketrl gateway`): no bucketrl trainer is started, the
    # generators serve completion jobs, and `up` serves until Ctrl-C / SIGTERM.
    external_trainer: bool = Field(False, description="Start no trainer: generators serve an external trainer.")
    gateway_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Start `bucketrl gateway` (vLLM's routes for TRL) on this loopback port (0: a free one); its "
        "URL goes to <dir>/endpoint.json under gateway. Needs external_trainer.",
    )

    @field_validator("generator_engines")
    @classmethod
    def _non_empty(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not v:
            raise ValueError("generator_engines must name at least one engine (or be omitted)")
        return v

    @field_validator("report_to")
    @classmethod
    def _known_trackers(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                check_report_to(v)
            except ValueError as exc:
                # The trackers' own message names the variable; here the user typed the flag.
                raise ValueError(str(exc).replace("BUCKETRL_REPORT_TO", "--report-to")) from None
        return v

    @model_validator(mode="after")
    def _shard_needs_ranks(self) -> UpConfig:
        if self.trainer_shard_base and self.trainer_procs < 2:
            raise ValueError(
                "--trainer-shard-base shards the base across trainer ranks: add --trainer-procs 2 (or more)"
            )
        return self

    @model_validator(mode="after")
    def _external_trainer_options(self) -> UpConfig:
        if self.gateway_port is not None and not self.external_trainer:
            raise ValueError(
                "--gateway-port serves an external trainer (TRL's AsyncGRPOTrainer) and takes the run's trainer "
                "role from bucketrl's own: add --external-trainer"
            )
        if self.external_trainer:
            given = [f for f in TRAINER_ONLY if f in self.model_fields_set]
            if given:
                option = "--" + given[0].replace("_", "-")
                raise ValueError(
                    f"{option} is read by bucketrl's own trainer, which --external-trainer does not start: your "
                    "trainer sets it (drop the option)"
                )
        return self

    @model_validator(mode="after")
    def _several_runs(self) -> UpConfig:
        if self.runs is None:
            return self
        names = [r.run for r in self.runs]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"two runs named {twice[0]!r}: each run needs its own name")
        for field, option in (("run_spec", "--run-spec FILE alone"), ("external_trainer", "--external-trainer")):
            if getattr(self, field):
                raise ValueError(f"{option} is a one-run `up`: it does not combine with several runs")
        if self.openai_port is not None:
            raise ValueError("--openai-port serves a multi-turn run; several runs on one pool are single-turn")
        return self

    def for_run(self, entry: RunEntry) -> UpConfig:
        """The one-run options of one of several runs (its own id and run-spec file; everything else shared)."""
        return self.model_copy(update={"run": entry.run, "run_spec": entry.spec, "runs": None})

    @property
    def run_dir(self) -> Path:
        return (self.dir if self.dir is not None else Path("runs") / self.run).resolve()

    @property
    def builtin_model(self) -> bool:
        """Neither ``--model`` nor the ``--run-spec`` file names a base model: ``up`` builds the tiny one."""
        return self.model is None and "base_model" not in self._file_spec()

    def _file_spec(self) -> dict[str, Any]:
        """The ``--run-spec`` file's settings ({} without one; a file that cannot be read is reported by
        build_run_spec)."""
        if self.run_spec is None:
            return {}
        try:
            return _read_run_spec(self.run_spec)
        except ValueError:
            return {}

    def _file_dataset_uri(self) -> str | None:
        given = self._file_spec().get("dataset")
        uri = given.get("uri") if isinstance(given, dict) else None
        return uri if isinstance(uri, str) and uri else None

    @property
    def dataset_uri(self) -> str:
        """The run's dataset: ``--dataset``, else the ``--run-spec`` file's, else toy:<DEFAULT_TASK>."""
        return self.dataset or self._file_dataset_uri() or f"toy:{DEFAULT_TASK}"

    @property
    def is_demo(self) -> bool:
        """The built-in tiny model on a toy task, whether or not a ``--run-spec`` file tunes it (a loss option, say):
        the task's own lr and steps apply (the generic ones barely move the tiny model)."""
        return self.builtin_model and self.dataset_uri.startswith("toy:")

    @property
    def upload_path(self) -> Path | None:
        """A local JSONL dataset (``--dataset``, or the ``--run-spec`` file's): ``up`` uploads it to the run's bucket
        (generators elsewhere read it there)."""
        uri = self.dataset or self._file_dataset_uri()
        if uri is None or uri.startswith(("toy:", "bucket:")):
            return None
        path = Path(uri.removeprefix("file://")).expanduser()
        return path.resolve() if path.suffix in (".jsonl", ".json") else None

    @property
    def restart_policy(self) -> RestartPolicy:

        return RestartPolicy(self.restart_max_deaths, self.restart_window_s)

    def engine_of(self, index: int) -> Engine:
        if self.generator_engines:
            return self.generator_engines[index % len(self.generator_engines)]
        return self.engine

    def effective_max_steps(self) -> int:

        if self.max_steps:
            return self.max_steps
        if self.is_demo:
            return {"toy:tools": TOOLS_DEMO_MAX_STEPS, "toy:arabic-math": ARABIC_DEMO_MAX_STEPS}.get(
                self.dataset_uri, DEMO_MAX_STEPS
            )
        return 200

    @property
    def _arabic_demo(self) -> bool:
        return self.is_demo and self.dataset_uri == "toy:arabic-math"

    def warm_start_steps(self) -> int:
        """The built-in model's warm start (toy:arabic-math's: a random model does not learn sums from a reward)."""
        return ARABIC_WARM_START_STEPS if self._arabic_demo else 0

    def demo_lr_schedule(self) -> str | None:
        """toy:arabic-math's lr decays linearly to 0 (at a constant lr its policy collapsed onto one digit after
        ~650 of 800 steps in one of two runs); a BUCKETRL_LR_SCHEDULE of the user's own wins, as for every task."""
        return "linear" if self._arabic_demo and "BUCKETRL_LR_SCHEDULE" not in os.environ else None

    def effective_lr(self) -> float:

        demo_lr = ARABIC_DEMO_LR if self.dataset_uri == "toy:arabic-math" else DEMO_LR
        return self.lr or (demo_lr if self.is_demo else 1e-5)


# Options only bucketrl's trainer (or its dataset and reward) reads: with external_trainer they would do nothing.
TRAINER_ONLY = (
    "max_steps",
    "lr",
    "sync_every",
    "checkpoint_every",
    "seed",
    "report_to",
    "trainer_procs",
    "trainer_shard_base",
    "eval_every",
    "dataset",
    "reward",
    "reward_kwargs",
    "prompt_field",
    "answer_field",
    "env",
    "env_kwargs",
    "openai_port",
)

SAVED_OPTIONS = "up_options.json"


# Prompts per evaluated version in `bucketrl up --eval-every` (greedy: one sample each).
EVAL_SIZE = 32


def load_saved_options(run: str | None, dir: Path | None) -> dict[str, Any]:
    """The options of the run directory's first ``bucketrl up`` (a resume without options repeats them)."""
    run_dir = dir if dir is not None else Path("runs") / (run or "demo")
    path = run_dir / SAVED_OPTIONS
    if not path.exists():
        return {}
    try:
        saved = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return {k: v for k, v in saved.items() if k in UpConfig.model_fields and k not in ("dir", "port")}


def save_options(cfg: UpConfig) -> None:
    """Write what :func:`load_saved_options` reads (only the options that differ from the defaults)."""
    data = cfg.model_dump(mode="json", exclude_defaults=True, exclude={"dir", "port"})
    if cfg.upload_path is not None:
        data["dataset"] = str(cfg.upload_path)
    if cfg.run_spec is not None:
        data["run_spec"] = str(cfg.run_spec.expanduser().resolve())
    for entry, saved in zip(cfg.runs or [], data.get("runs", []), strict=True):
        if entry.spec is not None:
            saved["spec"] = str(entry.spec.expanduser().resolve())
    (cfg.run_dir / SAVED_OPTIONS).write_text(json.dumps(data, indent=2) + "\n")


def _read_run_spec(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.expanduser().read_text())
    except OSError as exc:
        raise ValueError(f"--run-spec {path}: cannot read it: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"--run-spec {path}: not JSON: {exc.msg} (line {exc.lineno})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"--run-spec {path}: not a JSON object")
    return data


def build_run_spec(
    cfg: UpConfig, model_dir: Path | None, *, vocab_size: int | None = None, max_new_tokens: int | None = None
) -> dict[str, Any]:
    """The run spec as a dict (``dataset.size`` is left out for non-toy datasets: the trainer counts them).

    Starts from ``--run-spec`` when given, else from the toy task's spec (or common GRPO defaults for a real
    dataset); every option given overrides. ``vocab_size`` / ``max_new_tokens``: what the preflight found in
    the model (used when neither the file nor an option sets them)."""

    given = _read_run_spec(cfg.run_spec) if cfg.run_spec is not None else {}
    uri = cfg.dataset or (given.get("dataset") or {}).get("uri") or cfg.dataset_uri
    upload = cfg.upload_path
    if uri.startswith("bucket:") and upload is None and cfg.dataset is not None:
        raise ValueError(
            f"--dataset {uri}: pass the local .jsonl file instead; bucketrl up uploads it to the run's bucket "
            "(as bucket:dataset.jsonl) for the generators"
        )
    toy_task = uri.removeprefix("toy:") if uri.startswith("toy:") else None
    if toy_task is not None and toy_task not in TASKS:
        raise ValueError(f"--dataset {uri}: unknown toy task; choose one of {', '.join('toy:' + t for t in TASKS)}")
    base_model = _base_model(cfg, given, model_dir)
    spec: dict[str, Any] = default_run_spec(base_model, task=toy_task or "digits").model_dump(mode="json")
    if toy_task is None:
        # A real dataset: the toy's sampling settings make no sense; use common GRPO defaults.
        spec["sampling"] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": max_new_tokens or 512}
        spec["reward"] = {"name": "math", "kwargs": {}}
        spec["queue_capacity_groups"] = 256
    for key, value in given.items():  # the file's settings over the defaults (nested dicts merged)
        spec[key] = {**spec[key], **value} if isinstance(value, dict) and isinstance(spec.get(key), dict) else value
    spec["base_model"] = base_model
    dataset = dict(spec["dataset"]) if toy_task is None else {**spec["dataset"], "size": DEFAULT_SIZE}
    if toy_task is None:
        dataset = {k: v for k, v in dataset.items() if k != "size"}
        dataset.setdefault("prompt_field", "prompt")
        dataset.setdefault("answer_field", "answer")
    dataset["uri"] = "bucket:dataset.jsonl" if upload is not None else uri
    if cfg.prompt_field is not None:
        dataset["prompt_field"] = cfg.prompt_field
    if cfg.answer_field is not None:
        dataset["answer_field"] = cfg.answer_field
    if cfg.allow_lossy_tokenizer is not None:
        dataset["allow_lossy_tokenizer"] = cfg.allow_lossy_tokenizer
    spec["dataset"] = dataset
    if "vocab_size" not in given or cfg.model is not None:
        spec["vocab_size"] = VOCAB_SIZE if base_model == str(model_dir) else vocab_size or spec["vocab_size"]
    _apply_options(spec, cfg)
    spec["queue_capacity_groups"] = max(spec["queue_capacity_groups"], spec["groups_per_step"])
    _validate(spec)
    return spec


def _base_model(cfg: UpConfig, given: dict[str, Any], model_dir: Path | None) -> str:
    """``--model``, else the run-spec file's, else the built-in tiny model's directory."""
    if cfg.model is not None:
        local = Path(cfg.model).expanduser()
        # A local directory by its absolute path: workers started elsewhere (or a resume from another
        # directory) find the same model.
        return str(local.resolve()) if local.exists() else str(cfg.model)
    if "base_model" in given:
        return str(given["base_model"])
    return str(model_dir)


def _apply_options(spec: dict[str, Any], cfg: UpConfig) -> None:
    """The options given (env, reward, group and sampling sizes, LoRA, queue, eval) over ``spec``, in place."""
    if cfg.env is not None:
        spec["env"] = {"name": cfg.env, "kwargs": dict(cfg.env_kwargs)}
    elif cfg.env_kwargs and spec.get("env"):
        spec["env"]["kwargs"].update(cfg.env_kwargs)
    if cfg.openai_port is not None and not spec.get("env"):
        raise ValueError("--openai-port serves episodes of a multi-turn run: add --env (or use --dataset toy:tools)")
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
    if cfg.lora_target_modules is not None:
        spec["lora"]["target_modules"] = list(cfg.lora_target_modules)
    if cfg.queue_capacity is not None:
        spec["queue_capacity_groups"] = cfg.queue_capacity
    if cfg.eval_every is not None:
        spec["eval"] = {"every": cfg.eval_every, "split": "test", "size": EVAL_SIZE}


def max_new_tokens_given(cfg: UpConfig) -> bool:
    """Whether the user chose max_new_tokens (an option, or the run-spec file), or the preflight may. A toy task's
    own sampling settings stand (``build_run_spec`` takes them from the task, a run-spec file's over them), so the
    preflight never chooses one for it: it would report a length the spec does not have."""
    if cfg.max_new_tokens is not None or cfg.dataset_uri.startswith("toy:"):
        return True
    given = _read_run_spec(cfg.run_spec) if cfg.run_spec is not None else {}
    return "max_new_tokens" in (given.get("sampling") or {})


def _validate(spec: dict[str, Any]) -> None:

    probe = json.loads(json.dumps(spec))
    probe["dataset"].setdefault("size", 1)
    RunSpec.model_validate(probe)  # raises pydantic.ValidationError naming the field
