"""Rollout batches (generator -> proxy) and deliveries (proxy -> trainer)."""

import math
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, field_validator, model_validator

from bucketrl.wire.common import (
    MAX_COMPLETION_TOKENS,
    MAX_EPISODE_TOKENS,
    MAX_PROMPT_TOKENS,
    MAX_TURNS,
    LeaseId,
    RequestId,
    Version,
    WireInt,
    WireModel,
    WorkerId,
)
from bucketrl.wire.leases import PromptLease, PromptLeaseRequest
from bucketrl.wire.packed import NumericArray, all_finite_non_positive
from bucketrl.wire.runs import SamplingSpec

FinishReason = Literal["stop", "length", "abort"]
SegmentKind = Literal["model", "env"]

# Upper bounds no legal run exceeds (tightened per run in validate_batch): alternating segments of at most
# MAX_TURNS model turns, and the completions of a group whose G <= 1024 episodes are split into samples.
MAX_SEGMENTS = 2 * MAX_TURNS
MAX_GROUP_COMPLETIONS = 16_384
# A completion's version spans (partial rollouts): one per version that sampled some of it. A static cap only; a
# call continued that often has long left the staleness window.
MAX_VERSION_SPANS = 1024

# Lists of numbers a msgpack body may carry packed (wire/packed.py): a field typed with one of these is packed
# by packed.packb and checked in numpy passes when it arrives packed, in any model (a new field too). Token ids
# are >= 0 (their bound, the run's vocab_size, is checked per run in validate_batch); logprobs finite and <= 0.
# The same rules hold for the plain list form. Either form may reach a validator below: a list, or (at the
# proxy, context KEEP_ARRAYS) a numpy array, so they use len() and never a list's truth value.
PromptTokenIds = Annotated[
    list[int], NumericArray("int", min_length=1, max_length=MAX_PROMPT_TOKENS, non_negative=True)
]
SegmentTokenIds = Annotated[
    list[int], NumericArray("int", min_length=1, max_length=MAX_EPISODE_TOKENS, non_negative=True)
]
SegmentLogprobs = Annotated[
    list[float], NumericArray("float", min_length=1, max_length=MAX_EPISODE_TOKENS, logprob=True)
]
# A completion's flat fields: empty when a multi-turn completion derives them from its segments.
FlatTokenIds = Annotated[list[int], NumericArray("int", max_length=MAX_COMPLETION_TOKENS, non_negative=True)]
FlatLogprobs = Annotated[list[float], NumericArray("float", max_length=MAX_COMPLETION_TOKENS, logprob=True)]


class Segment(WireModel):
    """A run of tokens of one multi-turn trajectory: the MODEL's (sampled, trained on, with their behaviour
    logprobs) or the ENVIRONMENT's (tool results, user turns, the chat template's role headers: in context,
    never trained, no logprobs)."""

    kind: SegmentKind
    token_ids: SegmentTokenIds
    # Required on a model segment (logprobs[i] belongs to token_ids[i]); absent on an env segment.
    logprobs: SegmentLogprobs | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "Segment":
        if self.kind == "env":
            if self.logprobs is not None:
                raise ValueError("logprobs: an env segment carries none (its tokens are context, never trained)")
            return self
        if self.logprobs is None:
            raise ValueError("logprobs: a model segment needs one behaviour logprob per token")
        _check_logprobs(self.token_ids, self.logprobs)
        return self


class VersionSpan(WireModel):
    """Tokens ``token_ids[start:end]`` of a completion, sampled by adapter ``version`` (partial rollouts: a call
    interrupted by a newer version goes on under it, docs/design.md "Partial rollouts"). Half-open, never empty."""

    version: Version
    start: int = Field(..., ge=0, lt=MAX_COMPLETION_TOKENS)
    end: int = Field(..., ge=1, le=MAX_COMPLETION_TOKENS)


class _Derived(list):
    """A multi-turn completion's flat ``token_ids``/``logprobs``, computed from its segments: never serialised
    (each token travels once; a peer that does not know segments refuses the completion instead of training on
    environment tokens)."""


def _is_derived(value: object) -> bool:
    return isinstance(value, _Derived)


def _is_none(value: object) -> bool:
    # A single-turn completion serialises with exactly the keys and bytes it had before multi-turn existed (the
    # same batch digest, claim answers an older trainer reads).
    return value is None


