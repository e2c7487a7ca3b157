"""Who may call which method: the management surface (loading and unloading models, the KServe
repository, shared-memory, log and trace extensions) needs a credential once tokens or client
identities are configured; inference and metadata calls need one only with `auth_inference`;
health and reflection stay open (orchestrators probe them). Denials are counted and logged
(rate-limited) and answer the same few words whatever was wrong."""

from __future__ import annotations

import logging

import grpc

from modelyard.common.headers import ERROR_REASON
from modelyard.common.reasons import ErrorReason
from modelyard.process.auth import Authorizer, Decision
from modelyard.process.request_metadata import invocation_metadata
from modelyard.process.throttle import LogThrottle
from modelyard.service.api.errors import Context
from modelyard.service.api.wire import Guard, GuardFor
from modelyard.service.metrics import ServiceMetrics

log = logging.getLogger(__name__)

MANAGEMENT = frozenset(
    {
        "/modelyard.inference.v1.ModelService/LoadModel",
        "/modelyard.inference.v1.ModelService/UnloadModel",
        "/inference.GRPCInferenceService/RepositoryIndex",
        "/inference.GRPCInferenceService/RepositoryModelLoad",
        "/inference.GRPCInferenceService/RepositoryModelUnload",
        # Registering shared memory makes the server map a region by its key: not for anyone.
        "/inference.GRPCInferenceService/SystemSharedMemoryStatus",
        "/inference.GRPCInferenceService/SystemSharedMemoryRegister",
        "/inference.GRPCInferenceService/SystemSharedMemoryUnregister",
        "/inference.GRPCInferenceService/CudaSharedMemoryStatus",
        "/inference.GRPCInferenceService/CudaSharedMemoryRegister",
        "/inference.GRPCInferenceService/CudaSharedMemoryUnregister",
        "/inference.GRPCInferenceService/LogSettings",
        "/inference.GRPCInferenceService/TraceSetting",
    }
)
ALWAYS_OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def guards(authorizer: Authorizer, inference_too: bool, metrics: ServiceMetrics) -> GuardFor:
    """The guard of each method: None (open) or one that aborts calls without a credential."""
    throttle = LogThrottle(log)

    def guard_of(kind: str) -> Guard:
        async def guard(context: Context) -> None:
            decision = authorizer.check(invocation_metadata(context), context.auth_context())
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

    management, inference = guard_of("management"), guard_of("inference")

    def guard_for(method: str) -> Guard | None:
        if not authorizer.configured or method.startswith(ALWAYS_OPEN):
            return None
        if method in MANAGEMENT:
            return management
        return inference if inference_too else None

    return guard_for
