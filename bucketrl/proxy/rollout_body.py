"""The rollout submit's body: decoded once, checked in one pass, and each group kept as the bytes that arrived.

A msgpack body (what workers send: ``bucketrl.wire.packed``, numeric arrays as typed bytes) is read with a
streaming unpacker that notes where each group starts and ends, so the batch object stores every group as the
exact msgpack it came in (``groups_msgpack``) and a claim splices those bytes into its answer: nothing is
encoded again. The batch is validated into :class:`RolloutBatch` keeping packed arrays as numpy arrays (checked
in a few numpy passes over all of them: no Python list of 2,048 numbers is ever built). A plain-list msgpack body
(older workers) takes the same path; its groups are stored as they came too. A JSON body (old submitters) is
validated as before and each group packed once.

All of it (the groups packed for a JSON body, the content digest) is done by :func:`decode`, which
``body.off_loop`` runs in the decoder process for a large body: the event loop is left the write and the enqueue.

Errors, limits and large bodies as in ``body.py``: 415 before reading an unknown Content-Type, 413 over
``max_rollout_bytes``, 422 naming the field; bodies over ``body.INLINE_DECODE_BYTES`` decode in the decoder
process (``body.off_loop``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import msgpack
from fastapi import Request
from pydantic import ValidationError

from bucketrl import errors
from bucketrl.proxy import body
from bucketrl.proxy.errors import describe_validation
from bucketrl.wire import RolloutBatch
from bucketrl.wire.packed import packb, validate_keeping_arrays


@dataclass(frozen=True)
class SubmittedBatch:
    """A validated batch (numeric arrays may be numpy arrays), each group's msgpack as it will be stored, and the
    digest of the batch's content (:func:`content_digest`; the batch id is made from it)."""

    batch: RolloutBatch
    groups_msgpack: list[bytes]
    digest: bytes


def content_digest(batch: RolloutBatch, groups: list[bytes]) -> bytes:
    """A digest of the batch's whole content, from the bytes its groups are stored as (a retry sends the same
    bytes; a retry in another encoding names another object, and the idempotency record still answers it)."""
    h = hashlib.sha256(f"{batch.worker_id}\0{batch.lease_id}\0{batch.version}\0{len(groups)}".encode())
    for g in groups:
        h.update(len(g).to_bytes(8, "big"))
        h.update(g)
    return h.digest()


def decode(raw: bytes | bytearray, ctype: str) -> SubmittedBatch:
    """Bytes -> :class:`SubmittedBatch`, or :class:`errors.Invalid` naming the field (``body.<path>``)."""
    body.check_media_type(ctype)
    if ctype in body.MSGPACK_TYPES and raw:
        split = _split_msgpack(bytes(raw))
        if split is not None:
            obj, spans = split
            try:
                batch = validate_keeping_arrays(RolloutBatch, obj)
            except ValidationError as exc:
                raise _invalid(exc) from None
            except RecursionError:
                raise errors.Invalid("body: nested too deeply") from None
            return SubmittedBatch(batch, spans, content_digest(batch, spans))
    # JSON, or msgpack this reader does not take apart (not a map, garbage): the generic decoder says why.
    batch = body.decode_model(RolloutBatch, raw, ctype)
    groups = [packb(g) for g in batch.groups]
    return SubmittedBatch(batch, groups, content_digest(batch, groups))


def _split_msgpack(raw: bytes) -> tuple[dict[str, object], list[bytes]] | None:
    """The body's top-level map, and the bytes of each item of its ``groups`` array (None: not a map whose
    ``groups`` is an array, or undecodable; the generic decoder then names the problem)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=len(raw))
    unpacker.feed(raw)
    obj: dict[str, object] = {}
    spans: list[bytes] = []
    try:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key != "groups":
                obj[key] = unpacker.unpack()
                continue
            n = unpacker.read_array_header()
            groups, spans = [], []
            for _ in range(n):
                start = unpacker.tell()
                groups.append(unpacker.unpack())
                spans.append(raw[start : unpacker.tell()])
            obj[key] = groups
        if unpacker.tell() != len(raw):
            return None  # trailing bytes: refused by the generic decoder ("extra data")
    except Exception:  # msgpack raises several unrelated types for garbage, RecursionError for deep nesting
        return None
    return obj, spans


def _invalid(exc: ValidationError) -> errors.Invalid:
    # As body.decode_model: location and message only (no inputs: they can be megabytes), a bounded number.
    shown = exc.errors(include_url=False, include_context=False, include_input=False)[:5]
    located = [{**e, "loc": ("body", *e["loc"])} for e in shown]
    return errors.Invalid(describe_validation(located, exc.error_count()))


async def decoded(request: Request) -> SubmittedBatch:
    """Dependency of the submit route (limit: ``max_rollout_bytes``)."""
    ctype = body.media_type(request)
    body.check_media_type(ctype)
    limit = int(request.app.state.ctx.settings.max_rollout_bytes)
    raw = await body.read_limited(request, limit, "RolloutBatch body")
    return await body.off_loop(decode, raw, ctype)