def _is_empty(value: object) -> bool:
    # A group without episode stats (every single-turn group) serialises with the bytes it had before them.
    return not value


# A group's episode sums (RolloutGroup.episode_stats): a short name -> a finite, non-negative number.
EpisodeStatName = Annotated[str, StringConstraints(min_length=1, max_length=32, pattern=r"^[a-z0-9_]+$")]
EpisodeStatValue = Annotated[float, Field(ge=0.0, le=1e12, allow_inf_nan=False)]
MAX_EPISODE_STATS = 16
# reward_errors keys of an episode that failed (aborted: the agent, a timeout, the turn limit), not its reward.
EPISODE_ERROR_PREFIX = "episode:"


class Completion(WireModel):
    """One sampled completion: single-turn (``token_ids`` + ``logprobs``) or a multi-turn trajectory
    (``segments``), docs/design.md "Multi-turn trajectories".

    Single-turn (what every worker sent before multi-turn existed, unchanged): the prompt is the group's
    ``prompt_token_ids`` and every token of ``token_ids`` is the model's.

    Multi-turn: send ``segments`` and NOT ``token_ids``/``logprobs``. The flat fields are DERIVED on
    validation (the concatenation of the segments' tokens; the model segments' logprobs with 0.0 at env
    positions), so code reading ``token_ids``/``logprobs`` sees the whole sequence after the prompt, and
    :meth:`loss_mask` says which positions are trained. They are never serialised next to ``segments``: the
    wire and the bucket carry each token once, and a peer that does not know ``segments`` refuses the
    completion (no ``token_ids``) instead of training on environment tokens. Segments alternate in kind, the
    first and the last are ``model`` (the prompt precedes the first; trailing env tokens would train nothing).

    A chat template that re-renders history (a later turn's prompt is not the previous prompt + completion
    extended) splits an episode into several completions (samples) of one group: each later sample carries its
    own ``prompt_token_ids`` (overriding the group's), and every completion of the group carries ``episode``
    (0..G-1), the episode it belongs to. A group then holds G episodes, not G completions; the samples of one
    episode are consecutive, in turn order, and repeat the episode's ``reward`` and ``finish_reason``: its
    advantage is computed once per episode and given to each of its samples.
    """

    # Single-turn: at most the batch's sampling.max_new_tokens (checked per run in validate_batch); this is the
    # static cap. Multi-turn: derived from ``segments`` (do not send both).
    token_ids: FlatTokenIds = Field(default_factory=list, exclude_if=_is_derived)
    # logprobs[i] is the behaviour logprob of token_ids[i] (temperature applied before log-softmax); 0.0 at the
    # env positions of a multi-turn completion (never used: the loss mask is 0 there).
    logprobs: FlatLogprobs = Field(default_factory=list, exclude_if=_is_derived)
    # None = the reward function could not score this completion.
    reward: float | None
    finish_reason: FinishReason = "stop"
    # Multi-turn: the trajectory after the prompt (see the class docstring).
    segments: list[Segment] | None = Field(
        None, min_length=1, max_length=MAX_SEGMENTS, fail_fast=True, exclude_if=_is_none
    )
    # A split sample's own prompt (None: the group's prompt_token_ids). Multi-turn only.
    prompt_token_ids: PromptTokenIds | None = Field(None, exclude_if=_is_none)
    # The episode (0..group_size-1) this sample belongs to when episodes are split; set on every completion of
    # the group or on none (None: each completion is its own episode). Multi-turn only.
    episode: int | None = Field(None, ge=0, le=1023, exclude_if=_is_none)
    # Partial rollouts (a run with ``partial_rollouts``; single-turn only): which version sampled which tokens,
    # contiguous spans in order covering every token, versions non-decreasing, the last one at most the batch's
    # ``version`` (a completion that ended before its siblings went on under a newer version keeps its own).
    # None: the batch's ``version`` sampled every token (omitted then: bytes as before spans).
    version_spans: list[VersionSpan] | None = Field(
        None, min_length=1, max_length=MAX_VERSION_SPANS, fail_fast=True, exclude_if=_is_none
    )

    @model_validator(mode="after")
    def _consistent(self) -> "Completion":
        if self.version_spans is not None:
            if self.segments is not None:
                raise ValueError("version_spans: multi-turn completions (segments) are whole-version; send no spans")
            _check_spans(self.version_spans, len(self.token_ids))
        if self.segments is None:
            if self.prompt_token_ids is not None or self.episode is not None:
                raise ValueError("prompt_token_ids and episode belong to multi-turn completions (send segments)")
            if not len(self.token_ids):
                raise ValueError("token_ids: at least 1 token (or a multi-turn completion's segments)")
            _check_logprobs(self.token_ids, self.logprobs)
        elif not isinstance(self.token_ids, _Derived):  # derived already: pydantic re-runs this on an instance
            if len(self.token_ids) or len(self.logprobs):
                raise ValueError("token_ids/logprobs: derived from segments; send segments alone")
            self._derive_flat(self.segments)
        if self.reward is not None and not math.isfinite(self.reward):
            raise ValueError("reward must be finite or null")
        return self

    def _derive_flat(self, segments: list[Segment]) -> None:
        for i, seg in enumerate(segments):
            if i > 0 and seg.kind == segments[i - 1].kind:
                raise ValueError(f"segments[{i}]: two {seg.kind} segments in a row (merge them)")
        if segments[0].kind != "model" or segments[-1].kind != "model":
            which = 0 if segments[0].kind != "model" else len(segments) - 1
            raise ValueError(
                f"segments[{which}]: the first and last segments must be model segments "
                "(the prompt precedes the first; trailing env tokens train nothing)"
            )
        total = sum(len(s.token_ids) for s in segments)
        if total > MAX_EPISODE_TOKENS:
            raise ValueError(f"segments: {total} tokens, more than {MAX_EPISODE_TOKENS}")
        tokens: list[int] = []
        logprobs: list[float] = []
        for seg in segments:  # (lists: segments that arrived packed and stayed arrays at the proxy become lists)
            tokens += _as_list(seg.token_ids)
            logprobs += _as_list(seg.logprobs) if seg.logprobs is not None else [0.0] * len(seg.token_ids)
        self.token_ids, self.logprobs = _Derived(tokens), _Derived(logprobs)

    @classmethod
    def from_segments(
        cls,
        segments: Iterable[Segment | tuple[SegmentKind, list[int], list[float] | None]],
        reward: float | None,
        finish_reason: FinishReason = "stop",
        *,
        prompt_token_ids: list[int] | None = None,
        episode: int | None = None,
    ) -> "Completion":
        """A multi-turn completion from the episode's segments, in order (``Segment`` or ``(kind, token_ids,
        logprobs)``): adjacent segments of one kind are merged, empty ones and trailing env segments dropped.
        Raises ``ValueError`` (pydantic's ValidationError) if what is left is not a valid trajectory."""
        merged: list[Segment] = []
        for seg in segments:
            if not isinstance(seg, Segment):
                kind, ids, lps = seg
                if not ids:
                    continue
                seg = Segment(kind=kind, token_ids=list(ids), logprobs=None if lps is None else list(lps))
            if merged and merged[-1].kind == seg.kind:
                last = merged[-1]
                lps_merged = None if seg.logprobs is None else [*(last.logprobs or []), *seg.logprobs]
                merged[-1] = Segment(kind=seg.kind, token_ids=[*last.token_ids, *seg.token_ids], logprobs=lps_merged)
            else:
                merged.append(seg)
        while merged and merged[-1].kind == "env":
            merged.pop()
        return cls.model_validate(
            {
                "segments": merged,
                "reward": reward,
                "finish_reason": finish_reason,
                "prompt_token_ids": prompt_token_ids,
                "episode": episode,
            }
        )

    @property
    def multi_turn(self) -> bool:
        return self.segments is not None

    def loss_mask(self) -> list[int]:
        """Per position of ``token_ids``: 1 = a model token (trained), 0 = an environment token (context)."""
        if self.segments is None:
            return [1] * len(self.token_ids)
        mask: list[int] = []
        for seg in self.segments:
            mask += [1 if seg.kind == "model" else 0] * len(seg.token_ids)
        return mask

    def token_versions(self, version: int) -> list[int]:
        """The version that sampled each token of ``token_ids``; ``version`` (the batch's) for a completion
        without spans."""
        if self.version_spans is None:
            return [version] * len(self.token_ids)
        out: list[int] = []
        for span in self.version_spans:
            out += [span.version] * (span.end - span.start)
        return out

    def turns(self) -> int:
        """Model turns: the number of model segments (1 for a single-turn completion)."""
        return 1 if self.segments is None else sum(1 for s in self.segments if s.kind == "model")

    def model_tokens(self) -> int:
        """Tokens the loss may train on (every token of a single-turn completion)."""
        if self.segments is None:
            return len(self.token_ids)
        return sum(len(s.token_ids) for s in self.segments if s.kind == "model")


