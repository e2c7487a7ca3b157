"""The one place where domain errors become gRPC status codes, and where calls are observed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import Any, NoReturn

import grpc

from modelyard.common import headers
from modelyard.common.names import echo
from modelyard.common.reasons import ErrorReason
from modelyard.service import errors, tracing
from modelyard.service.metrics import ServiceMetrics
from modelyard.tensors import TensorError

log = logging.getLogger(__name__)

# Servicers take any request/response type; the context's type parameters add nothing here.
Context = grpc.aio.ServicerContext[Any, Any]

# The one table: each domain error's gRPC status and its x-error-reason (modelyard.common.reasons).
# Looked up along the exception's MRO, so VersionNotFound (a ModelNotFound) finds its own row first.
# TensorError: the shared tensor decoder (modelyard.tensors) found a malformed tensor.
_STATUS: dict[type[BaseException], tuple[grpc.StatusCode, ErrorReason]] = {
    TensorError: (grpc.StatusCode.INVALID_ARGUMENT, ErrorReason.INVALID_ARGUMENT),
    errors.InvalidInput: (grpc.StatusCode.INVALID_ARGUMENT, ErrorReason.INVALID_ARGUMENT),
    # FAILED_PRECONDITION, not INVALID_ARGUMENT ("problematic regardless of the state of the
    # system"): the request conformed to the version's declared signature and another version may
    # serve it; not INTERNAL either, since its values may be what the graph refused.
    errors.ModelRejected: (grpc.StatusCode.FAILED_PRECONDITION, ErrorReason.MODEL_REJECTED),
    errors.ModelNotFound: (grpc.StatusCode.NOT_FOUND, ErrorReason.MODEL_NOT_FOUND),
    errors.VersionNotFound: (grpc.StatusCode.NOT_FOUND, ErrorReason.VERSION_NOT_FOUND),
    errors.ModelUnavailable: (grpc.StatusCode.UNAVAILABLE, ErrorReason.DRAINING),
    errors.TooLarge: (grpc.StatusCode.RESOURCE_EXHAUSTED, ErrorReason.TOO_LARGE),
    errors.ModelLoadError: (grpc.StatusCode.FAILED_PRECONDITION, ErrorReason.MODEL_FAILED),
    errors.Unsupported: (grpc.StatusCode.UNIMPLEMENTED, ErrorReason.UNSUPPORTED),
    errors.ModelRunError: (grpc.StatusCode.INTERNAL, ErrorReason.MODEL_FAILED),
    errors.NotGenerative: (grpc.StatusCode.FAILED_PRECONDITION, ErrorReason.FAILED_PRECONDITION),
    errors.SequenceStateError: (grpc.StatusCode.FAILED_PRECONDITION, ErrorReason.FAILED_PRECONDITION),
    errors.Overloaded: (grpc.StatusCode.RESOURCE_EXHAUSTED, ErrorReason.QUEUE_FULL),
    errors.ShadowDropped: (grpc.StatusCode.RESOURCE_EXHAUSTED, ErrorReason.SHADOW_DROPPED),
    errors.DeadlineExceeded: (grpc.StatusCode.DEADLINE_EXCEEDED, ErrorReason.DEADLINE),
    errors.ReaderStalled: (grpc.StatusCode.ABORTED, ErrorReason.READER_STALLED),
    # Not domain errors, but every way a call ends has its row: the client went away (the
    # deadline's row is chosen by deadline_passed), and anything else is a bug of ours.
    asyncio.CancelledError: (grpc.StatusCode.CANCELLED, ErrorReason.CANCELLED),
    Exception: (grpc.StatusCode.INTERNAL, ErrorReason.INTERNAL),
}
_DEADLINE = _STATUS[errors.DeadlineExceeded]
_OK = grpc.StatusCode.OK
_INTERNAL = _STATUS[Exception]

# The most UTF-8 bytes of an error message sent to a client. Each value a message quotes is capped
# where the message is made (names.echo); this is the net under all of them: a message rides in the
# grpc-message trailer (percent-encoded, up to 3 bytes per byte), and one past the client's
# metadata limit turns the answer into RESOURCE_EXHAUSTED "metadata exceeds hard limit", without
# its reason.
MESSAGE_MAX_BYTES = 2048


def client_message(text: str, limit: int = MESSAGE_MAX_BYTES) -> str:
    """`text` as a client may receive it: at most `limit` bytes of UTF-8, the last three `...`."""
    data = text.encode("utf-8", "backslashreplace")
    if len(data) <= limit:
        return text
    return data[: limit - 3].decode("utf-8", "ignore") + "..."


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, ErrorReason]:
    """The gRPC status code and x-error-reason that answer `exc`."""
    for kind in type(exc).__mro__:
        found = _STATUS.get(kind)
        if found is not None:
            return found
    return _INTERNAL


def reason_metadata(reason: ErrorReason) -> tuple[tuple[str, str], ...]:
    if reason is ErrorReason.SHADOW_DROPPED:
        return _SHADOW_DROPPED
    return ((headers.ERROR_REASON, reason.value),)


# How long a proxy should wait before it mirrors to the service again once a shadow was dropped
# (grpc-retry-pushback-ms): a dropped shadow costs the service a call's CPU on its event loop, and
# one per stable answer while capacity is not spare is real load (docs/repository.md).
SHADOW_PUSHBACK_MS = 100
_SHADOW_DROPPED = (
    (headers.ERROR_REASON, ErrorReason.SHADOW_DROPPED.value),
    (headers.RETRY_PUSHBACK_MS, str(SHADOW_PUSHBACK_MS)),
)


async def abort(context: Context, exc: Exception, method: str = "", model: str = "") -> NoReturn:
    """End the call with exc's status, its message and its reason in the trailing metadata. An
    INTERNAL answer is logged under an error id that its message carries too."""
    code, reason = status_for(exc)
    message = str(exc)
    if code == grpc.StatusCode.INTERNAL:
        message = internal_error(method or "a call", model, message)
    await context.abort(code, client_message(message), trailing_metadata=reason_metadata(reason))
    raise AssertionError("unreachable: abort raises")  # pragma: no cover


def in_band_message(exc: BaseException, method: str, model: str) -> str:
    """The message of an error answered inside a stream (Triton's error_message): as abort's."""
    if status_for(exc)[0] == grpc.StatusCode.INTERNAL:
        return internal_error(method, model, str(exc))
    return client_message(str(exc))


def internal_error(method: str, model: str, message: str, exc: BaseException | None = None) -> str:
    """Log an INTERNAL answer under a fresh error id (with the traceback of a bug of ours) and
    return the message for the client, which carries the same id."""
    error_id = secrets.token_hex(6)
    log.error(
        "%s on model %s failed [error id %s]%s",
        method,
        echo(model),
        error_id,
        f": {message}" if message else "",
        exc_info=exc,
    )
    detail = message or f"{method} failed with an internal error"
    # The id last, so that capping a long message never cuts it off.
    suffix = f" [error id {error_id}; the server log has the details]"
    return client_message(detail, MESSAGE_MAX_BYTES - len(suffix)) + suffix


_ending: set[asyncio.Task[None]] = set()


def end_stalled(context: Context, error: BaseException) -> None:
    """End a stream whose reader stalled. Its handler is blocked writing (HTTP/2 flow control),
    so the status is sent from a task of its own: it follows the messages already written, once
    the client reads them (or goes away)."""

    async def abort_stalled() -> None:
        # abort() raises AbortError once the status is set; the handler ends with it.
        code, reason = status_for(error)
        with contextlib.suppress(Exception):
            await context.abort(code, client_message(str(error)), trailing_metadata=reason_metadata(reason))

    task = asyncio.get_running_loop().create_task(abort_stalled())
    _ending.add(task)
    task.add_done_callback(_ending.discard)


# A call cancelled this close to its deadline counts as the deadline's. The server's deadline is
# its receipt of the headers plus grpc-timeout, so it runs later than the client's by however late
# the server read them (milliseconds on a loaded host): the client's own deadline fires first and
# its RST_STREAM reaches the handler while time_remaining() is still a little above 0.
DEADLINE_SLACK_S = 0.05


def deadline_passed(context: Context) -> bool:
    """True once the call's deadline has passed, or all but DEADLINE_SLACK_S of it (gRPC then
    cancels the handler, or the client's own deadline timer has)."""
    remaining = context.time_remaining()
    return remaining is not None and remaining <= DEADLINE_SLACK_S


_QUEUE_US, _RUN_US = headers.QUEUE_US, headers.RUN_US

# ("x-served-by", "worker-N") when the service runs as one of several workers, else nothing.
_served_by: tuple[tuple[str, str], ...] = ()


# The answer's metadata by version, built once per version (a tuple of tuples per request
# otherwise). Versions are few (a model's served versions, ever): the dict stays small.
_answer_metadata: dict[str, tuple[tuple[str, str], ...]] = {}


def set_served_by(worker: str) -> None:
    """Name the worker process in every answer's metadata, beside x-served-version."""
    global _served_by
    _served_by = ((headers.SERVED_BY, worker),)
    _answer_metadata.clear()


def answer_metadata(version: str) -> tuple[tuple[str, str], ...]:
    """x-served-version (and x-served-by in a worker) of an answer from `version`."""
    metadata = _answer_metadata.get(version)
    if metadata is None:
        metadata = ((headers.SERVED_VERSION, version), *_served_by)
        if len(_answer_metadata) < 1024:  # a bound, should versions ever be many
            _answer_metadata[version] = metadata
    return metadata


def _span_reason(exc: BaseException) -> str:
    """The x-error-reason a call that raised `exc` ended with, for its span's status; empty where
    the code tells (abort() answered it, or the client went away)."""
    if isinstance(exc, grpc.aio.AbortError | asyncio.CancelledError | GeneratorExit):
        return ""
    return status_for(exc)[1].value


class serving:
    """Wrap one call: map an error to its status and x-error-reason (abort), say which version
    answered (x-served-version), and record count and latency by method, model, version and
    status code. Every call ends in exactly one status.

    A class rather than an @asynccontextmanager: it runs on every request, and a generator-based
    context manager costs several microseconds more per call."""

    __slots__ = (
        "_code",
        "_context",
        "_method",
        "_metrics",
        "_model",
        "_reason",
        "_span",
        "_start",
        "version",
    )

    def __init__(self, context: Context, metrics: ServiceMetrics, method: str, model: str) -> None:
        """The call is observed from here (its clock and span start): `async with serving(...)`,
        or a unary path's own `call = serving(...)`, then on success `call.done()`, on an error
        `await call.failed(exc)` and re-raise (no coroutine per call unless it fails)."""
        self._context = context
        self._metrics = metrics
        self._method = method
        self._model = model
        self._code = _OK  # an error answered in-band (KServe streams) sets it
        self._reason = ""  # and its x-error-reason (a span is ERROR only for a server fault)
        self.version = ""  # the version that answered: x-served-version, and the metrics label
        self._start = time.perf_counter()
        self._span: object = tracing.start(context, method, model)

    def answered(self, version: str) -> None:
        """A unary call's version that answers: x-served-version rides in the trailing metadata,
        with the answer's status. Not the initial metadata: grpc.aio sends initial metadata set by
        the handler as a batch of its own (a write to the transport of its own per call), the
        trailing metadata in the final batch. An error after this replaces it with its x-error-reason."""
        self.version = version
        # answer_metadata's common case (a version that answered before), with no call
        self._context.set_trailing_metadata(_answer_metadata.get(version) or answer_metadata(version))

    def answered_run(self, version: str, queue_ns: int, run_ns: int) -> None:
        """`answered`, for an inference call: its run's own queue and run time (x-queue-us,
        x-run-us, microseconds) ride beside x-served-version in the trailing metadata."""
        self.version = version
        base = _answer_metadata.get(version) or answer_metadata(version)
        self._context.set_trailing_metadata(
            (*base, (_QUEUE_US, str(queue_ns // 1000)), (_RUN_US, str(run_ns // 1000)))
        )

    async def stream_answered(self, version: str) -> None:
        """A stream's version that answers: x-served-version in the initial metadata, before the
        first message (call it before yielding that message)."""
        self.version = version
        await self._context.send_initial_metadata(answer_metadata(version))

    def in_band(self, exc: Exception) -> ErrorReason:
        """An error answered inside a stream's message rather than by the call's status: count it
        under its status code, and return its reason for the message."""
        self._code, reason = status_for(exc)
        self._reason = reason
        return reason

    def done(self, code: grpc.StatusCode | None = None, exc: BaseException | None = None) -> None:
        """The call answered: record it (its span, its metrics); `failed` gives the code it
        answered with, and the exception. (One function: the success path's only call here.)"""
        if code is None:
            code = self._code
        # A call that failed after its version was resolved counts (and traces) with it.
        version = self.version or tracing.resolved_version()
        if self._span is not None:
            tracing.end(self._span, version, code, self._reason if exc is None else _span_reason(exc))
        self._metrics.observe_request(
            self._method, self._model, version, code, time.perf_counter() - self._start
        )

    async def __aenter__(self) -> serving:
        return self  # observed since __init__ (the unary paths skip this: one call fewer)

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if exc is None:
            self.done()
        else:
            await self.failed(exc)

    async def failed(self, exc: BaseException) -> None:
        """The call raised `exc`: answer it with its status and reason (abort raises
        AbortError), or, where gRPC has answered already, return (the caller re-raises `exc`);
        record it either way."""
        code = self._code
        try:
            if isinstance(exc, errors.ServiceError | TensorError):
                code, reason = status_for(exc)
                message = str(exc)
                if code == grpc.StatusCode.INTERNAL:  # a runtime failure on valid-looking input
                    message = internal_error(self._method, self._model, message)
                await self._context.abort(
                    code, client_message(message), trailing_metadata=reason_metadata(reason)
                )
            elif isinstance(exc, asyncio.CancelledError | GeneratorExit):  # the client went away
                # gRPC has answered the client already (CANCELLED, or DEADLINE_EXCEEDED from its own
                # deadline timer); the reason is set for completeness and for anything reading the
                # call's metadata on this side.
                code, reason = (
                    _DEADLINE if deadline_passed(self._context) else _STATUS[asyncio.CancelledError]
                )
                self._context.set_trailing_metadata(reason_metadata(reason))
            elif isinstance(exc, grpc.aio.AbortError):
                code = self._context.code()  # abort() set it, with its reason
            elif isinstance(exc, Exception):
                code, reason = _INTERNAL
                await self._context.abort(
                    code,
                    internal_error(self._method, self._model, "", exc),
                    trailing_metadata=reason_metadata(reason),
                )
        finally:
            self.done(code, exc)
