"""The proxy: every method of the service forwarded as bytes (no decode, no re-encode).

Data calls (Infer, InferStream, Generate, KServe ModelInfer and ModelStreamInfer) are dyed
(dyeing.py), guarded by breakers (breakers.py) and tenant limits (tenant_limits.py); the chosen version
travels as field 2 (appended to the message: the last occurrence wins on the wire) and as the
`x-model-version` header. Other calls go to an upstream that serves the named model, or any.
Metadata, deadline, cancellation and the full status (code, message, trailers) pass through;
an error without `x-error-reason` gets one (forward.client_status), and a status message is capped.

One path per call, the same for every kind of method: the call's scope opens (scope.py: span,
calls in flight, tenant slot, metrics); the layers (layers/: read -> route -> balance) make its
first attempt; the one attempt loop (`_attempts`) sends it (forward.py moves the bytes) and, when
it fails before anything reached the caller and the method's retry rule allows (layers/retry.py
RULES), asks the retry policy for the next one, or lets the failure be the answer; a unary
answer is passed on (a stable one may be mirrored to the canary: shadow/mirror.py), a response stream
relayed; the scope closes.

Names and versions are checked at this edge (modelyard.common.names) before they reach any
state. Only models and versions the upstreams serve (WatchModels) get breakers and their own
metric label; anything else is forwarded without state under the label `_other`. Breakers learn
who each call came from (layers.read.caller_key), so that no single caller opens one (breaker_policy.py).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
from grpc_reflection.v1alpha import reflection_pb2

from modelyard.common import headers
from modelyard.common.reasons import ErrorReason
from modelyard.inference.v1 import inference_service_pb2, model_service_pb2
from modelyard.kserve.v2 import grpc_service_pb2
from modelyard.process import request_metadata
from modelyard.process.drain import Drain
from modelyard.process.request_metadata import invocation_metadata
from modelyard.sidecar import forward, sequences
from modelyard.sidecar.breakers import Breakers
from modelyard.sidecar.layers import attempt as attempts
from modelyard.sidecar.layers import balance, read, retry, route
from modelyard.sidecar.layers.read import Refused
from modelyard.sidecar.metrics import SidecarMetrics
from modelyard.sidecar.model_views import ModelViews
from modelyard.sidecar.routes.route_table import RouteSource
from modelyard.sidecar.scope import Scope, Scopes
from modelyard.sidecar.shadow.compare import Shadows, token_ids
from modelyard.sidecar.shadow.mirror import Mirror
from modelyard.sidecar.tenant_limits import TenantLimits
from modelyard.sidecar.tracing import Tracing
from modelyard.sidecar.upstreams import Upstream, Upstreams

Context = grpc.aio.ServicerContext[bytes, bytes]
if TYPE_CHECKING:
    _Handler = grpc.GenericRpcHandler[bytes, bytes]
    _MethodHandler = grpc.RpcMethodHandler[bytes, bytes]
else:
    _Handler = grpc.GenericRpcHandler
    _MethodHandler = grpc.RpcMethodHandler
Attempt = attempts.Attempt[Upstream]
# An attempt's exchange with its upstream (forward.ask, forward.opened, forward.opened_unchecked):
# (upstream, path, kind, request, metadata, time left, flight) -> its answer, or `forward.Failed`.
Exchange = Callable[..., Awaitable[Any]]

_DATA_METHODS = frozenset(
    {
        "/modelyard.inference.v1.InferenceService/Infer",
        "/modelyard.inference.v1.InferenceService/InferStream",
        "/modelyard.inference.v1.InferenceService/Generate",
        "/inference.GRPCInferenceService/ModelInfer",
        "/inference.GRPCInferenceService/ModelStreamInfer",
    }
)
# Calls whose fields 1 and 2 are a model name and version, but that are not dyed.
_MODEL_METHODS = frozenset(
    {
        "/inference.GRPCInferenceService/ModelReady",
        "/inference.GRPCInferenceService/ModelMetadata",
        "/inference.GRPCInferenceService/ModelConfig",
        "/inference.GRPCInferenceService/ModelStatistics",
    }
)


@dataclass(frozen=True, slots=True)
class MethodInfo:
    """One method as the proxy serves it, composed once at start."""

    path: str
    kind: str  # unary_unary, unary_stream, stream_unary or stream_stream
    routed: bool  # dyed, guarded by breakers and tenant limits
    model_addressed: bool  # fields 1 and 2 name the model and version
    rule: retry.Rule  # how its attempts are retried and judged (retry.RULES[kind])


def method_table() -> dict[str, MethodInfo]:
    services = [
        inference_service_pb2.DESCRIPTOR.services_by_name["InferenceService"],
        model_service_pb2.DESCRIPTOR.services_by_name["ModelService"],
        grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"],
        reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
    ]
    table = {}
    for service in services:
        for method in service.methods:
            path = f"/{service.full_name}/{method.name}"
            kind = ("stream" if method.client_streaming else "unary") + (
                "_stream" if method.server_streaming else "_unary"
            )
            routed = path in _DATA_METHODS
            addressed = routed or path in _MODEL_METHODS
            table[path] = MethodInfo(path, kind, routed, addressed, retry.RULES[kind])
    # grpcurl and friends ask for reflection v1 first; the service answers v1alpha only, and
    # the messages are the same, so forward v1 where the upstream knows it and let it answer.
    table["/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"] = MethodInfo(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        "stream_stream",
        False,
        False,
        retry.RULES["stream_stream"],
    )
    return table


class Proxy(_Handler):
    def __init__(
        self,
        upstreams: Upstreams,
        breakers: Breakers,
        routes: RouteSource,
        limits: TenantLimits,
        metrics: SidecarMetrics,
        tracing: Tracing,
        shadows: Shadows,
        drain: Drain | None = None,
    ) -> None:
        self._mirror = Mirror(upstreams, breakers, routes, shadows)
        self._upstreams = upstreams
        self._breakers = breakers
        self._routes = routes
        self._limits = limits
        self._tracing = tracing
        self._scopes = Scopes(limits, metrics, tracing)
        self.views = ModelViews(routes, upstreams)  # cleared by the sidecar on every change
        self._names = read.Names()  # the model names seen valid
        self._sequences = sequences.SequencePins()  # where each stateful sequence's steps go
        self._view_of = self.views.of
        self._handlers: dict[str, _MethodHandler] = {}
        for info in method_table().values():
            handler = self._make_handler(info)
            # Outermost: the call counts until gRPC ended it, and is refused once shutting down.
            self._handlers[info.path] = drain.wrap(info.path, handler) if drain is not None else handler

    @property
    def limits(self) -> TenantLimits:
        return self._limits

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> _MethodHandler | None:
        request_metadata.keep(handler_call_details.invocation_metadata)  # not built twice a call
        return self._handlers.get(handler_call_details.method)

    async def drain(self, within_s: float) -> None:
        """Shutdown: give calls in flight `within_s` to finish, then end the rest with `draining`
        (before gRPC's own grace runs out and it cancels them)."""
        await self._scopes.drain(within_s)

    def _make_handler(self, info: MethodInfo) -> _MethodHandler:
        """The method's handler, composed once: its kind's path (`_unary` or `_stream`) and its
        kind's exchange with the upstream."""
        if info.kind == "unary_unary":
            # The path itself is the handler (no coroutine of its own around it): a call's frames
            # are the sidecar's per-call CPU beyond the bare proxy's.
            return grpc.unary_unary_rpc_method_handler(functools.partial(self._unary, info))
        if info.kind == "stream_unary":

            async def stream_unary(requests: AsyncIterator[bytes], context: Context) -> bytes:
                return await self._unary(info, await _first(requests), context, requests)

            return grpc.stream_unary_rpc_method_handler(stream_unary)
        # Response streams are written (forward.send), not yielded: a write that fails because the
        # caller has gone fails here, where it is told from a fault. Only a stream that may be
        # retried waits to see whether it ended before its first message (forward.opened).
        exchange = forward.opened if info.rule.retried else forward.opened_unchecked
        if info.kind == "unary_stream":

            async def unary_stream(request: bytes, context: Context) -> None:
                await forward.send(self._stream(info, exchange, request, None, context), context)

            return grpc.unary_stream_rpc_method_handler(unary_stream)

        async def stream_stream(requests: AsyncIterator[bytes], context: Context) -> None:
            messages = self._stream(info, exchange, await _first(requests), requests, context)
            await forward.send(messages, context)

        return grpc.stream_stream_rpc_method_handler(stream_stream)

    # --- the path of a call ----------------------------------------------------------------

    async def _attempts(
        self,
        info: MethodInfo,
        exchange: Exchange,
        first: bytes | None,
        more: AsyncIterator[bytes] | None,
        scope: Scope,
        context: Context,
    ) -> tuple[Attempt, Any, Any, float]:
        """The one attempt loop, for every kind of method: the call's first attempt (or the
        sidecar's refusal), sent by `exchange`; while an attempt fails before anything reached
        the caller and its method's rule lets it be retried (the caller sent one message, which
        can be sent again), the retry policy's next attempt. Returns the attempt that answered,
        its client span (its caller ends it), `exchange`'s answer and when it started. The
        failure that is the answer is answered here (`_fail`), but a response stream's, which
        its relay answers as it answers any error a stream ends with (forward.EndedEarly)."""
        try:
            attempt = self._first_attempt(info, first, scope, context)
        except Refused as refused:
            await self._refuse(scope, refused, context)
        retried = info.rule.retried and more is None
        deadline_timed = info.rule.deadline_timed
        path, kind = info.path, info.kind
        tried: list[Upstream] = []
        while True:
            scope.begin(attempt)
            if more is not None and path == sequences.MODEL_STREAM_INFER:
                # The sequences' steps on the stream are pinned where it goes.
                more = self._sequences.follow(more, attempt)
            started = time.perf_counter()
            request = (
                attempt.body(first or b"") if more is None else forward.requests(first, more, attempt.body)
            )
            # The attempt's client span (None: untraced or not sampled).
            metadata, client = scope.span.attempt(attempt, path)
            try:
                time_left = context.time_remaining()
                answer = await exchange(attempt.upstream, path, kind, request, metadata, time_left, scope)
            except forward.Failed as failed:
                scope.code = failed.code
                # The caller's own deadline (ours is the caller's) is no fault; its duration
                # still tells how slow the upstream was.
                timed_out = deadline_timed and failed.code == grpc.StatusCode.DEADLINE_EXCEEDED
                took = time.perf_counter() - started if timed_out and not failed.reason else None
                following = self._after_failure(attempt, failed, tried) if retried else None
                scope.failed(failed.code.name, failed.reason, took, following)
                if following is None and isinstance(failed, forward.EndedEarly):
                    return scope.current or attempt, client, failed.call, started
                if client is not None:
                    self._tracing.failed(client, failed.code, failed.reason)
                    client.end()
                if following is None:
                    await self._fail(scope, failed, context)
                attempt = following
                continue
            except BaseException:
                if client is not None:
                    client.end()
                raise
            return attempt, client, answer, started

    async def _unary(
        self,
        info: MethodInfo,
        first: bytes | None,
        context: Context,
        more: AsyncIterator[bytes] | None = None,
    ) -> bytes:
        """A call with one response: unary-unary, or stream-unary (`more`: the rest of the
        caller's stream, which cannot be sent twice, so such a call is never retried)."""
        # The scope closes in `finally` (no `with` block: its two calls are spared).
        scope = Scope(self._scopes, info.path, tuple(invocation_metadata(context)))
        try:
            attempt, client, answer, started = await self._attempts(
                info, forward.ask, first, more, scope, context
            )
            if client is not None:
                client.end()
            response: bytes = answer[0]
            initial, trailing = answer[1], answer[2]
            scope.code = grpc.StatusCode.OK  # this attempt answered, whatever an earlier one did
            # A version's latency is the service's own measure of its run (x-run-us): what
            # another version sharing the service cannot inflate, as it inflates the call's
            # duration; the duration when the answer carries none.
            latency = None
            if info.rule.answer_timed:
                latency = forward.run_seconds(trailing)
                if latency is None:
                    latency = time.perf_counter() - started
            scope.report("OK", "", latency)
            if initial:  # the service's unary answers carry none (docs/api.md)
                await context.send_initial_metadata(initial)
            forward.answer(context, trailing, attempt.answer_metadata)
            asked = attempt.asked
            if asked is not None and asked.view.mirrored and first is not None and more is None:
                self._mirror.answered(info.path, attempt, first, response)
            return response
        except asyncio.CancelledError:
            await self._cancelled(scope, context)
            raise
        finally:
            scope.close()

    async def _stream(
        self,
        info: MethodInfo,
        exchange: Exchange,
        first: bytes | None,
        more: AsyncIterator[bytes] | None,
        context: Context,
    ) -> AsyncGenerator[bytes, None]:
        """A call with a response stream: unary-stream, or stream-stream (`more`). Retried only
        when it ended before its first message (a trailers-only answer): nothing reached the
        caller yet, so an unreachable upstream or a canary fault is retried as for unary calls."""
        with self._scopes.open(info.path, tuple(invocation_metadata(context))) as scope:
            call: Any = None
            try:
                attempt, client, call, _ = await self._attempts(info, exchange, first, more, scope, context)
                try:  # the attempt's client span, if any, ends in `finally`
                    shadowed = self._mirror.tokens(info.path, attempt, first)
                    async for message in forward.relay(call, context, attempt.answer_metadata):
                        if shadowed is not None:
                            shadowed.extend(token_ids(message))
                        yield message
                    if shadowed is not None and first is not None:
                        self._mirror.generated(attempt, first, shadowed)
                except forward.Failed as failed:
                    scope.code = failed.code
                    scope.report(failed.code.name, failed.reason, None)
                    if client is not None:
                        self._tracing.failed(client, failed.code, failed.reason)
                    await self._fail(scope, failed, context)
                finally:
                    if client is not None:
                        client.end()
            except GeneratorExit:
                scope.code = grpc.StatusCode.CANCELLED
                raise
            except asyncio.CancelledError:
                await self._cancelled(scope, context)
                raise
            finally:
                call = call if call is not None else scope.call
                if call is not None and not call.done():
                    call.cancel()  # the client went away: so does the upstream call, at once

    def _first_attempt(
        self, info: MethodInfo, first: bytes | None, scope: Scope, context: Context
    ) -> Attempt:
        """The call's first attempt, through the layers: what it asks for (read), its route, a
        tenant slot (the scope's), an upstream whose breaker lets it through (balance); or
        `Refused` (see `_refuse`). A plain function, not a coroutine: only a refusal awaits."""
        upstreams = self._upstreams
        # Positional arguments: a keyword costs the call its fast path.
        asked = read.read(first, scope.metadata, self._view_of, self._names, info.model_addressed)
        if not info.routed:
            return balance.unrouted_first(asked, upstreams, info.model_addressed)
        routed = route.decide(asked, self._breakers)
        table = asked.view.table  # the table the model's view was made under
        tenant = read.tenant_bucket(table.tenants, asked.received)
        if tenant:
            scope.admit(tenant, table.tenants)
        caller = scope.caller = read.caller_key(asked.received, table.stickiness_header, context.peer)
        breakers = self._breakers
        if info.path in sequences.METHODS and first and (step := sequences.read_step(first)) is not None:
            # A stateful sequence's step: where its sequence lives (sequences.py).
            routed, exclude = self._sequences.route(asked, routed, step, upstreams)
            attempt = balance.first(asked, routed, caller, upstreams, breakers, exclude)
            self._sequences.routed(attempt, step)
            return attempt
        return balance.first(asked, routed, caller, upstreams, breakers)

    async def _refuse(self, scope: Scope, refused: Refused, context: Context) -> NoReturn:
        """The sidecar answers the call itself (a bad name, a tenant limit, no upstream left)."""
        await context.abort(scope.refused(refused), str(refused), refused.metadata)

    def _after_failure(
        self, attempt: Attempt, failed: forward.Failed, tried: list[Upstream]
    ) -> Attempt | None:
        """The retry policy's next attempt after a failed one, with its model's view now."""
        return retry.after_failure(
            attempt,
            failed.code.name,
            failed.reason,
            tried,
            self._view_of(attempt.model),
            self._upstreams,
            self._breakers,
        )

    async def _fail(self, scope: Scope, failed: forward.Failed, context: Context) -> NoReturn:
        """The upstream's error is the answer (forward.client_status), with the sidecar's own
        headers of the call's last attempt."""
        code, details, md = forward.client_status(failed.code, failed.details, failed.trailing)
        scope.code, scope.reason = code, forward.error_reason(md)
        added = scope.current.answer_metadata if scope.current is not None else ()
        await context.abort(code, details, forward.with_metadata(md, added))

    async def _cancelled(self, scope: Scope, context: Context) -> None:
        """The caller cancelled: so be it. Or the sidecar is shutting down and this call outlived
        the grace (the drain cancelled its upstream call): the client gets UNAVAILABLE/`draining`
        (retry elsewhere), never a CANCELLED it did not ask for."""
        if not scope.ended_by_drain():
            scope.code = grpc.StatusCode.CANCELLED
            return
        scope.code = grpc.StatusCode.UNAVAILABLE
        scope.report(scope.code.name, "", None, gone=True)
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            "the sidecar is shutting down; retry the call",
            ((headers.ERROR_REASON, ErrorReason.DRAINING.value),),
        )


async def _first(requests: AsyncIterator[bytes]) -> bytes | None:
    """The first message of the caller's stream (it names the model), or None for none."""
    async for message in requests:
        return message
    return None
