"""The proxy: every method of the service forwarded as bytes (no decode, no re-encode).

Data calls (Infer, InferStream, Generate, KServe ModelInfer and ModelStreamInfer) are dyed
(routing.py), guarded by breakers (breakers.py) and tenant limits (limits.py); the chosen version
travels as field 2 (appended to the message: the last occurrence wins on the wire) and as the
`x-model-version` header. Other calls go to an upstream that serves the named model, or any.
Metadata, deadline, cancellation and the full status (code, message, trailers) pass through;
an error without `x-error-reason` gets one (client_status), and a status message is capped.

Names and versions are checked at this edge (modelyard.common.names) before they reach any
state. Only models and versions the upstreams serve (WatchModels) get breakers and their own
metric label; anything else is forwarded without state under the label `_other`. Breakers learn
who each call came from (caller_key), so that no single caller opens one (adaptive.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from grpc_reflection.v1alpha import reflection_pb2
from modelyard.common import headers
from modelyard.common.reasons import ErrorReason
from modelyard.inference.v1 import inference_service_pb2, model_service_pb2
from modelyard.kserve.v2 import grpc_service_pb2

from sidecar import plan as planner
from sidecar.breakers import Breakers
from sidecar.limits import TenantLimits
from sidecar.metrics import SidecarMetrics
from sidecar.plan import Metadata, Refused
from sidecar.routes import RouteSource
from sidecar.routing import STABLE
from sidecar.scope import Scope, Scopes
from sidecar.shadow import GENERATE as SHADOWED_STREAM
from sidecar.shadow import METHODS as SHADOWED
from sidecar.shadow import Shadows, is_greedy, token_ids
from sidecar.tracing import Tracing
from sidecar.upstreams import Upstream, Upstreams
from sidecar.wire import with_version

log = logging.getLogger(__name__)

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
MESSAGE_MAX = 1024  # characters of an upstream's status message passed on (then `...`)
# A reason for every error the client gets: an upstream or gRPC itself may answer without one
# (an unreachable upstream, a transport limit); README's reading of a reason-less status.
_REASON_OF_CODE = {
    grpc.StatusCode.UNAVAILABLE: ErrorReason.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorReason.DEADLINE,
    grpc.StatusCode.INVALID_ARGUMENT: ErrorReason.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorReason.TOO_LARGE,
    grpc.StatusCode.INTERNAL: ErrorReason.INTERNAL,
    grpc.StatusCode.UNKNOWN: ErrorReason.INTERNAL,
    grpc.StatusCode.UNIMPLEMENTED: ErrorReason.UNSUPPORTED,
    grpc.StatusCode.FAILED_PRECONDITION: ErrorReason.FAILED_PRECONDITION,
    grpc.StatusCode.UNAUTHENTICATED: ErrorReason.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED: ErrorReason.PERMISSION_DENIED,
}


@dataclass(frozen=True, slots=True)
class MethodInfo:
    path: str
    kind: str  # unary_unary, unary_stream or stream_stream
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
            if method.client_streaming and not method.server_streaming:
                continue  # none in our APIs
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


def error_reason(trailing: Iterable[Any] | None) -> str:
    for key, value in trailing or ():
        if key == headers.ERROR_REASON:
            return value if isinstance(value, str) else value.decode()
    return ""


def is_fault(code: grpc.StatusCode, trailing: Iterable[Any] | None) -> bool:
    """Whether an answer counts against the upstream: the planner's rule (plan.is_fault)."""
    return planner.is_fault(code.name, error_reason(trailing))