def _check_logprobs(token_ids: list[int], logprobs: list[float]) -> None:
    # Their values were checked by their types (TokenIds, Logprobs...), in either form.
    if len(token_ids) != len(logprobs):
        raise ValueError(f"logprobs has {len(logprobs)} entries but token_ids has {len(token_ids)}")


def _check_spans(spans: list[VersionSpan], n_tokens: int) -> None:
    at = 0
    for i, span in enumerate(spans):
        if span.start != at:
            what = "a gap" if span.start > at else "an overlap"
            raise ValueError(f"version_spans[{i}]: starts at {span.start}, {what} after the tokens before ({at})")
        if span.end <= span.start:
            raise ValueError(f"version_spans[{i}]: [{span.start}, {span.end}) is empty (send only spans with tokens)")
        if i and span.version < spans[i - 1].version:
            raise ValueError(
                f"version_spans[{i}]: version {span.version} after {spans[i - 1].version} (a continuation only goes "
                "on under a newer version)"
            )
        at = span.end
    if at != n_tokens:
        raise ValueError(f"version_spans: cover tokens [0, {at}) but token_ids has {n_tokens}")


def _check_newest_span(groups: "list[RolloutGroup]", version: int) -> None:
    """No completion's last span is newer than the batch's ``version`` (the newest version that sampled a token of
    the batch). Older is fine: a completion that finished before its siblings went on under a newer version keeps
    its own spans (partial rollouts), and a delivery of one group of such a batch may hold only those."""
    for g, group in enumerate(groups):
        for c, comp in enumerate(group.completions):
            if comp.version_spans is not None and (last := comp.version_spans[-1].version) > version:
                raise ValueError(
                    f"groups[{g}].completions[{c}].version_spans: the last span's version {last} is newer than the "
                    f"batch's version {version} (the newest version that sampled a token)"
                )


