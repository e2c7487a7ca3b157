"""The one place where domain errors become gRPC status codes, and where calls are observed."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from service import errors
from service.metrics import ServiceMetrics

log = logging.getLogger(__name__)

# Servicers take any request/response type; the context's type parameters add nothing here.
Context = grpc.aio.ServicerContext[Any, Any]

_CODES: dict[type[errors.ServiceError], grpc.StatusCode] = {
    errors.ModelNotFound: grpc.StatusCode.NOT_FOUND,
    errors.InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ModelUnavailable: grpc.StatusCode.UNAVAILABLE,
    errors.TooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.ModelLoadError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Unsupported: grpc.StatusCode.UNIMPLEMENTED,
    errors.ModelRunError: grpc.StatusCode.INTERNAL,
    errors.Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def code_for(exc: errors.ServiceError) -> grpc.StatusCode:
    for kind in type(exc).__mro__:
        code = _CODES.get(kind)
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


def deadline_passed(context: Context) -> bool:
    """True once the call's deadline has passed (gRPC then cancels the handler)."""
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


@dataclass
class CallRecord:
    """What a handler learns during a call that the metrics want: the version that answered."""

    version: str = ""


@asynccontextmanager
async def serving(
    context: Context, metrics: ServiceMetrics, method: str, model: str
) -> AsyncIterator[CallRecord]:
    """Wrap one call: map ServiceError to its status (abort), and record count and latency by
    method, model, version and status code. Every call ends in exactly one status."""
    record = CallRecord()
    start = time.perf_counter()
    code = grpc.StatusCode.OK
    try:
        yield record
    except errors.ServiceError as exc:
        code = code_for(exc)
        await context.abort(code, str(exc))
    except (asyncio.CancelledError, GeneratorExit):  # the client went away mid-call or mid-stream
        code = grpc.StatusCode.DEADLINE_EXCEEDED if deadline_passed(context) else grpc.StatusCode.CANCELLED
        raise
    except grpc.aio.AbortError:
        code = context.code()  # abort() set it
        raise
    except Exception:
        code = grpc.StatusCode.INTERNAL
        log.exception("%s on model %r failed", method, model)
        await context.abort(code, f"{method} failed with an internal error; see the server log")
    finally:
        metrics.observe_request(method, model, record.version, code, time.perf_counter() - start)
