"""Run spec: what a run trains, shared by every worker through the proxy.

``base_model``, ``lora``, ``adapter_dtype``, ``group_size``, ``vocab_size``, ``dataset``, ``env`` and
``partial_rollouts`` are immutable once the run exists (see :data:`IMMUTABLE_FIELDS`); the rest can be changed by a
later ``PUT /v1/runs/{run}``.
"""

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from bucketrl.wire.common import MAX_EPISODE_TOKENS, MAX_TURNS, MAX_WIRE_INT, ShortStr, StrictWireModel, WireModel

# ``env``: a generator decides at its start whether it runs single-turn completions or episodes.
# ``adapter_dtype``: the trainer resolves it once, and every version of a run ships in the one dtype.
# ``partial_rollouts``: whether a batch may carry version spans decides how the trainer reads every group of the
# run (a run switched mid-way would hold groups the proxy accepted under one rule and claims under the other).
IMMUTABLE_FIELDS: tuple[str, ...] = (
    "base_model",
    "lora",
    "adapter_dtype",
    "group_size",
    "vocab_size",
    "dataset",
    "env",
    "partial_rollouts",
)

# The dtype adapter versions cross the links in. ``auto``: bfloat16 when the base model's own dtype (its
# config.json ``torch_dtype``) is bfloat16, since vLLM then computes LoRA in bfloat16 and casts whatever it is
# given; float32 otherwise (the CPU demo). The trainer's master weights and checkpoints stay float32.
AdapterDtype = Literal["auto", "float32", "bfloat16", "float16"]
ShippedDtype = Literal["float32", "bfloat16", "float16"]


class LoraSpec(StrictWireModel):
    r: int = Field(8, ge=1, le=512)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # "all-linear" is peft's shorthand for every linear layer except the output head.
    target_modules: Annotated[list[ShortStr], Field(max_length=256)] | Literal["all-linear"] = "all-linear"


class SamplingSpec(StrictWireModel):
    temperature: float = Field(1.0, gt=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=1_000_000)
    max_new_tokens: int = Field(64, ge=1, le=65_536)

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, v: int) -> int:
        if v == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return v


class RewardSpec(StrictWireModel):
    # A registry name (math, exact, regex, toy) or a user function as "module:function".
    name: str = Field(..., min_length=1, max_length=200)
    kwargs: dict[str, Any] = Field(default_factory=dict, max_length=64)


class DatasetSpec(StrictWireModel):
    # "toy:<name>" for a built-in task, a JSONL path/URI, or a Hugging Face datasets name.
    uri: str = Field(..., min_length=1, max_length=1000)
    prompt_field: ShortStr = "prompt"
    answer_field: ShortStr = "answer"
    # Number of prompts in one pass; the proxy's prompt cursor wraps passes with it.
    size: int = Field(..., ge=1, le=MAX_WIRE_INT)
    split: ShortStr = "train"
    # True: the user knows the model's tokenizer reads some of this text as its unknown (or padding) token, and
    # trains anyway; the preflight refuses such a run otherwise (bucketrl.preflight.check_tokenizer_coverage).
    allow_lossy_tokenizer: bool = False


# TRL's ``loss_type`` names and the aggregation each means, for the message refusing them (TRL's ``bnpo``
# normalises per micro-batch, which no bucketrl option does).
TRL_LOSS_TYPES: dict[str, str] = {"grpo": "sequence", "dapo": "token", "dr_grpo": "constant"}