def _as_list(values: list[Any]) -> list[Any]:
    return values.tolist() if hasattr(values, "tolist") else values


_all_finite_non_positive = all_finite_non_positive  # its old name (tests compare it with the exact walk)


class RolloutGroup(WireModel):
    prompt_id: str = Field(..., min_length=1, max_length=200)
    prompt_index: WireInt
    prompt_token_ids: PromptTokenIds
    # Exactly the run's group_size, or with split episodes (Completion.episode) group_size episodes (checked
    # per run); the static cap covers 1024 episodes split into several samples.
    completions: list[Completion] = Field(..., min_length=1, max_length=MAX_GROUP_COMPLETIONS, fail_fast=True)
    # Why completions have ``reward: null``: the first message of each failure kind in this group
    # (the reward's: exception, timeout, non_numeric, non_finite, none; an aborted episode's, prefixed
    # EPISODE_ERROR_PREFIX: episode:agent, episode:timeout, episode:turn_limit...). The trainer counts and reports them.
    reward_errors: dict[str, str] = Field(default_factory=dict, max_length=8)
    # Multi-turn groups: sums over the group's G episodes (``episodes``, ``tool_calls``, ``tool_errors``,
    # ``timeouts``, ``gen_s``, ``env_s``) that the trainer reports per step (its trackers see what the generator
    # measured). Informational only: nothing trains on them. Omitted when empty (single-turn bytes unchanged).
    episode_stats: dict[EpisodeStatName, EpisodeStatValue] = Field(
        default_factory=dict, max_length=MAX_EPISODE_STATS, exclude_if=_is_empty
    )

    @field_validator("reward_errors")
    @classmethod
    def _short_messages(cls, v: dict[str, str]) -> dict[str, str]:
        return {k[:32]: m[:500] for k, m in v.items()}

    @model_validator(mode="after")
    def _episodes_consistent(self) -> "RolloutGroup":
        tagged = [c.episode is not None for c in self.completions]
        if not any(tagged):
            return self
        if not all(tagged):
            i = tagged.index(False)
            raise ValueError(f"completions[{i}].episode: set on some completions of the group, so on all of them")
        prev: Completion | None = None
        for i, c in enumerate(self.completions):
            assert c.episode is not None
            if prev is not None and c.episode == prev.episode:
                if c.reward != prev.reward or c.finish_reason != prev.finish_reason:
                    raise ValueError(
                        f"completions[{i}]: the samples of episode {c.episode} must repeat its reward and finish_reason"
                    )
            else:
                expected = 0 if prev is None else (prev.episode or 0) + 1
                if c.episode != expected:
                    raise ValueError(
                        f"completions[{i}].episode: {c.episode}, expected {expected} (episodes are numbered from 0, "
                        "the samples of one consecutive)"
                    )
            prev = c
        return self

    def episodes(self) -> list[list[int]]:
        """Indices of ``completions`` per episode, in order (each completion is its own episode unless split)."""
        if not self.completions or self.completions[0].episode is None:
            return [[i] for i in range(len(self.completions))]
        out: list[list[int]] = []
        for i, c in enumerate(self.completions):
            if c.episode == len(out):
                out.append([])
            out[-1].append(i)
        return out

    def episode_results(self) -> list[Completion]:
        """One completion per episode, the first of its samples: it carries the episode's reward and
        finish_reason (every sample repeats them)."""
        return [self.completions[members[0]] for members in self.episodes()]

    def prompt_of(self, completion: Completion) -> list[int]:
        """The prompt a completion continues: its own (a split sample) or the group's."""
        return completion.prompt_token_ids if completion.prompt_token_ids is not None else self.prompt_token_ids

    def max_token_id(self) -> int:
        arrays = [self.prompt_token_ids, *(c.token_ids for c in self.completions)]
        arrays += [c.prompt_token_ids for c in self.completions if c.prompt_token_ids is not None]
        return max(int(max(a)) for a in arrays if len(a))


