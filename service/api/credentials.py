"""Who may call which method: the management surface (modelyard.common.surfaces: loading and
unloading models, the KServe repository, shared-memory, log and trace extensions) needs a
credential with the management scope; with no credential configured it is off, unless the
operator opened it to anyone who reaches the port (`management_open`, credentials or not).
Inference and metadata calls need a credential only with `auth_inference`; health and reflection
stay open (orchestrators probe them). Denials are counted and logged (rate-limited) and answer
the same few words whatever was wrong."""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from modelyard.common.headers import ERROR_REASON
from modelyard.common.reasons import ErrorReason
from modelyard.common.surfaces import MANAGEMENT_METHODS
from modelyard.process.auth import Authorizer, Decision, Scope
from modelyard.process.request_metadata import invocation_metadata
from modelyard.process.throttle import LogThrottle
from modelyard.service.api.errors import Context
from modelyard.service.api.guards import Guard, GuardFor
from modelyard.service.metrics import ServiceMetrics

log = logging.getLogger(__name__)

ALWAYS_OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.")


MANAGEMENT_OFF = (
    "management calls are off on this service: give it a management credential "
    "(--auth-tokens-file) or open them to every client that reaches it (--management-open); "
    "see docs/security.md"
)


def guards(
    authorizer: Authorizer, inference_too: bool, metrics: ServiceMetrics, management_open: bool = False
) -> GuardFor:
    """The guard of each method: None (open) or one that aborts calls without a credential."""
    throttle = LogThrottle(log)

    async def management_off(context: Context) -> None:
        metrics.auth_denials.labels("management", "off").inc()
        throttle.log(logging.INFO, "refused a management call from %s (management is off)", context.peer())
        await context.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            MANAGEMENT_OFF,
            trailing_metadata=((ERROR_REASON, ErrorReason.PERMISSION_DENIED.value),),
        )

    def guard_of(kind: str, scope: Scope) -> Guard:
        async def guard(context: Context) -> None:
            decision = authorizer.check(invocation_metadata(context), context.auth_context(), scope)
            if decision is Decision.ALLOW:
                return
            metrics.auth_denials.labels(kind, decision.value).inc()
            throttle.log(logging.INFO, "denied a %s call from %s (%s)", kind, context.peer(), decision.value)
            if decision is Decision.DENIED:
                code, reason, message = (
                    grpc.StatusCode.PERMISSION_DENIED,
                    ErrorReason.PERMISSION_DENIED,
                    "this client may not make this call",
                )
            else:
                code, reason, message = (
                    grpc.StatusCode.UNAUTHENTICATED,
                    ErrorReason.UNAUTHENTICATED,
                    "this call needs valid credentials",
                )
            await context.abort(code, message, trailing_metadata=((ERROR_REASON, reason.value),))

        return guard

    management = guard_of("management", Scope.MANAGEMENT)
    inference = guard_of("inference", Scope.INFERENCE)

    def guard_for(method: str) -> Guard | None:
        if method.startswith(ALWAYS_OPEN):
            return None
        if method in MANAGEMENT_METHODS:
            if management_open:  # the operator's explicit choice: anyone who reaches the port
                return None
            return management if authorizer.configured else management_off
        return inference if inference_too and authorizer.configured else None

    return guard_for


def identities(authorizer: Authorizer) -> Callable[[Context], str]:
    """Who a call's caller is, for what it owns (Authorizer.identity of its metadata and its
    client certificate): "" for a caller without a credential."""

    def identify(context: Context) -> str:
        return authorizer.identity(invocation_metadata(context), context.auth_context())

    return identify
