"""Request bodies: size limits enforced before a body is read whole, JSON/msgpack decoding into models.

Two entry points:

- :func:`decoded` — a dependency factory for small structured bodies. ``Content-Type:
  application/json`` (the default) or ``application/msgpack``; anything over the limit is 413 (refused
  from ``Content-Length`` before reading, or as soon as the streamed bytes pass the limit); malformed
  bytes or a schema violation is 422 whose message names the field (``body.groups.0.completions.1...``).
  Use it with :func:`openapi_body` so the OpenAPI schema documents the body::

      @router.post("/x", openapi_extra=body.openapi_body(RolloutBatch))
      async def submit(batch: Annotated[RolloutBatch, Depends(body.decoded(RolloutBatch))]): ...

- :func:`stream_limited` — an async iterator over a raw body (tars) with the same 413 rule, for routes
  that spool to disk instead of holding the body in memory.

Limits: rollout batches get ``max_rollout_bytes`` (the largest legal batch), every other structured body
``max_json_bytes`` (sized to the largest legal control body: an ack of 100,000 delivery ids); only tar
uploads get the large adapter/checkpoint limits. A Content-Type other than JSON or msgpack is 415 before the
body is read.

Memory and the event loop: the body is read into one buffer (no chunk list joined into a second copy) and
decoded straight into the model (pydantic parses JSON without an intermediate tree; lists validate
``fail_fast``, so a body of two million bad items costs one error). Bodies over :data:`INLINE_DECODE_BYTES` are
decoded in a child process (``decode_pool``: pydantic holds the GIL while it validates, so a thread still
stalled the loop), at most :data:`DECODE_SLOTS` at a time, so a large body does not hold the event loop
(``/healthz`` keeps answering) and concurrent large bodies do not multiply the decoding peak.
``bench/proxy_memory.py`` measures both.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import msgpack
from fastapi import Request
from pydantic import BaseModel, ValidationError

from bucketrl import errors
from bucketrl.proxy import decode_pool
from bucketrl.proxy.errors import describe_validation

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

JSON_TYPES = ("application/json", "")
MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")

# Bodies up to this size decode on the event loop (a thread hop costs more than parsing them).
INLINE_DECODE_BYTES = 256 * 1024
# Large bodies handed to the decoder process at once (per event loop); the others wait with their raw bytes only.
DECODE_SLOTS = 1

# Models documented as request bodies via openapi_body; app.py adds their schemas to the components.
DOCUMENTED_BODIES: dict[str, type[BaseModel]] = {}


def check_content_length(request: Request, limit: int, what: str) -> int | None:
    """413 right away when the declared length is over ``limit``; the declared length (or None)."""
    raw = request.headers.get("content-length")
    if raw is None:
        return None
    try:
        declared = int(raw)
    except ValueError:
        raise errors.Invalid(f"Content-Length {raw[:20]!r} is not an integer") from None
    if declared < 0:
        raise errors.Invalid("Content-Length must be >= 0")
    if declared > limit:
        raise errors.PayloadTooLarge(f"{what} of {declared} bytes exceeds the limit of {limit} bytes")
    return declared


async def stream_limited(request: Request, limit: int, what: str = "body") -> AsyncIterator[bytes]:
    """Yield the body's chunks; 413 as soon as more than ``limit`` bytes arrived (or were declared)."""
    check_content_length(request, limit, what)
    seen = 0
    async for chunk in request.stream():
        if not chunk:
            continue
        seen += len(chunk)
        if seen > limit:
            raise errors.PayloadTooLarge(f"{what} exceeds the limit of {limit} bytes")
        yield chunk


async def read_limited(request: Request, limit: int, what: str = "body") -> bytearray:
    """The whole body in one buffer (grown in place: never a list of chunks plus their joined copy)."""
    buf = bytearray()
    async for chunk in stream_limited(request, limit, what):
        buf += chunk
    return buf


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def check_media_type(ctype: str) -> None:
    """415 for a Content-Type a structured body route does not read (before the body is read)."""
    if ctype not in JSON_TYPES and ctype not in MSGPACK_TYPES:
        raise errors.UnsupportedMedia(
            f"Content-Type {ctype[:80]!r} is not supported: send application/json or application/msgpack"
        )