class RolloutBatch(WireModel):
    worker_id: WorkerId
    lease_id: LeaseId
    version: Version
    # At most the run's queue_capacity_groups (checked per run); 4096 is a prompt lease's upper bound.
    groups: list[RolloutGroup] = Field(..., min_length=1, max_length=4096, fail_fast=True)
    # The behaviour policy is the adapter version AND the sampling settings: the trainer recomputes each
    # group's logprobs with the settings it was sampled with, even after the run's spec changed them.
    sampling: SamplingSpec | None = Field(
        None,
        description="The sampling settings the groups were generated with (default: the run's at submit time).",
    )
    # One request per call instead of two: the submit of this call's groups leases the prompts of a later call.
    # Its request_id makes a replayed submit answer the same prompts (the lease's own replay rule).
    next_prompts: PromptLeaseRequest | None = Field(
        None,
        description="Lease prompts with this submit once it is accepted (its wait_s is ignored: never long-polled). "
        "The answer's `prompts` holds them; null when the proxy did not lease (an older proxy, or the lease failed: "
        "lease with POST prompts/lease then), an empty list under admission control (`prompts_retry_after`).",
    )

    @model_validator(mode="after")
    def _spans_end_at_version(self) -> "RolloutBatch":
        _check_newest_span(self.groups, self.version)
        return self


class SubmitResponse(WireModel):
    batch_id: str
    accepted_groups: int
    # True when the Idempotency-Key was seen before: nothing new was enqueued.
    duplicate: bool = False
    # The lease the batch's ``next_prompts`` asked for (None: not asked, or not leased: see RolloutBatch).
    prompts: PromptLease | None = None
    prompts_retry_after: float | None = None
    # The run's groups trained so far and those of them this worker submitted (its share of the training, which
    # a generator's admission control reads); null from an older proxy and on a duplicate's answer.
    trained_total: int | None = Field(None, description="The run's groups trained (acked) so far.")
    worker_trained_total: int | None = Field(
        None, description="Of those, the groups the submitting worker submitted (since the proxy's Redis began)."
    )