class LossSpec(StrictWireModel):
    # ppo_clip (TRL's token-level ratio), decoupled (AReaL's), gspo (sequence-level ratio): docs/training.md.
    objective: Literal["ppo_clip", "decoupled", "gspo"] = "ppo_clip"
    epsilon_low: float = Field(0.2, ge=0.0, le=1.0)
    epsilon_high: float = Field(0.28, ge=0.0, le=10.0)
    # Truncation cap C of the decoupled objective's importance weight min(pi_prox/pi_behav, C).
    is_cap: float = Field(2.0, gt=0.0)
    # How the step's per-token losses become one number: token (sum / the step's trained tokens), sequence (mean
    # per completion, then over completions), constant (Dr.GRPO: sum / (completions * constant_normalizer), so
    # no completion's own length scales its tokens' gradient). Dr.GRPO is constant with scale_rewards none.
    aggregation: Literal["token", "sequence", "constant"] = "token"
    # Tokens per completion in the constant aggregation's denominator (Dr.GRPO's generation budget; TRL's
    # max_completion_length, oat's generate_max_length). None: filled by the run spec with its sampling
    # max_new_tokens (multi-turn: episode.max_episode_tokens) when the spec is validated.
    constant_normalizer: int | None = Field(None, ge=1, le=MAX_EPISODE_TOKENS)
    scale_rewards: Literal["group", "none"] = "group"
    filter_zero_variance: bool = False
    kl_coef: float = Field(0.0, ge=0.0)
    # verl's entropy_coeff: minus this times the policy's entropy (its whole next-token distribution under the
    # sampling settings) per trained token, aggregated like the policy loss. Keeps a policy from settling on one
    # answer before the reward can tell answers apart; 0 computes nothing extra.
    entropy_coef: float = Field(0.0, ge=0.0, le=1.0)
    # TRL's name (DAPO's overlong filtering): completions cut by max_new_tokens (finish_reason "length") still
    # enter their group's advantage statistics but are not trained on. Aborted completions never are.
    mask_truncated_completions: bool = False

    @model_validator(mode="before")
    @classmethod
    def _trl_loss_type(cls, data: Any) -> Any:
        # TRL's spelling, refused with the field that means it: accepting it as an alias would leave two
        # spellings to disagree (a spec merged over defaults, as `bucketrl up --run-spec` does, has both).
        if isinstance(data, dict) and "loss_type" in data:
            name = data["loss_type"]
            means = TRL_LOSS_TYPES.get(name) if isinstance(name, str) else None
            if means is None:
                raise ValueError(
                    f"loss_type is TRL's field; bucketrl has aggregation token|sequence|constant, and TRL's "
                    f"{name!r} has no equivalent (grpo: sequence, dapo: token, dr_grpo: constant)"
                )
            hint = " (with scale_rewards 'none': the paper's Dr.GRPO)" if name == "dr_grpo" else ""
            raise ValueError(f"loss_type is TRL's field: write aggregation {means!r} for TRL's {name!r}{hint}")
        return data

    @model_validator(mode="after")
    def _constant_normalizer_needs_constant(self) -> "LossSpec":
        if self.constant_normalizer is not None and self.aggregation != "constant":
            raise ValueError(
                f"constant_normalizer is only used by aggregation 'constant' (Dr.GRPO), not {self.aggregation!r}: "
                "drop it or set aggregation constant"
            )
        return self


class EvalSpec(StrictWireModel):
    """Evaluation during training on the generator pool (bucketrl/proxy/state/evals.py)."""

    # Versions 1, 1 + every, 1 + 2 * every, ... are evaluated.
    every: int = Field(10, ge=1, le=1_000_000)
    # The eval set: a separate dataset, or (None) the run's dataset read with ``split``.
    dataset: DatasetSpec | None = None
    split: str = Field("test", min_length=1, max_length=200)
    # Prompts evaluated per version: the first ``size`` examples of the eval set.
    size: int = Field(64, ge=1, le=100_000)
    # Samples per prompt (pass@k is pass@n); with ``sampling`` None, n must be 1 (greedy).
    n: int = Field(1, ge=1, le=64)
    # None: greedy (top_k 1) with the run's max_new_tokens.
    sampling: SamplingSpec | None = None
    # A sample "passes" when its reward is >= this (pass@1, pass@k).
    pass_threshold: float = 1.0

    @model_validator(mode="after")
    def _greedy_is_one_sample(self) -> "EvalSpec":
        if self.sampling is None and self.n != 1:
            raise ValueError("eval.n > 1 needs eval.sampling (greedy decoding gives n identical samples)")
        return self

    def evaluates(self, version: int) -> bool:
        return version >= 1 and (version - 1) % self.every == 0


class EpisodeSpec(StrictWireModel):
    """Limits of a multi-turn episode (docs/design.md "Multi-turn trajectories"); single-turn runs ignore them."""

    # Model turns (model segments) per episode, over all of its samples when it is split.
    max_turns: int = Field(8, ge=1, le=MAX_TURNS)
    # Wall-clock limit of one episode (model turns + environment time); the generator ends it as "abort".
    episode_timeout_s: float = Field(300.0, gt=0.0, le=86_400.0)
    # Tokens of one training sample: its prompt plus all of its segments (what the trainer's forward holds).
    max_episode_tokens: int = Field(4096, ge=2, le=MAX_EPISODE_TOKENS)


class EnvSpec(StrictWireModel):
    """The environment that runs a multi-turn run's episodes on each generator (bucketrl/envs, issue 14)."""

    # "toy:tools" (built in), "module:Class" (imported by the generators, under the same allow-list as reward
    # modules: BUCKETRL_ALLOWED_REWARD_MODULES), or "external": no environment on the generators, agents outside
    # them take episodes through a generator's exposed OpenAI-compatible endpoint.
    name: str = Field(..., min_length=1, max_length=200)
    kwargs: dict[str, Any] = Field(default_factory=dict, max_length=64)