def decode_model(model: type[M], raw: bytes | bytearray, ctype: str) -> M:
    """Bytes -> model, or :class:`errors.Invalid` naming the field (``body.<path>``)."""
    check_media_type(ctype)
    if not raw:
        raise errors.Invalid(f"body: empty; expected a {model.__name__} as JSON or msgpack")
    try:
        if ctype in MSGPACK_TYPES:
            try:
                obj = msgpack.unpackb(raw, raw=False, strict_map_key=True)
            except Exception as exc:  # msgpack raises several unrelated types for garbage
                raise errors.Invalid(f"body: not valid msgpack ({type(exc).__name__}: {str(exc)[:120]})") from None
            return model.model_validate(obj, strict=True)
        if ctype in JSON_TYPES:
            return model.model_validate_json(raw, strict=True)  # strict: no bool for a number, no "1" for 1
    except ValidationError as exc:
        # Location and message only (no inputs: they can be megabytes); lists validate fail_fast, so a body
        # holds a bounded number of errors whatever its size.
        shown = exc.errors(include_url=False, include_context=False, include_input=False)[:5]
        located = [{**e, "loc": ("body", *e["loc"])} for e in shown]
        raise errors.Invalid(describe_validation(located, exc.error_count())) from None
    except RecursionError:  # nesting deeper than the interpreter's stack (msgpack/pydantic recurse)
        raise errors.Invalid("body: nested too deeply") from None
    raise AssertionError("unreachable: check_media_type admitted the type")


_DECODE_SLOTS: dict[int, asyncio.Semaphore] = {}


def _slots() -> asyncio.Semaphore:
    # One semaphore per event loop (tests run several apps on several loops in one process).
    loop = asyncio.get_running_loop()
    sem = _DECODE_SLOTS.get(id(loop))
    if sem is None:
        sem = _DECODE_SLOTS[id(loop)] = asyncio.Semaphore(DECODE_SLOTS)
    return sem


async def decode_off_loop(model: type[M], raw: bytes | bytearray, ctype: str) -> M:
    """:func:`decode_model`, in the decoder process for bodies over :data:`INLINE_DECODE_BYTES`."""
    return await off_loop(_decode_body, raw, model, ctype)


async def off_loop(fn: Callable[..., T], raw: bytes | bytearray, *args: Any) -> T:
    """``fn(raw, *args)``: inline for a body up to :data:`INLINE_DECODE_BYTES`, else in the decoder process, one
    body at a time per event loop. For any body decoder (``fn`` importable by name, its result picklable)."""
    if len(raw) <= INLINE_DECODE_BYTES:
        return fn(raw, *args)
    async with _slots():
        return await decode_pool.run(fn, raw, *args)


def _decode_body(raw: bytes | bytearray, model: type[M], ctype: str) -> M:
    # off_loop's calling convention: the body first (it goes down the pipe from its own buffer).
    return decode_model(model, raw, ctype)


def decoded(model: type[M], limit_setting: str = "max_json_bytes") -> Callable[[Request], Coroutine[Any, Any, M]]:
    """Dependency: the request body decoded into ``model`` (limit = ``ctx.settings.<limit_setting>``)."""

    async def dependency(request: Request) -> M:
        ctype = media_type(request)
        check_media_type(ctype)
        limit = int(getattr(request.app.state.ctx.settings, limit_setting))
        raw = await read_limited(request, limit, f"{model.__name__} body")
        return await decode_off_loop(model, raw, ctype)

    dependency.__name__ = f"decode_{model.__name__}"
    return dependency


def openapi_body(model: type[BaseModel], *, msgpack_too: bool = True) -> dict[str, Any]:
    """``openapi_extra`` documenting a :func:`decoded` body (JSON, and msgpack when accepted)."""
    DOCUMENTED_BODIES[model.__name__] = model
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    content: dict[str, Any] = {"application/json": {"schema": ref}}
    if msgpack_too:
        content["application/msgpack"] = {"schema": ref}
    return {"requestBody": {"required": True, "content": content}}


def openapi_tar_body(description: str) -> dict[str, Any]:
    """``openapi_extra`` for a raw tar upload with its ``X-Content-SHA256`` header."""
    return {
        "requestBody": {
            "required": True,
            "description": description,
            "content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}},
        }
    }