def client_status(
    code: grpc.StatusCode, details: str, trailing: Iterable[Any] | None
) -> tuple[grpc.StatusCode, str, Metadata]:
    """What the client gets for an upstream's error: its status message capped at MESSAGE_MAX,
    and a reason where it had none (README's reading of the bare code). A CANCELLED that the
    client did not ask for (the upstream went away mid-call) is UNAVAILABLE/`unavailable`."""
    md: Metadata = tuple((key, value) for key, value in trailing or ())
    if len(details) > MESSAGE_MAX:
        details = details[:MESSAGE_MAX] + "..."
    if not error_reason(md):
        if code == grpc.StatusCode.CANCELLED:
            code, details = grpc.StatusCode.UNAVAILABLE, f"the upstream ended the call: {details}"
        reason = _REASON_OF_CODE.get(code)
        if reason is not None:
            md = (*md, (headers.ERROR_REASON, reason.value))
    return code, details, md


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
    ) -> None:
        self._shadows = shadows
        self._upstreams = upstreams
        self._breakers = breakers
        self._routes = routes
        self._limits = limits
        self._tracing = tracing
        self._scopes = Scopes(limits, metrics, tracing)
        self._handlers: dict[str, _MethodHandler] = {}
        for info in method_table().values():
            self._handlers[info.path] = self._make_handler(info)

    @property
    def limits(self) -> TenantLimits:
        return self._limits

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> _MethodHandler | None:
        return self._handlers.get(handler_call_details.method)

    def _make_handler(self, info: MethodInfo) -> _MethodHandler:
        if info.kind == "unary_unary":

            async def unary_unary(request: bytes, context: Context) -> bytes:
                return await self._unary(info, request, context)

            return grpc.unary_unary_rpc_method_handler(unary_unary)
        # grpc.aio tells streaming handlers by inspect.isasyncgenfunction: they must be one.
        if info.kind == "unary_stream":

            async def unary_stream(request: bytes, context: Context) -> AsyncIterator[bytes]:
                async for message in self._stream(info, request, None, context):
                    yield message

            return grpc.unary_stream_rpc_method_handler(unary_stream)

        async def stream_stream(requests: AsyncIterator[bytes], context: Context) -> AsyncIterator[bytes]:
            first = None
            async for message in requests:
                first = message
                break
            async for message in self._stream(info, first, requests, context):
                yield message

        return grpc.stream_stream_rpc_method_handler(stream_stream)

    # --- planning -------------------------------------------------------------------------

    def _plan(self, info: MethodInfo, request: bytes | None, scope: Scope, peer: str) -> Plan:
        """The call's first attempt: what it asks for (the planner), its dye, a tenant slot (the
        scope's), an upstream whose breaker lets it through."""
        upstreams = self._upstreams
        asked = planner.read(request, scope.metadata, upstreams, model_addressed=info.model_addressed)
        if not info.routed:
            return planner.unrouted(asked, upstreams, model_addressed=info.model_addressed)
        table = self._routes.table
        decision = planner.routing_decision(asked, table, upstreams)
        tenant = planner.tenant_bucket(table.tenants, asked.received)
        if tenant:
            scope.admit(tenant, table.tenants)
        scope.caller = planner.caller_key(asked.received, table.stickiness_header, peer)
        return planner.first(asked, decision, scope.caller, table, upstreams, self._breakers)

    def _shadow_target(self, plan: Plan) -> tuple[str, Upstream, Metadata] | None:
        return planner.shadow_target(plan, self._routes.table, self._upstreams, self._breakers)

    def _maybe_shadow(self, info: MethodInfo, plan: Plan, request: bytes, answer: bytes) -> None:
        """Mirror a stable answer's request to the canary (shadow.py), if the route file asks."""
        policy = self._routes.table.shadow
        if not self._shadows.wants(policy) or (target := self._shadow_target(plan)) is None:
            return
        canary, upstream, forward = target
        method = upstream.method(info.path, "unary_unary")

        async def send(message: bytes) -> bytes:
            answer: bytes = await method(with_version(message, canary), metadata=forward, timeout=30)
            return answer

        self._shadows.mirror(policy, plan.model, info.path, request, answer, send)

    def _wants_shadow(self, info: MethodInfo, plan: Plan, request: bytes | None) -> list[int] | None:
        """A list to collect the stable stream's tokens in, when this Generate is mirrored."""
        if info.path != SHADOWED_STREAM or plan.dye != STABLE or request is None:
            return None
        if not self._shadows.wants(self._routes.table.shadow) or not is_greedy(request):
            return None
        return []

    def _shadow_generation(self, plan: Plan, request: bytes, tokens: list[int]) -> None:
        if (target := self._shadow_target(plan)) is None:
            return
        canary, upstream, forward = target
        method = upstream.method(SHADOWED_STREAM, "unary_stream")

        async def send(message: bytes) -> list[int]:
            produced: list[int] = []
            async for event in method(with_version(message, canary), metadata=forward, timeout=120):
                produced.extend(token_ids(event))
            return produced

        self._shadows.mirror_tokens(self._routes.table.shadow, plan.model, request, tokens, send)

    def _report(
        self,
        plan: Plan,
        code: grpc.StatusCode,
        trailing: Any,
        latency: float | None,
    ) -> None:
        plan.report(code.name, error_reason(trailing), latency)

    async def _drained(self, scope: Scope, context: Context) -> None:
        """The sidecar is shutting down and this call outlived the grace: the client gets
        UNAVAILABLE/`draining` (retry elsewhere), never a CANCELLED it did not ask for."""
        scope.code = grpc.StatusCode.UNAVAILABLE
        if scope.plan is not None:
            scope.plan.report(scope.code.name, "", None, gone=True)
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            "the sidecar is shutting down; retry the call",
            ((headers.ERROR_REASON, ErrorReason.DRAINING.value),),
        )

    async def drain(self, within_s: float) -> None:
        """Shutdown: give calls in flight `within_s` to finish, then end the rest with `draining`
        (before gRPC's own grace runs out and it cancels them)."""
        await self._scopes.drain(within_s)

    # --- calls ----------------------------------------------------------------------------

    async def _stream_retry(self, plan: Plan, call: Any, tried: list[Upstream]) -> Plan | None:
        """A server stream that ended before its first message (a trailers-only answer): nothing
        reached the client yet, so an unreachable upstream or a canary fault is retried as for
        unary calls."""
        code = await call.code()
        if code == grpc.StatusCode.OK:
            return None
        return self._after_failure(plan, code, await call.trailing_metadata(), tried)

    def _after_failure(
        self,
        plan: Plan,
        code: grpc.StatusCode,
        trailing: Any,
        tried: list[Upstream],
        latency: float | None = None,
    ) -> Plan | None:
        """An attempt failed before any answer reached the client: the planner's next attempt."""
        table = self._routes.table
        retry = planner.after_failure(
            plan, code.name, error_reason(trailing), latency, tried, table, self._upstreams, self._breakers
        )
        return retry

    async def _unary(self, info: MethodInfo, request: bytes, context: Context) -> bytes:
        with self._scopes.open(info.path, tuple(context.invocation_metadata() or ())) as scope:
            try:
                return await self._unary_call(info, request, context, scope)
            except asyncio.CancelledError:
                if not scope.ended_by_drain():
                    scope.code = grpc.StatusCode.CANCELLED
                    raise
                await self._drained(scope, context)
                raise

    async def _unary_call(self, info: MethodInfo, request: bytes, context: Context, scope: Scope) -> bytes:
        try:
            plan = self._plan(info, request, scope, context.peer())
        except Refused as refused:
            await context.abort(scope.refused(refused), str(refused), refused.metadata)
        tried: list[Upstream] = []
        while True:
            scope.attempt(plan)
            attempt_started = time.perf_counter()
            with self._tracing.attempt(scope.span, plan, info.path) as attempt:
                call = plan.upstream.method(info.path, "unary_unary")(
                    plan.body(request), metadata=attempt.metadata, timeout=context.time_remaining()
                )
                scope.flight.follow(call)
                try:
                    response: bytes = await call
                except grpc.aio.AioRpcError as exc:
                    code = scope.code = exc.code()
                    trailing = exc.trailing_metadata()
                    attempt.failed(code)
                    # The caller's own deadline (ours is the caller's) is no fault; its
                    # duration still tells how slow the upstream was.
                    took = time.perf_counter() - attempt_started
                    timed_out = code == grpc.StatusCode.DEADLINE_EXCEEDED and not error_reason(trailing)
                    retry = self._after_failure(plan, code, trailing, tried, took if timed_out else None)
                    if retry is None:
                        code, details, answer_md = client_status(code, exc.details() or "", trailing)
                        scope.code = code
                        await context.abort(code, details, _with(answer_md, plan.answer_metadata))
                    plan = retry
                    continue
            scope.code = grpc.StatusCode.OK  # this attempt answered, whatever an earlier one did
            self._report(plan, scope.code, None, time.perf_counter() - attempt_started)
            initial = await call.initial_metadata()
            await context.send_initial_metadata(_with(initial, plan.answer_metadata))
            trailing = await call.trailing_metadata()
            if trailing:
                context.set_trailing_metadata(tuple(trailing))
            if plan.dye == STABLE and info.path in SHADOWED:
                self._maybe_shadow(info, plan, request, response)
            return response

    async def _stream(
        self,
        info: MethodInfo,
        first: bytes | None,
        more: AsyncIterator[bytes] | None,
        context: Context,
    ) -> AsyncIterator[bytes]:
        with self._scopes.open(info.path, tuple(context.invocation_metadata() or ())) as scope:
            call: Any = None
            try:
                try:
                    plan = self._plan(info, first, scope, context.peer())
                except Refused as refused:
                    await context.abort(scope.refused(refused), str(refused), refused.metadata)
                tried: list[Upstream] = []
                while True:
                    scope.attempt(plan)
                    with self._tracing.attempt(scope.span, plan, info.path) as attempt:
                        timeout = context.time_remaining()
                        method = plan.upstream.method(info.path, info.kind)
                        if info.kind == "unary_stream":
                            call = method(plan.body(first or b""), metadata=attempt.metadata, timeout=timeout)
                        else:
                            call = method(
                                _requests(plan, first, more), metadata=attempt.metadata, timeout=timeout
                            )
                        scope.flight.follow(call)
                        try:
                            initial = await call.initial_metadata()
                            if info.kind == "unary_stream" and call.done():
                                retry = await self._stream_retry(plan, call, tried)
                                if retry is not None:
                                    attempt.failed(await call.code())
                                    plan = retry
                                    continue
                            await context.send_initial_metadata(_with(initial, plan.answer_metadata))
                            shadowed = self._wants_shadow(info, plan, first)
                            async for message in call:
                                if shadowed is not None:
                                    shadowed.extend(token_ids(message))
                                yield message
                            trailing = await call.trailing_metadata()
                            if trailing:
                                context.set_trailing_metadata(tuple(trailing))
                            if shadowed is not None and first is not None:
                                self._shadow_generation(plan, first, shadowed)
                        except grpc.aio.AioRpcError as exc:
                            code = scope.code = exc.code()
                            trailing = exc.trailing_metadata()
                            self._report(plan, code, trailing, None)
                            attempt.failed(code)
                            code, details, answer_md = client_status(code, exc.details() or "", trailing)
                            scope.code = code
                            await context.abort(code, details, _with(answer_md, plan.answer_metadata))
                    break
            except GeneratorExit:
                scope.code = grpc.StatusCode.CANCELLED
                raise
            except asyncio.CancelledError:
                if not scope.ended_by_drain():
                    scope.code = grpc.StatusCode.CANCELLED
                    raise
                await self._drained(scope, context)
                raise
            finally:
                if call is not None and not call.done():
                    call.cancel()  # the client went away: so does the upstream call, at once


async def _requests(
    plan: Plan, first: bytes | None, more: AsyncIterator[bytes] | None
) -> AsyncIterator[bytes]:
    if first is None:
        return
    yield plan.body(first)
    if more is not None:
        async for message in more:
            yield plan.body(message)


def _with(received: Iterable[Any] | None, added: Metadata) -> Metadata:
    return (*((key, value) for key, value in received or ()), *added)
