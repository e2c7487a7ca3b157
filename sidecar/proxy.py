"""The proxy: every method of the service forwarded as bytes (no decode, no re-encode).

Data calls (Infer, InferStream, Generate, KServe ModelInfer and ModelStreamInfer) are dyed
(routing.py), guarded by breakers (breakers.py) and tenant limits (limits.py); the chosen version
travels as field 2 (appended to the message: the last occurrence wins on the wire) and as the
`x-model-version` header. Other calls go to an upstream that serves the named model, or any.
Metadata, deadline, cancellation and the full status (code, message, trailers) pass through;
an error without `x-error-reason` gets one (forward.client_status), and a status message is capped.

One path per call: the call's scope opens (scope.py: span, calls in flight, tenant slot,
metrics), the planner (plan.py) reads the call and plans its first attempt, the forwarder
(forward.py) moves the attempt's bytes; a failed attempt goes back to the planner, which names
the next one or lets the failure be the answer; a stable answer may be mirrored to the canary
(mirror.py); the scope closes.

Names and versions are checked at this edge (modelyard.common.names) before they reach any
state. Only models and versions the upstreams serve (WatchModels) get breakers and their own
metric label; anything else is forwarded without state under the label `_other`. Breakers learn
who each call came from (plan.caller_key), so that no single caller opens one (adaptive.py).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator
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
from modelyard.sidecar import plan as planner
from modelyard.sidecar.breakers import Breakers
from modelyard.sidecar.limits import TenantLimits
from modelyard.sidecar.metrics import SidecarMetrics
from modelyard.sidecar.mirror import Mirror
from modelyard.sidecar.plan import Refused
from modelyard.sidecar.routes import RouteSource
from modelyard.sidecar.scope import Scope, Scopes
from modelyard.sidecar.shadow import Shadows, token_ids
from modelyard.sidecar.tracing import Tracing
from modelyard.sidecar.upstreams import Upstream, Upstreams
from modelyard.sidecar.views import ModelViews

Context = grpc.aio.ServicerContext[bytes, bytes]
if TYPE_CHECKING:
    _Handler = grpc.GenericRpcHandler[bytes, bytes]
    _MethodHandler = grpc.RpcMethodHandler[bytes, bytes]
else:
    _Handler = grpc.GenericRpcHandler
    _MethodHandler = grpc.RpcMethodHandler
Plan = planner.Plan[Upstream]

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
    path: str
    kind: str  # unary_unary, unary_stream, stream_unary or stream_stream
    routed: bool  # dyed, guarded by breakers and tenant limits
    model_addressed: bool  # fields 1 and 2 name the model and version


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
            table[path] = MethodInfo(path, kind, routed, routed or path in _MODEL_METHODS)
    # grpcurl and friends ask for reflection v1 first; the service answers v1alpha only, and
    # the messages are the same, so forward v1 where the upstream knows it and let it answer.
    table["/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"] = MethodInfo(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", "stream_stream", False, False
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
        if info.kind == "unary_unary":
            # The path itself is the handler (no coroutine of its own around it): a call's frames
            # are the sidecar's per-call CPU beyond the bare proxy's.
            return grpc.unary_unary_rpc_method_handler(functools.partial(self._unary, info))
        if info.kind == "stream_unary":

            async def stream_unary(requests: AsyncIterator[bytes], context: Context) -> bytes:
                return await self._unary(info, await _first(requests), context, requests)

            return grpc.stream_unary_rpc_method_handler(stream_unary)
        # Response streams are written (forward.send), not yielded: a write that fails because the
        # caller has gone fails here, where it is told from a fault.
        if info.kind == "unary_stream":

            async def unary_stream(request: bytes, context: Context) -> None:
                await forward.send(self._stream(info, request, None, context), context)

            return grpc.unary_stream_rpc_method_handler(unary_stream)

        async def stream_stream(requests: AsyncIterator[bytes], context: Context) -> None:
            await forward.send(self._stream(info, await _first(requests), requests, context), context)

        return grpc.stream_stream_rpc_method_handler(stream_stream)

    # --- the path of a call ----------------------------------------------------------------

    async def _unary(
        self,
        info: MethodInfo,
        first: bytes | None,
        context: Context,
        more: AsyncIterator[bytes] | None = None,
    ) -> bytes:
        """A call with one response: unary-unary, or stream-unary (`more`: the rest of the
        caller's stream, which cannot be sent twice, so such a call is never retried)."""
        # The scope closes in `finally` (no `with` block: two calls a call fewer).
        scope = Scope(self._scopes, info.path, tuple(invocation_metadata(context)))
        try:
            try:
                plan = self._first_attempt(info, first, scope, context)
            except Refused as refused:
                await self._refuse(scope, refused, context)
            mirrored = plan.view.mirrored  # the call's view (a retry's plan holds none)
            tried: list[Upstream] = []
            while True:
                scope.attempt(plan)
                started = time.perf_counter()
                request = (
                    plan.body(first or b"") if more is None else forward.requests(first, more, plan.body)
                )
                # The attempt's client span (None: untraced or not sampled) ends in `finally`.
                # An untraced call's metadata is the plan's alone, and an unsampled root's (a
                # str: its traceparent) the plan's and that: Tracing.attempt's first two cases,
                # without the call (most calls are one or the other).
                span = scope.span
                if span is None:
                    metadata, client = plan.forward, None
                elif type(span) is str:
                    metadata, client = (*plan.forward, (headers.TRACEPARENT, span)), None
                else:
                    metadata, client = self._tracing.attempt(span, plan, info.path)
                try:
                    time_left = context.time_remaining()
                    response, initial, trailing = await forward.ask(
                        plan.upstream, info.path, info.kind, request, metadata, time_left, scope
                    )
                except forward.Failed as failed:
                    scope.code = failed.code
                    if client is not None:
                        self._tracing.failed(client, failed.code, failed.reason)
                    # The caller's own deadline (ours is the caller's) is no fault; its
                    # duration still tells how slow the upstream was.
                    timed_out = failed.code == grpc.StatusCode.DEADLINE_EXCEEDED and not failed.reason
                    took = time.perf_counter() - started if timed_out else None
                    if more is None:
                        retry = self._after_failure(plan, failed, tried, took)
                    else:  # the caller's stream is spent: it cannot be sent again
                        plan.report(failed.code.name, failed.reason, took)
                        retry = None
                    if retry is None:
                        await self._fail(scope, plan, failed, context)
                    plan = retry
                    continue
                finally:
                    if client is not None:
                        client.end()
                scope.code = grpc.StatusCode.OK  # this attempt answered, whatever an earlier one did
                # A version's latency is the service's own measure of its run (x-run-us): what
                # another version sharing the service cannot inflate, as it inflates the call's
                # duration; the duration when the answer carries none.
                latency = None
                if more is None:
                    latency = forward.run_seconds(trailing)
                    if latency is None:
                        latency = time.perf_counter() - started
                plan.report("OK", "", latency)
                if initial:  # the service's unary answers carry none (docs/api.md)
                    await context.send_initial_metadata(initial)
                forward.answer(context, trailing, plan.answer_metadata)
                if mirrored and first is not None and more is None:
                    self._mirror.answered(info.path, plan, first, response)
                return response
        except asyncio.CancelledError:
            await self._cancelled(scope, context)
            raise
        finally:
            scope.close()

    async def _stream(
        self,
        info: MethodInfo,
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
                try:
                    plan = self._first_attempt(info, first, scope, context)
                except Refused as refused:
                    await self._refuse(scope, refused, context)
                tried: list[Upstream] = []
                while True:
                    scope.attempt(plan)
                    if more is not None and info.path == sequences.MODEL_STREAM_INFER:
                        # The sequences' steps on the stream are pinned where it goes.
                        more = self._sequences.follow(more, plan)
                    request = (
                        plan.body(first or b"") if more is None else forward.requests(first, more, plan.body)
                    )
                    metadata, client = self._tracing.attempt(scope.span, plan, info.path)
                    try:  # the attempt's client span, if any, ends in `finally`
                        call = _start(info, plan, request, metadata, context, scope)
                        if more is None and (early := await forward.ended_early(call)) is not None:
                            scope.code = early.code  # the attempt's outcome, should another follow
                            retry = self._after_failure(plan, early, tried, None)
                            if retry is not None:
                                if client is not None:
                                    self._tracing.failed(client, early.code, early.reason)
                                plan = retry
                                continue
                        shadowed = self._mirror.tokens(info.path, plan, first)
                        async for message in forward.relay(call, context, plan.answer_metadata):
                            if shadowed is not None:
                                shadowed.extend(token_ids(message))
                            yield message
                        if shadowed is not None and first is not None:
                            self._mirror.generated(plan, first, shadowed)
                    except forward.Failed as failed:
                        scope.code = failed.code
                        plan.report(failed.code.name, failed.reason, None)
                        if client is not None:
                            self._tracing.failed(client, failed.code, failed.reason)
                        await self._fail(scope, plan, failed, context)
                    finally:
                        if client is not None:
                            client.end()
                    break
            except GeneratorExit:
                scope.code = grpc.StatusCode.CANCELLED
                raise
            except asyncio.CancelledError:
                await self._cancelled(scope, context)
                raise
            finally:
                if call is not None and not call.done():
                    call.cancel()  # the client went away: so does the upstream call, at once

    def _first_attempt(self, info: MethodInfo, first: bytes | None, scope: Scope, context: Context) -> Plan:
        """The call's first attempt: what it asks for (the planner), its dye, a tenant slot (the
        scope's), an upstream whose breaker lets it through; or `Refused` (see `_refuse`). A plain
        function, not a coroutine: only a refusal awaits anything."""
        upstreams = self._upstreams
        routed = info.routed
        # Positional arguments (model_addressed, routed): keywords cost ~0.7k instructions each.
        asked = planner.read(first, scope.metadata, self._view_of, info.model_addressed, routed)
        if not routed:
            return planner.unrouted(asked, upstreams, model_addressed=info.model_addressed)
        table = asked.view.table  # the table the model's view was made under
        tenant = planner.tenant_bucket(table.tenants, asked.received)
        if tenant:
            scope.admit(tenant, table.tenants)
        scope.caller = planner.caller_key(asked.received, table.stickiness_header, context.peer)
        if info.path in sequences.METHODS and first and (step := sequences.read_step(first)) is not None:
            # A stateful sequence's step: where its sequence lives (sequences.py).
            exclude = self._sequences.route(asked, step, upstreams)
            plan = planner.first(asked, scope.caller, upstreams, self._breakers, exclude)
            self._sequences.routed(plan, step)
            return plan
        return planner.first(asked, scope.caller, upstreams, self._breakers)

    async def _refuse(self, scope: Scope, refused: Refused, context: Context) -> NoReturn:
        """The sidecar answers the call itself (a bad name, a tenant limit, no upstream left)."""
        await context.abort(scope.refused(refused), str(refused), refused.metadata)

    def _after_failure(
        self, plan: Plan, failed: forward.Failed, tried: list[Upstream], latency: float | None
    ) -> Plan | None:
        """An attempt failed before any answer reached the client: the planner's next attempt
        (it reports the failed one to its breaker), or None when the failure is the answer."""
        return planner.after_failure(
            plan,
            failed.code.name,
            failed.reason,
            latency,
            tried,
            self._view_of(plan.model),
            self._upstreams,
            self._breakers,
        )

    async def _fail(self, scope: Scope, plan: Plan, failed: forward.Failed, context: Context) -> NoReturn:
        """The upstream's error is the answer (forward.client_status)."""
        code, details, md = forward.client_status(failed.code, failed.details, failed.trailing)
        scope.code, scope.reason = code, forward.error_reason(md)
        await context.abort(code, details, forward.with_metadata(md, plan.answer_metadata))

    async def _cancelled(self, scope: Scope, context: Context) -> None:
        """The caller cancelled: so be it. Or the sidecar is shutting down and this call outlived
        the grace (the drain cancelled its upstream call): the client gets UNAVAILABLE/`draining`
        (retry elsewhere), never a CANCELLED it did not ask for."""
        if not scope.ended_by_drain():
            scope.code = grpc.StatusCode.CANCELLED
            return
        scope.code = grpc.StatusCode.UNAVAILABLE
        if scope.plan is not None:
            scope.plan.report(scope.code.name, "", None, gone=True)
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


def _start(
    info: MethodInfo,
    plan: Plan,
    request: forward.Request,
    metadata: planner.Metadata,
    context: Context,
    scope: Scope,
) -> Any:
    """One attempt's upstream call, started as planned, within the caller's time left."""
    return forward.start(
        plan.upstream, info.path, info.kind, request, metadata, context.time_remaining(), scope
    )
