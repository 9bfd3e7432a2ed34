"""The one exception hierarchy of bucketrl.

    BucketRLError                 base; carries an HTTP status, a stable ``code`` and ``retryable``
    ├── Unauthorized      401     missing or bad bearer token
    ├── Forbidden         403     the token's role may not call this route
    ├── NotFound          404     unknown run, version, checkpoint or lease
    ├── Conflict          409     version not latest+1, immutable spec field changed, ...
    │   ├── Fenced        409     a trainer write carried an epoch older than the current one
    │   ├── Stale         409     a rollout batch is older than latest - max_staleness
    │   └── Repeated      409     a rollout batch's prompt was already completed by another accepted batch
    ├── Gone              410     an adapter was garbage-collected, a lease expired
    ├── PayloadTooLarge   413     body over the route's limit (refused before it is read whole)
    ├── UnsupportedMedia  415     a Content-Type the route does not read
    ├── Invalid           422     schema or semantic validation failed; the message names the field
    ├── Backpressure      429     the pipeline holds enough work; retry after ``retry_after`` s
    └── Unavailable       503     Redis or the bucket is unreachable; retryable

Domain code (proxy state, storage) raises these; the proxy maps them to HTTP in one handler table
and the worker client turns an error body back into the same class with :func:`from_wire`.
"""

from __future__ import annotations

from typing import Any, ClassVar


class BucketRLError(Exception):
    status: ClassVar[int] = 500
    code: ClassVar[str] = "internal"
    default_retryable: ClassVar[bool] = False

    def __init__(
        self, message: str, *, retryable: bool | None = None, retry_after: float | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = self.default_retryable if retryable is None else retryable
        self.retry_after = retry_after
        if code is not None:
            self.code = code  # type: ignore[misc]

    def to_wire(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, "retryable": self.retryable}}


class Unauthorized(BucketRLError):
    status = 401
    code = "unauthorized"


class Forbidden(BucketRLError):
    status = 403
    code = "forbidden"


class NotFound(BucketRLError):
    status = 404
    code = "not_found"


class Conflict(BucketRLError):
    status = 409
    code = "conflict"


class Fenced(Conflict):
    code = "fenced"


class Stale(Conflict):
    code = "stale"


class Repeated(Conflict):
    """A submit of prompts another accepted batch already completed: refused whole, so none is trained twice."""

    code = "repeated"


class Gone(BucketRLError):
    status = 410
    code = "gone"


class PayloadTooLarge(BucketRLError):
    status = 413
    code = "payload_too_large"


class UnsupportedMedia(BucketRLError):
    status = 415
    code = "unsupported_media_type"


class Invalid(BucketRLError):
    status = 422
    code = "invalid"


class Backpressure(BucketRLError):
    status = 429
    code = "backpressure"
    default_retryable = True


class Unavailable(BucketRLError):
    status = 503
    code = "unavailable"
    default_retryable = True


_BY_CODE: dict[str, type[BucketRLError]] = {
    cls.code: cls
    for cls in (
        Unauthorized,
        Forbidden,
        NotFound,
        Conflict,
        Fenced,
        Stale,
        Repeated,
        Gone,
        PayloadTooLarge,
        UnsupportedMedia,
        Invalid,
        Backpressure,
        Unavailable,
    )
}
_BY_STATUS: dict[int, type[BucketRLError]] = {
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    410: Gone,
    413: PayloadTooLarge,
    415: UnsupportedMedia,
    422: Invalid,
    429: Backpressure,
    503: Unavailable,
}


def from_wire(status: int, body: Any, retry_after: float | None = None) -> BucketRLError:
    """Rebuild the domain error from an HTTP status and an error body (client side)."""
    detail = body.get("error") if isinstance(body, dict) else None
    if isinstance(detail, dict):
        code = str(detail.get("code", ""))
        message = str(detail.get("message", ""))
        retryable = bool(detail.get("retryable", False))
    else:
        code, message, retryable = "", f"HTTP {status}: {str(body)[:200]}", status >= 500
    cls = _BY_CODE.get(code) or _BY_STATUS.get(status) or BucketRLError
    err = cls(message or cls.code, retryable=retryable or status >= 500, retry_after=retry_after, code=code or None)
    err.status = status  # type: ignore[misc]
    return err


def settings_problems(exc: Any) -> str:
    """A pydantic ``ValidationError`` of settings as one line a CLI can print: each field and what is wrong with it
    (no pydantic URL, no echo of every input)."""
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or 'settings'}: {str(e['msg']).removeprefix('Value error, ')}"
        for e in exc.errors()
    )