class RunSpec(StrictWireModel):
    base_model: str = Field(..., min_length=1, max_length=500)
    lora: LoraSpec = Field(default_factory=LoraSpec)
    # What the published adapter versions hold (see AdapterDtype); each version also records it. Immutable.
    adapter_dtype: AdapterDtype = "auto"
    group_size: int = Field(8, ge=2, le=1024)
    max_staleness: int = Field(4, ge=0, le=64)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    reward: RewardSpec
    dataset: DatasetSpec
    vocab_size: int = Field(..., ge=2, le=10_000_000)
    queue_capacity_groups: int = Field(256, ge=1, le=1_000_000)
    # Groups the trainer consumes per optimizer step; the proxy paces prompt leases with it.
    groups_per_step: int = Field(8, ge=1, le=100_000)
    loss: LossSpec = Field(default_factory=LossSpec)
    # Evaluation during training (None: off).
    eval: EvalSpec | None = None
    # Multi-turn episode limits (turns, timeout, tokens per sample).
    episode: EpisodeSpec = Field(default_factory=EpisodeSpec)
    # Multi-turn episodes run by this environment (None: single-turn completions). Immutable.
    env: EnvSpec | None = None
    # The run's weight on a shared generator pool (docs/pool.md): pool leases go to the run with the fewest
    # generated tokens per unit of share, so shares 2:1 get tokens 2:1 while both have work.
    share: float = Field(1.0, gt=0.0, le=1_000_000.0)
    # Cap on the tokens the pool generates for the run (None: no cap). Past it the run is skipped by pool
    # leases and refused per-run leases with 429: queued, never failed (raise it with a PUT to go on).
    budget_tokens: int | None = Field(None, ge=1, le=MAX_WIRE_INT)
    # Partial rollouts (issue 35): a generator whose call would outlive the staleness window continues its
    # unfinished completions under a newer version, and each completion says which version sampled which tokens
    # (``Completion.version_spans``). Off: the proxy refuses spans. Single-turn runs only. Immutable.
    partial_rollouts: bool = False

    @model_validator(mode="after")
    def _queue_holds_a_step(self) -> "RunSpec":
        if self.queue_capacity_groups < self.groups_per_step:
            raise ValueError(
                f"queue_capacity_groups ({self.queue_capacity_groups}) must be >= groups_per_step "
                f"({self.groups_per_step}) or the trainer can never fill a step"
            )
        return self

    @model_validator(mode="after")
    def _fill_constant_normalizer(self) -> "RunSpec":
        # Dr.GRPO's constant is the generation budget. Filled here, once, so that the trainer (which only sees
        # the loss settings) and GET /v1/runs show the number used; a later PUT keeps what it is sent.
        if self.loss.aggregation == "constant" and self.loss.constant_normalizer is None:
            budget = self.episode.max_episode_tokens if self.env is not None else self.sampling.max_new_tokens
            self.loss = self.loss.model_copy(update={"constant_normalizer": budget})
        return self

    @model_validator(mode="after")
    def _eval_is_single_turn(self) -> "RunSpec":
        # Generators evaluate by sampling single completions; a multi-turn run's episodes need its environment
        # (not built yet). Refused rather than never evaluated with nothing said.
        if self.eval is not None and self.env is not None:
            raise ValueError(
                "eval (evaluation during training) is not supported for multi-turn runs (env) yet: drop eval "
                "(or --eval-every)"
            )
        return self

    @model_validator(mode="after")
    def _partial_rollouts_are_single_turn(self) -> "RunSpec":
        # Episodes stay whole-version (an episode's turns are separate calls already); refused rather than a
        # setting that silently does nothing.
        if self.partial_rollouts and self.env is not None:
            raise ValueError(
                "partial_rollouts: multi-turn runs (env) keep each episode whole-version; drop partial_rollouts"
            )
        return self

    def eval_dataset(self) -> DatasetSpec | None:
        """The eval set as a dataset spec (``size`` = the prompts evaluated per version)."""
        if self.eval is None:
            return None
        base = self.eval.dataset or self.dataset.model_copy(update={"split": self.eval.split})
        return base.model_copy(update={"size": self.eval.size})

    def eval_sampling(self) -> SamplingSpec | None:
        if self.eval is None:
            return None
        return self.eval.sampling or SamplingSpec(temperature=1.0, top_k=1, max_new_tokens=self.sampling.max_new_tokens)

    def immutable_diff(self, other: "RunSpec") -> list[str]:
        """Names of immutable fields whose values differ between two specs."""
        return [f for f in IMMUTABLE_FIELDS if getattr(self, f) != getattr(other, f)]


class RunState(WireModel):
    latest_version: int = 0
    trainer_epoch: int = 0
    trainer_step: int = 0
    created_at: float
    updated_at: float


class RunInfo(WireModel):
    run: str
    spec: RunSpec
    state: RunState


def versions_left(version: int, latest: int, max_staleness: int) -> int:
    """How many more versions may be published before a group sampled at ``version`` is refused as stale (the
    proxy accepts it while ``version >= latest - max_staleness``); negative: it is stale now. The one definition the
    generator's admission control, staleness guard and warnings use."""
    return version + max_staleness - latest
