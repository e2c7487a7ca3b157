"""The access log of a gRPC server: one line per call, and the call's context for its log lines.

The access line is written when the call ends, on the `modelyard.access` logger at INFO: method,
code, reason (`x-error-reason`), duration, peer, request_id, model, version (the context itself:
modelyard.process.calls).

For gRPC the context is set by `CallLog`, an interceptor that a process installs only when it is
wanted (`--access-log`, or `--log-format json` for the fields on other lines): no per-call cost
otherwise. Health checks and reflection are not logged (a kubelet probes every few seconds).
The HTTP gateway sets the same context in its own middleware (modelyard.gateway.app).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeAlias

import grpc

from modelyard.common import headers
from modelyard.process.calls import call, note, write

# grpc's type stubs describe the sync API: handlers and contexts are Any here, as in the service.
Handler: TypeAlias = Any
Context: TypeAlias = Any
# Methods no line is written for: probes and tooling, not callers' traffic.
QUIET_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def _from_message(message: object) -> None:
    """Model and version from a typed request or reply that has them (our API and KServe's)."""
    model = getattr(message, "model_name", None)
    version = getattr(message, "model_version", None)
    note(model=model if isinstance(model, str) else "", version=version if isinstance(version, str) else "")


def _metadata_value(pairs: Any, key: str) -> str:
    for name, value in pairs or ():
        if name == key:
            return value if isinstance(value, str) else value.decode("latin-1")
    return ""


def _kind(handler: Any) -> str:
    """The name of the handler's behaviour field, by its call kind."""
    streams_in, streams_out = handler.request_streaming, handler.response_streaming
    return f"{'stream' if streams_in else 'unary'}_{'stream' if streams_out else 'unary'}"


def _noted(source: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async def noted() -> AsyncIterator[Any]:
        first = True
        async for message in source:
            if first:
                _from_message(message)
                first = False
            yield message

    return noted()


def _request_noted(request: Any, streaming: bool) -> Any:
    if streaming:
        return _noted(request)
    _from_message(request)
    return request


def noting(method: str, handler: Any) -> Any:
    """The handler, noting the model and version of its first request and reply for the call's
    context: typed messages only (bytes pass as they are). Also a request-pipeline wrapper (the
    service puts it inside its decoding, where requests are messages)."""
    if handler is None or method.startswith(QUIET_PREFIXES):
        return handler
    kind = _kind(handler)
    behaviour = getattr(handler, kind)
    streaming = bool(handler.request_streaming)
    wrapped: Any
    # A streaming handler may be a coroutine that writes with context.write: awaited as is.
    if handler.response_streaming and inspect.isasyncgenfunction(behaviour):

        async def replies(request: Any, context: Context) -> AsyncIterator[Any]:
            first = True
            async for reply in behaviour(_request_noted(request, streaming), context):
                if first:
                    _from_message(reply)
                    first = False
                yield reply

        wrapped = replies
    else:

        async def reply(request: Any, context: Context) -> Any:
            answer = await behaviour(_request_noted(request, streaming), context)
            _from_message(answer)
            return answer

        wrapped = reply
    return handler._replace(**{kind: wrapped})


class CallLog(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Sets each call's context; writes its access line when `access` is on."""

    def __init__(self, access: bool) -> None:
        self.access = access

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(details)
        method: str = details.method
        if handler is None or method.startswith(QUIET_PREFIXES):
            return handler
        handler = noting(method, handler)
        request_id = _metadata_value(details.invocation_metadata, headers.REQUEST_ID)
        kind = _kind(handler)
        behaviour = getattr(handler, kind)
        ended = self._ended
        wrapped: Any
        if handler.response_streaming and inspect.isasyncgenfunction(behaviour):

            async def replies(request: Any, context: Context) -> AsyncIterator[Any]:
                with call(method, request_id) as fields:
                    started, failure = time.perf_counter(), None
                    try:
                        async for reply in behaviour(request, context):
                            yield reply
                    except BaseException as exc:
                        failure = exc
                        raise
                    finally:
                        ended(fields, context, started, failure)

            wrapped = replies
        else:

            async def reply(request: Any, context: Context) -> Any:
                with call(method, request_id) as fields:
                    started, failure = time.perf_counter(), None
                    try:
                        return await behaviour(request, context)
                    except BaseException as exc:
                        failure = exc
                        raise
                    finally:
                        ended(fields, context, started, failure)

            wrapped = reply
        return handler._replace(**{kind: wrapped})

    def _ended(
        self,
        fields: Mapping[str, str],
        context: Context,
        started: float,
        failure: BaseException | None,
    ) -> None:
        if self.access:
            reason = _metadata_value(context.trailing_metadata(), headers.ERROR_REASON)
            write(
                fields, _code(context, failure), reason, time.perf_counter() - started, context.peer() or ""
            )


def _code(context: Context, failure: BaseException | None) -> str:
    if isinstance(failure, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED.name
    code: object = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):  # grpc.aio keeps the code set by set_code/abort as its int value
        return next((c.name for c in grpc.StatusCode if c.value[0] == code), str(code))
    return grpc.StatusCode.UNKNOWN.name if failure is not None else grpc.StatusCode.OK.name


def interceptors(access_log: bool, log_format: str) -> list[CallLog]:
    """What a gRPC server installs: the call context when the access log or JSON logs want it."""
    return [CallLog(access_log)] if access_log or log_format == "json" else []