class ClaimRequest(WireModel):
    consumer: WorkerId
    max_groups: int = Field(8, ge=1, le=4096)
    wait_s: float = Field(0.0, ge=0.0, le=300.0)
    # Drop groups older than this too (dropped and counted like every stale group): the trainer passes the
    # version its policy will have when it trains on this claim, minus max_staleness. It claims ahead and
    # publishes asynchronously, so that version can be ahead of the proxy's latest; without this floor a group
    # that passed ``latest - max_staleness`` at claim time could be trained with a staleness > max_staleness.
    min_version: WireInt | None = Field(
        None,
        description="Drop groups older than this too (counted in dropped_stale): the trainer passes the version "
        "its policy will have when it trains on this claim, minus max_staleness.",
    )
    # Pacing: the proxy's admission control predicts from these the version a group leased now is trained with.
    train_version: Version | None = Field(
        None,
        description="The policy version the trainer will train this claim's groups with (admission control uses it "
        "to pace prompt leases so that their groups are trained within max_staleness).",
    )
    sync_every: int = Field(1, ge=1, le=1_000_000, description="The trainer publishes a version every N steps.")
    # Exactly-once: a retry of a claim whose answer was lost carries the same request_id and gets the same
    # deliveries again (a claim's deliveries are never redelivered to the epoch that holds them).
    request_id: RequestId | None = Field(
        None,
        description="Unique per claim, the same on its retries: a replay answers the first attempt's deliveries.",
    )
    release: list[str] = Field(
        default_factory=list,
        max_length=4096,
        description="Delivery ids this trainer gives back untrained (held back as too stale): claimable again now.",
    )
    # Exactly-once across a Redis wipe: the rebuild re-queues groups this trainer's lineage may have trained
    # already (unacked until its checkpoint, or acked after the proxy's last snapshot). Only the trainer's ledger
    # knows which; so instead of dropping such a group as stale (and counting a trained group as dropped), the
    # proxy hands it over flagged ``rebuilt_stale``, and the trainer acks it with its next checkpoint (trained
    # before) or gives it back in ``release`` (never trained: then dropped and counted stale).
    hold_rebuilt: bool = Field(
        False,
        description="Hand over re-queued (rebuilt after a Redis wipe) groups below the version floor, flagged "
        "rebuilt_stale, instead of dropping them: the trainer acks those its lineage trained and releases the rest "
        "(never trains one).",
    )
    # One request per claim instead of two: the trainer's ack rides on its next claim (acked first, then claimed,
    # both under the claim's epoch). Replayed, the ack counts 0 as a second ack does.
    ack: list[Annotated[str, StringConstraints(max_length=64)]] = Field(
        default_factory=list,
        max_length=100_000,
        fail_fast=True,
        description="Delivery ids to acknowledge (trained) before claiming, as POST rollouts/ack would; the answer's "
        "`acked` counts those acked by this call (null from a proxy that does not ack with a claim).",
    )


class Delivery(WireModel):
    delivery_id: str
    version: int
    groups: list[RolloutGroup]
    worker_id: str = ""
    batch_id: str = ""
    # How many times this delivery was handed out (1 = first delivery).
    attempt: int = 1
    # The sampling settings the group was generated with (None: recorded by an older proxy; use the run's).
    sampling: SamplingSpec | None = None
    # Below the claim's version floor, handed over only because the claim asked for it (``hold_rebuilt``): a
    # group a rebuild re-queued. Never to be trained: acked if the lineage trained it before, else released.
    rebuilt_stale: bool = False

    @model_validator(mode="after")
    def _spans_end_at_version(self) -> "Delivery":
        _check_newest_span(self.groups, self.version)
        return self


class ClaimResponse(WireModel):
    deliveries: list[Delivery]
    dropped_stale: int = 0
    # Exactly-once acks across a Redis wipe: a rebuild re-queues groups the trainer may have trained already
    # (unacked until its checkpoint, or acked after the last snapshot). When such a re-queued group is dropped
    # as stale, its id is listed here; a trainer that trained it acks it (the ack moves it from dropped to acked).
    dropped_rebuilt: list[str] = Field(
        default_factory=list,
        description="Ids of re-queued (rebuilt after a Redis wipe) deliveries dropped as stale by this claim: "
        "a trainer that already trained one acks it, and it is then counted acked, not dropped.",
    )
    # The claim's ``ack`` acked this many (None: the claim carried no ack).
    acked: int | None = None


class AckRequest(WireModel):
    # A delivery id is "b<32 hex>:<group>" (40 characters at most); 100,000 of them is ~4.3 MB of JSON.
    delivery_ids: list[Annotated[str, StringConstraints(max_length=64)]] = Field(
        ..., max_length=100_000, fail_fast=True
    )


class AckResponse(WireModel):
    acked: int
