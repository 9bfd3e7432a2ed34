"""The REST contract's wire shapes (docs/design.md section 3), one module per concept.

Everything here imports with pydantic alone: no torch, no FastAPI, no Redis.
"""

from bucketrl.wire.adapters import AdapterVersionInfo
from bucketrl.wire.checkpoints import CheckpointInfo
from bucketrl.wire.errors import ErrorBody, ErrorDetail
from bucketrl.wire.evals import (
    EvalLease,
    EvalLeaseItem,
    EvalLeaseRequest,
    EvalResult,
    EvalSample,
    EvalSubmit,
    EvalSubmitResponse,
    EvalVersionResult,
)
from bucketrl.wire.leases import (
    PromptLease,
    PromptLeaseItem,
    PromptLeaseRequest,
    PromptReleaseRequest,
    VersionLease,
    VersionLeaseRequest,
)
from bucketrl.wire.metrics import MetricsPush, SampleCompletion
from bucketrl.wire.rollouts import (
    EPISODE_ERROR_PREFIX,
    AckRequest,
    AckResponse,
    ClaimRequest,
    ClaimResponse,
    Completion,
    Delivery,
    RolloutBatch,
    RolloutGroup,
    Segment,
    SubmitResponse,
    VersionSpan,
)
from bucketrl.wire.runs import (
    DatasetSpec,
    EnvSpec,
    EpisodeSpec,
    EvalSpec,
    LoraSpec,
    LossSpec,
    RewardSpec,
    RunInfo,
    RunSpec,
    RunState,
    SamplingSpec,
)
from bucketrl.wire.status import QueueStatus, RunStatus, TrainerStatus, VersionStatus, WorkerStatus
from bucketrl.wire.trainer import TrainerRegistration

__all__ = [
    "EPISODE_ERROR_PREFIX",
    "AckRequest",
    "AckResponse",
    "AdapterVersionInfo",
    "CheckpointInfo",
    "ClaimRequest",
    "ClaimResponse",
    "Completion",
    "DatasetSpec",
    "Delivery",
    "EnvSpec",
    "EpisodeSpec",
    "ErrorBody",
    "ErrorDetail",
    "EvalLease",
    "EvalLeaseItem",
    "EvalLeaseRequest",
    "EvalResult",
    "EvalSample",
    "EvalSpec",
    "EvalSubmit",
    "EvalSubmitResponse",
    "EvalVersionResult",
    "LoraSpec",
    "LossSpec",
    "MetricsPush",
    "PromptLease",
    "PromptLeaseItem",
    "PromptLeaseRequest",
    "PromptReleaseRequest",
    "QueueStatus",
    "RewardSpec",
    "RolloutBatch",
    "RolloutGroup",
    "RunInfo",
    "RunSpec",
    "RunState",
    "RunStatus",
    "SampleCompletion",
    "SamplingSpec",
    "Segment",
    "SubmitResponse",
    "TrainerRegistration",
    "TrainerStatus",
    "VersionLease",
    "VersionLeaseRequest",
    "VersionSpan",
    "VersionStatus",
    "WorkerStatus",
]
