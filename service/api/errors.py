"""The one place where domain errors become gRPC status codes, and where calls are observed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import Any

import grpc
from modelyard.tensors import TensorError

from service import errors
from service.metrics import ServiceMetrics

log = logging.getLogger(__name__)

# Servicers take any request/response type; the context's type parameters add nothing here.
Context = grpc.aio.ServicerContext[Any, Any]

# TensorError: the shared tensor decoder (modelyard.tensors) found a malformed tensor.
_CODES: dict[type[Exception], grpc.StatusCode] = {
    TensorError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ModelNotFound: grpc.StatusCode.NOT_FOUND,
    errors.InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ModelUnavailable: grpc.StatusCode.UNAVAILABLE,
    errors.TooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.ModelLoadError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Unsupported: grpc.StatusCode.UNIMPLEMENTED,
    errors.ModelRunError: grpc.StatusCode.INTERNAL,
    errors.NotGenerative: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.ReaderStalled: grpc.StatusCode.ABORTED,
}


def code_for(exc: Exception) -> grpc.StatusCode:
    for kind in type(exc).__mro__:
        code = _CODES.get(kind)
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


def internal_error(method: str, model: str, message: str, exc: BaseException | None = None) -> str:
    """Log an INTERNAL answer under a fresh error id (with the traceback of a bug of ours) and
    return the message for the client, which carries the same id."""
    error_id = secrets.token_hex(6)
    log.error(
        "%s on model %r failed [error id %s]%s",
        method,
        model,
        error_id,
        f": {message}" if message else "",
        exc_info=exc,
    )
    detail = message or f"{method} failed with an internal error"
    return f"{detail} [error id {error_id}; the server log has the details]"


_ending: set[asyncio.Task[None]] = set()


def end_stalled(context: Context, error: BaseException) -> None:
    """End a stream whose reader stalled. Its handler is blocked writing (HTTP/2 flow control),
    so the status is sent from a task of its own: it follows the messages already written, once
    the client reads them (or goes away)."""

    async def abort() -> None:
        # abort() raises AbortError once the status is set; the handler ends with it.
        with contextlib.suppress(Exception):
            await context.abort(grpc.StatusCode.ABORTED, str(error))

    task = asyncio.get_running_loop().create_task(abort())
    _ending.add(task)
    task.add_done_callback(_ending.discard)


def deadline_passed(context: Context) -> bool:
    """True once the call's deadline has passed (gRPC then cancels the handler)."""
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


class serving:
    """Wrap one call: map ServiceError to its status (abort), and record count and latency by
    method, model, version and status code. Every call ends in exactly one status.

    A class rather than an @asynccontextmanager: it runs on every request, and a generator-based
    context manager costs several microseconds more per call."""

    __slots__ = ("_context", "_method", "_metrics", "_model", "_start", "version")

    def __init__(self, context: Context, metrics: ServiceMetrics, method: str, model: str) -> None:
        self._context = context
        self._metrics = metrics
        self._method = method
        self._model = model
        self._start = 0.0
        self.version = ""  # the version that answered, set by the handler for the metrics

    async def __aenter__(self) -> serving:
        self._start = time.perf_counter()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        code = grpc.StatusCode.OK
        try:
            if exc is None:
                return
            if isinstance(exc, errors.ServiceError | TensorError):
                code = code_for(exc)
                message = str(exc)
                if code == grpc.StatusCode.INTERNAL:  # a runtime failure on valid-looking input
                    message = internal_error(self._method, self._model, message)
                await self._context.abort(code, message)
            elif isinstance(exc, asyncio.CancelledError | GeneratorExit):  # the client went away
                code = (
                    grpc.StatusCode.DEADLINE_EXCEEDED
                    if deadline_passed(self._context)
                    else grpc.StatusCode.CANCELLED
                )
            elif isinstance(exc, grpc.aio.AbortError):
                code = self._context.code()  # abort() set it
            elif isinstance(exc, Exception):
                code = grpc.StatusCode.INTERNAL
                await self._context.abort(code, internal_error(self._method, self._model, "", exc))
        finally:
            self._metrics.observe_request(
                self._method, self._model, self.version, code, time.perf_counter() - self._start
            )
