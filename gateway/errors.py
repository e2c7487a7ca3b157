"""The one place where gRPC outcomes become HTTP answers: status code, retry hint, error body.

Every endpoint (SSE, OpenAI, KServe REST) maps upstream failures through `from_rpc_error`; SSE
streams that fail after their first event send the same fields as an `event: error`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from modelyard.common import headers
from modelyard.common.reasons import ErrorReason

# gRPC status -> HTTP status. Load answers (429, 503) carry Retry-After.
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,  # the client closed the request (nginx's code)
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.DATA_LOSS: 500,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# Reason when the upstream sent none (e.g. it could not be reached at all).
_DEFAULT_REASON: dict[grpc.StatusCode, ErrorReason] = {
    grpc.StatusCode.INVALID_ARGUMENT: ErrorReason.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED: ErrorReason.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED: ErrorReason.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND: ErrorReason.MODEL_NOT_FOUND,
    # Without a reason it is gRPC core refusing an oversized message: queue_full always says so.
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorReason.TOO_LARGE,
    grpc.StatusCode.UNAVAILABLE: ErrorReason.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorReason.DEADLINE,
    grpc.StatusCode.CANCELLED: ErrorReason.CANCELLED,
    grpc.StatusCode.UNIMPLEMENTED: ErrorReason.UNSUPPORTED,
    grpc.StatusCode.FAILED_PRECONDITION: ErrorReason.FAILED_PRECONDITION,
}
DEFAULT_RETRY_AFTER_S = 1


@dataclass
class HttpError(Exception):
    """An answer that is an error: HTTP status, the gRPC code name it stands for, a reason word
    from the x-error-reason vocabulary, a message, and a retry hint for load answers."""

    status: int
    code: str
    reason: str
    message: str
    retry_after_s: int | None = None
    # The request field at fault, where an API names it apart from the message (OpenAI's `param`).
    param: str | None = None

    def headers(self) -> dict[str, str]:
        out = {headers.ERROR_REASON: self.reason}
        if self.retry_after_s is not None:
            out["retry-after"] = str(self.retry_after_s)
        return out

    def body(self) -> dict[str, object]:
        return {"error": {"code": self.code, "reason": self.reason, "message": self.message}}


def bad_request(
    message: str,
    reason: ErrorReason = ErrorReason.INVALID_ARGUMENT,
    status: int = 400,
    param: str | None = None,
) -> HttpError:
    return HttpError(status, grpc.StatusCode.INVALID_ARGUMENT.name, reason, message, param=param)


def not_found(message: str, reason: str = ErrorReason.MODEL_NOT_FOUND) -> HttpError:
    return HttpError(404, grpc.StatusCode.NOT_FOUND.name, reason, message)


def overloaded(message: str) -> HttpError:
    return HttpError(
        429, grpc.StatusCode.RESOURCE_EXHAUSTED.name, ErrorReason.QUEUE_FULL, message, DEFAULT_RETRY_AFTER_S
    )


def from_status(code: grpc.StatusCode, message: str, metadata: dict[str, str]) -> HttpError:
    status = HTTP_STATUS.get(code, 500)
    reason = metadata.get(headers.ERROR_REASON) or _DEFAULT_REASON.get(code, ErrorReason.INTERNAL)
    if reason == ErrorReason.TOO_LARGE:
        status = 413  # not load: retrying the same request fails the same way
    elif reason == ErrorReason.MODEL_REJECTED:
        # Well-formed, and it fitted the model's declared inputs, but the model could not process
        # it: not a malformed request (400), not a server fault by itself (500).
        status = 422
    retry_after: int | None = None
    if status in (429, 503):
        pushback = metadata.get(headers.RETRY_PUSHBACK_MS, "")
        digits = pushback.isascii() and pushback.isdigit() and len(pushback) < 10
        retry_after = max(1, -(-int(pushback) // 1000)) if digits else DEFAULT_RETRY_AFTER_S
    return HttpError(status, code.name, reason, message, retry_after)


def from_rpc_error(error: grpc.aio.AioRpcError) -> HttpError:
    trailing: Any = error.trailing_metadata() or ()  # grpc-stubs types this as one entry
    metadata = {str(key): value for key, value in trailing if isinstance(value, str)}
    return from_status(error.code(), error.details() or error.code().name, metadata)
