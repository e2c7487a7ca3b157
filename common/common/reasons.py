"""The error-reason vocabulary: one machine-readable word per failure, sent as `x-error-reason` in
the trailing metadata of every error, so that a proxy (a circuit breaker, a retry policy) can tell
overload and server faults from client mistakes without parsing messages."""

from __future__ import annotations

from enum import StrEnum


class ErrorReason(StrEnum):
    # The client's mistake: retrying the same request will fail the same way.
    INVALID_ARGUMENT = "invalid_argument"  # malformed or ill-fitting tensors, fields or parameters
    MODEL_NOT_FOUND = "model_not_found"  # no such model is known
    VERSION_NOT_FOUND = "version_not_found"  # the model is known, the requested version is not served
    TOO_LARGE = "too_large"  # a message or tensor over a configured size limit
    UNSUPPORTED = "unsupported"  # a feature this server or model does not have
    FAILED_PRECONDITION = "failed_precondition"  # e.g. Generate on a model that is not a decoder
    UNAUTHENTICATED = "unauthenticated"
    PERMISSION_DENIED = "permission_denied"
    # Load: the server is healthy but busy or going away; retry later or elsewhere.
    QUEUE_FULL = "queue_full"  # admission queue full (load shed)
    # A shadow call (x-model-dye: shadow) that would have delayed real calls: dropped, not queued.
    SHADOW_DROPPED = "shadow_dropped"
    TENANT_LIMIT = "tenant_limit"  # a tenant's rate or concurrency limit
    DEADLINE = "deadline"  # the request's deadline passed before its work was done
    CANCELLED = "cancelled"  # the client went away
    READER_STALLED = "reader_stalled"  # the client stopped reading its stream; its slot was freed
    DRAINING = "draining"  # the model or server is loading, draining or shutting down
    BREAKER_OPEN = "breaker_open"  # a sidecar's breaker refuses calls to this version
    # The model refused a request that passed every declared check (names, datatypes, shapes
    # against the signature, limits): inside its graph, on shapes or values no declared check
    # covers. The version's graph may be at fault (a canary's bug) or the request's values: no
    # server fault by itself; the same request on another version tells which (a proxy's replay).
    MODEL_REJECTED = "model_rejected"
    # Faults: the server failed on a request that looked valid.
    MODEL_FAILED = "model_failed"  # the runtime failed running the model, or a load failed
    UNAVAILABLE = "unavailable"  # the upstream could not be reached
    INTERNAL = "internal"  # a bug of ours; the message carries an error id that the log has too


# Reasons that count against an upstream's health (circuit breakers); the rest never do.
SERVER_FAULTS = frozenset({ErrorReason.MODEL_FAILED, ErrorReason.UNAVAILABLE, ErrorReason.INTERNAL})


def is_server_fault(reason: str) -> bool:
    return reason in SERVER_FAULTS
