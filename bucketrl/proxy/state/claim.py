"""Stage 2 of a group's life: the trainer claims deliveries (epoch-fenced, long-polled), or gives them back.

See ``state/queue.py`` for the whole life. A claim's answer is spliced from the stored group bytes
(:class:`ClaimOutcome`), never decoded and encoded again.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
from pydantic import TypeAdapter

from bucketrl import errors
from bucketrl.proxy.state import ack, cleanup
from bucketrl.proxy.state.locks import fenced_or_restoring
from bucketrl.proxy.state.lua import Lua
from bucketrl.proxy.state.queue import (
    GROUP,
    QueueKeys,
    UnsupportedBatchObject,
    as_str,
    batch_key,
    check_format,
    validate_delivery_ids,
)
from bucketrl.proxy.state.restore import ensure_ready
from bucketrl.storage.base import BucketStore
from bucketrl.wire import ClaimResponse, Delivery, RolloutGroup, RunSpec, SamplingSpec

log = logging.getLogger("bucketrl.proxy.queue")

_CLAIM = Lua.load("queued_groups.lua", "queue_common.lua", "claim.lua")

_REQUEUE = Lua.load("queued_groups.lua", "queue_common.lua", "claim_requeue.lua")

_RELEASE_PENDING = Lua.load("queued_groups.lua", "queue_common.lua", "claim_release_pending.lua")

CLAIM_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# How long a claim's answer is kept for a replay of the same request id (a client retry after a lost answer
# comes within its backoff: seconds to minutes).
CLAIM_REPLAY_TTL_S = 600
# A claim long-poll re-evaluates redeliveries at least this often while it blocks on new entries.
WAIT_SLICE_S = 1.0
# Serialises a validated group to the JSON a claim answers (the same serializer ClaimResponse uses).
_GROUP_JSON: TypeAdapter[RolloutGroup] = TypeAdapter(RolloutGroup)


@dataclass(frozen=True)
class StoredGroup:
    """One group as its batch object holds it: the msgpack (packed arrays) that arrived. A msgpack claim sends it
    on undecoded; a JSON claim (an older trainer) converts it."""

    data: bytes

    def model(self) -> RolloutGroup:
        return RolloutGroup.model_validate(msgpack.unpackb(self.data, raw=False))

    def as_json(self) -> bytes:
        return _GROUP_JSON.dump_json(self.model())

    def as_msgpack(self) -> bytes:
        return self.data


@dataclass(frozen=True)
class ClaimedGroup:
    """One delivery, its group as submit stored it (sent on as is: no decoding, no re-encoding)."""

    delivery_id: str
    version: int
    worker_id: str
    batch_id: str
    attempt: int
    group: StoredGroup
    sampling: SamplingSpec | None = None
    rebuilt_stale: bool = False  # handed over below the floor (a claim with hold_rebuilt): never trained

    def delivery(self) -> Delivery:
        return self._envelope([self.group.model()])

    def _envelope(self, groups: list[RolloutGroup]) -> Delivery:
        return Delivery.model_construct(
            delivery_id=self.delivery_id,
            version=self.version,
            groups=groups,
            worker_id=self.worker_id,
            batch_id=self.batch_id,
            attempt=self.attempt,
            sampling=self.sampling,
            rebuilt_stale=self.rebuilt_stale,
        )

    def delivery_json(self) -> bytes:
        """``self.delivery().model_dump_json()``, byte for byte, without decoding a stored JSON group: the
        envelope is the model's own serialisation with an empty ``groups``, into which the group is spliced
        (a bare ``"groups":[]`` can only be that key: quotes inside JSON strings are escaped)."""
        envelope = self._envelope([]).model_dump_json()
        before, sep, after = envelope.encode().partition(b'"groups":[]')
        assert sep, envelope
        return b"".join((before, b'"groups":[', self.group.as_json(), b"]", after))

    def delivery_msgpack(self) -> bytes:
        """The msgpack of the delivery (numeric arrays packed): the envelope's fields, then ``groups`` holding
        the stored group's bytes (a msgpack array is its header followed by its items' bytes)."""
        fields = self._envelope([]).model_dump(mode="json")
        del fields["groups"]
        p = msgpack.Packer(use_bin_type=True)
        parts = [p.pack_map_header(len(fields) + 1)]
        for key, value in fields.items():
            parts += [p.pack(key), p.pack(value)]
        parts += [p.pack("groups"), p.pack_array_header(1), self.group.as_msgpack()]
        return b"".join(parts)


# A claim answers msgpack (packed arrays) to a client that accepts it, JSON otherwise.
MSGPACK = "application/msgpack"


@dataclass
class ClaimOutcome:
    claimed: list[ClaimedGroup]
    dropped: int = 0
    lost: int = 0
    dropped_rebuilt: list[str] = field(default_factory=list)  # re-queued by a rebuild, dropped as stale

    @property
    def deliveries(self) -> list[Delivery]:
        """The deliveries as models (decodes every group: for callers in Python; the route sends the bytes)."""
        return [c.delivery() for c in self.claimed]

    def _envelope(self) -> ClaimResponse:
        return ClaimResponse(deliveries=[], dropped_stale=self.dropped, dropped_rebuilt=self.dropped_rebuilt)

    def response_json(self) -> bytes:
        """The :class:`ClaimResponse` JSON of this outcome, byte-identical to ``ClaimResponse(deliveries=
        self.deliveries, dropped_stale=self.dropped).model_dump_json()``."""
        envelope = self._envelope().model_dump_json().encode()
        before, sep, after = envelope.partition(b'"deliveries":[]')
        assert sep, envelope
        inner = b",".join(c.delivery_json() for c in self.claimed)
        return b"".join((before, b'"deliveries":[', inner, b"]", after))

    def response_msgpack(self) -> bytes:
        """The :class:`ClaimResponse` as msgpack, its groups spliced in as stored (packed arrays):
        ``ClaimResponse.model_validate(msgpack.unpackb(...))`` reads back what ``deliveries`` gives."""
        fields = self._envelope().model_dump(mode="json")
        del fields["deliveries"]
        p = msgpack.Packer(use_bin_type=True)
        parts = [p.pack_map_header(len(fields) + 1), p.pack("deliveries"), p.pack_array_header(len(self.claimed))]
        parts += [c.delivery_msgpack() for c in self.claimed]
        for key, value in fields.items():
            parts += [p.pack(key), p.pack(value)]
        return b"".join(parts)


async def claim(
    r: Any,
    store: BucketStore,
    run: str,
    spec: RunSpec,
    *,
    epoch: int,
    consumer: str,
    max_groups: int,
    wait_s: float,
    redelivery_timeout_s: float,
    min_version: int | None = None,
    train_version: int | None = None,
    sync_every: int = 1,
    cleaner: cleanup.BatchCleaner | None = None,
    request_id: str | None = None,
    release: list[str] | None = None,
    hold_rebuilt: bool = False,
) -> ClaimOutcome:
    """Up to ``max_groups`` deliveries; waits up to ``wait_s`` for the first one (long-poll).

    A group older than ``latest - max_staleness`` or than ``min_version`` (the trainer's own floor: the version
    its policy will have when it trains on this claim, minus max_staleness) is dropped and counted.
    ``train_version`` (that version) and ``sync_every`` record the trainer's pace for admission control.
    ``cleaner``: settle the bucket objects of batches this finishes in the background (the proxy's routes);
    without one they are settled before this returns. ``hold_rebuilt``: a group a rebuild re-queued that is
    below the floor is handed over flagged ``rebuilt_stale`` instead of dropped (``ClaimRequest.hold_rebuilt``).
    """
    k = QueueKeys.of(run)
    deadline = time.monotonic() + wait_s
    idle_ms = max(1, int(redelivery_timeout_s * 1000))
    total = ClaimOutcome([])
    if request_id is not None and not CLAIM_REQUEST_ID_RE.match(request_id):
        raise errors.Invalid("request_id: must be 1..64 characters of [A-Za-z0-9_.-]")
    release_ids = list(dict.fromkeys(release or []))
    validate_delivery_ids(release_ids, "release")
    while True:
        res = await _CLAIM(
            r,
            [
                *(k.stream, k.state, k.counters, k.entry, k.remaining, k.attempts, k.settled),
                *(k.meta, k.p.meta, k.bseq, k.doomed, k.p.pace, k.p.channel, k.owner),
                k.claim_request(run, epoch, request_id),
                k.redropped,
                k.rebuilt,
            ],
            [
                *(GROUP, consumer, max_groups, epoch, idle_ms, spec.max_staleness, min_version or 0),
                *(train_version or 0, sync_every, spec.groups_per_step, request_id or "", CLAIM_REPLAY_TTL_S),
                "1" if hold_rebuilt else "0",
                *release_ids,
            ],
        )
        release_ids = []  # given back by the first pass
        if as_str(res[0]) == "notready":
            await ensure_ready(r, store, run, spec)
            continue
        if as_str(res[0]) == "fenced":
            raise await fenced_or_restoring(r, run, epoch, int(res[1]), "(claim)")
        dropped, last, entries = int(res[1]), as_str(res[2]), res[3]
        total.dropped += dropped
        total.dropped_rebuilt += [as_str(d) for d in res[6]]
        await ack.settle_objects(r, store, run, spec, res[4], int(res[5]), cleaner)
        if entries:
            got = await _deliveries(r, store, run, spec, entries, idle_ms, cleaner)
            total.claimed.extend(got.claimed)
            total.lost += got.lost
            if total.claimed:
                return total
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return total
        # Block until an entry newer than the stream's last id exists (a submit), or a slice passes
        # (pending deliveries may have timed out meanwhile).
        await r.xread({k.stream: last}, count=1, block=max(1, int(min(remaining, _slice_s(r)) * 1000)))


def _slice_s(r: Any) -> float:
    """How long one blocking read may last: under the client's socket timeout, or it would look like an outage."""
    timeout = getattr(getattr(r, "connection_pool", None), "connection_kwargs", {}).get("socket_timeout")
    return min(WAIT_SLICE_S, float(timeout) / 2) if timeout else WAIT_SLICE_S


async def _deliveries(
    r: Any,
    store: BucketStore,
    run: str,
    spec: RunSpec,
    entries: list[Any],
    idle_ms: int,
    cleaner: cleanup.BatchCleaner | None = None,
) -> ClaimOutcome:
    """Turn claimed stream entries into deliveries by reading their batch objects from the bucket."""
    parsed = [(as_str(e[0]), as_str(e[1]), int(e[2]), as_str(e[3]), int(e[4]), bool(int(e[5]))) for e in entries]
    batch_ids = sorted({d.rsplit(":", 1)[0] for _, d, *_ in parsed})
    try:
        # One thread hop for all the reads (a hop costs more CPU than reading a local object).
        loaded = await asyncio.to_thread(lambda: [_load_groups(store, run, b) for b in batch_ids])
    except BaseException:
        # Claimed in Redis but not handed out: make them re-claimable now instead of after the timeout.
        k = QueueKeys.of(run)
        await _REQUEUE(r, [k.stream, k.owner], [GROUP, idle_ms, *(x for sid, d, *_ in parsed for x in (sid, d))])
        raise
    batches = dict(zip(batch_ids, loaded, strict=True))
    out = ClaimOutcome([])
    lost: list[str] = []
    for _sid, d, version, worker, attempt, below in parsed:
        b, g = d.rsplit(":", 1)
        stored = batches[b]
        if stored is None or int(g) >= len(stored.groups):
            lost.append(d)
            continue
        group = stored.groups[int(g)]
        out.claimed.append(ClaimedGroup(d, version, worker, b, attempt, group, stored.sampling, rebuilt_stale=below))
    if lost:
        log.error(
            "run %r: %d claimed groups have no batch object in the bucket; counted as lost: %s",
            run,
            len(lost),
            lost[:5],
        )
        out.lost = await ack.settle(r, store, run, spec, lost, epoch=0, counter="lost_total", cleaner=cleaner)
    return out


@dataclass(frozen=True)
class StoredGroups:
    groups: list[StoredGroup]
    sampling: SamplingSpec | None  # None in objects written before batches recorded it


def _load_groups(store: BucketStore, run: str, batch_id: str) -> StoredGroups | None:
    """Each group of a batch object as stored, and its sampling (None when the object is gone).

    Only ``groups_msgpack`` and ``sampling`` are decoded, the rest skipped unread; an object of another format
    than 3 is refused (:class:`~bucketrl.proxy.state.queue.UnsupportedBatchObject`)."""
    try:
        raw = store.get_bytes(batch_key(run, batch_id))
    except errors.NotFound:
        return None
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(raw), 1))
    unpacker.feed(raw)
    stored: list[StoredGroup] | None = None
    sampling: SamplingSpec | None = None
    obj_format: Any = None
    for _ in range(unpacker.read_map_header()):
        key = unpacker.unpack()
        if key == "format":
            obj_format = unpacker.unpack()
        elif key == "groups_msgpack":
            stored = [StoredGroup(g) for g in unpacker.unpack()]
        elif key == "sampling":
            raw_sampling = unpacker.unpack()
            sampling = None if raw_sampling is None else SamplingSpec.model_validate(raw_sampling)
        else:
            unpacker.skip()
    check_format(run, batch_id, obj_format)
    if stored is None:  # format 3 always has them: a damaged object
        raise UnsupportedBatchObject(f"run {run!r}: batch object {batch_key(run, batch_id)} has no groups_msgpack")
    return StoredGroups(stored, sampling)


async def on_trainer_registered(r: Any, run: str, epoch: int, redelivery_timeout_s: float) -> bool:
    """A new trainer epoch: every pending (claimed, unacked) delivery becomes re-claimable now."""
    k = QueueKeys.of(run)
    idle_ms = max(1, int(redelivery_timeout_s * 1000))
    return bool(await _RELEASE_PENDING(r, [k.stream, k.meta], [GROUP, epoch, idle_ms]))
