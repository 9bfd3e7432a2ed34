"""The error body every non-2xx answer carries: ``{"error": {"code", "message", "retryable"}}``."""

from bucketrl.wire.common import WireModel


class ErrorDetail(WireModel):
    code: str
    message: str
    retryable: bool = False


class ErrorBody(WireModel):
    error: ErrorDetail
