"""gRPC metadata keys (and HTTP headers) that carry routing, identity and outcome between the
processes. Lower case: gRPC metadata keys are."""

from __future__ import annotations

# Request: which model and version to route to, and who asks.
MODEL_NAME = "x-model-name"
MODEL_VERSION = "x-model-version"  # a pin; else the sidecar dyes the request stable or canary
REQUEST_ID = "x-request-id"
PRIORITY = "x-priority"  # the batching priority level, where the message leaves it 0
CANARY_WEIGHT = "x-canary-weight"  # 0-100, set by operators at the edge
USER_ID = "x-user-id"  # the default stickiness key for dyeing
TENANT_ID = "x-tenant-id"
AUTHORIZATION = "authorization"

# Response: what served the request, and why it failed.
# x-served-version: the version that answered. A unary answer carries it in its TRAILING metadata
# (beside x-error-reason; grpc.aio sends handler-set initial metadata as a batch of its own), a
# stream in its INITIAL metadata, before its first message.
SERVED_VERSION = "x-served-version"
SERVED_BY = "x-served-by"  # beside it when the service runs several workers: worker-N
# A unary inference answer's own measurement of its run, in its TRAILING metadata beside
# x-served-version, on answers to calls that carry MODEL_DYE (a proxy's), decimal microseconds:
# QUEUE_US from the call's admission (its inputs decoded and checked) to the start of its run
# (waiting for its version's run slots, a batcher's queue, an executor thread), RUN_US its run
# there (its batch's run, for a batched request). What a proxy judges a version's latency by: a
# slow version's runs do not inflate another's RUN_US.
QUEUE_US = "x-queue-us"
RUN_US = "x-run-us"
MODEL_DYE = "x-model-dye"  # DYE_STABLE, DYE_CANARY or DYE_SHADOW
DYE_STABLE = "stable"
DYE_CANARY = "canary"  # a sidecar's canary attempt (the service holds its stream's headers for it)
# A sidecar's mirrored call (nobody waits for its answer): the service runs it at the lowest
# priority, only on spare capacity, and drops it (RESOURCE_EXHAUSTED shadow_dropped) rather than
# delay a real call. It only ever lowers the call's own priority.
DYE_SHADOW = "shadow"
DYE_FALLBACK = "x-dye-fallback"  # why the dye was overridden (e.g. breaker-open)
ERROR_REASON = "x-error-reason"  # trailing metadata of every error; values in reasons.py
# WatchModels with send_initial_state: the number of events of the initial state (a decimal, "0"
# for nothing served), in the stream's INITIAL metadata, before them; the watcher has the whole
# initial state once that many events arrived. An older service sends none.
INITIAL_STATE_COUNT = "x-initial-state-count"
# gRPC's own retry hint (milliseconds), honoured by gRPC's retry policy; sent with overload answers.
RETRY_PUSHBACK_MS = "grpc-retry-pushback-ms"

# W3C trace context.
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
BAGGAGE = "baggage"
