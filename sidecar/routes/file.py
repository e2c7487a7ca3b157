"""What the sidecar's route file (`--config`, YAML) and an admin PUT /canary/<model> body may say:
keys, types, defaults, bounds and help, declared once (modelyard.process.documents). The parsing and
key-path messages come from it, and so does `sidecar/routes.schema.json`, the JSON Schema editors
validate routes.yaml with. Defaults are those of the policies the sidecar runs (BreakerPolicy,
TenantLimit, ShadowPolicy), whose own checks (backoff_s <= backoff_max_s, ...) still apply.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from modelyard.common import headers
from modelyard.sidecar.breaker_policy import BreakerPolicy
from modelyard.sidecar.rollout.policy import (
    MAX_CALLS,
    MAX_DWELL_S,
    MAX_LATENCY_FLOOR_S,
    MAX_LATENCY_RATIO,
    MAX_STEPS,
    RolloutSpec,
)
from modelyard.sidecar.shadow.compare import ShadowPolicy
from modelyard.sidecar.tenant_limits import TenantLimit

Weight = Annotated[
    float,
    Meta(
        ge=0,
        le=100,
        description="percent of the model's users dyed canary",
        extra={"expects": "a number from 0 to 100"},  # as the x-canary-weight header's answer says
    ),
]
Version = Annotated[
    str | int | None,
    Meta(description="a version (as the service names it: 3 or v3); empty: from what the upstreams serve"),
]

_BREAKER = BreakerPolicy()
_TENANT = TenantLimit()
_SHADOW = ShadowPolicy()
_ROLLOUT = RolloutSpec()


class _Keys(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """A mapping of known keys: an unknown key is an error (a typo must fail loudly)."""


class ModelRouteDoc(_Keys):
    canary_weight: Weight | UnsetType = UNSET  # left out: the file's canary_weight
    stable: Version = None
    canary: Version = None


class BreakerDoc(_Keys):
    """Circuit breakers per upstream and version (sidecar/breaker_policy.py)."""

    window_s: Annotated[float, Meta(gt=0, description="seconds of calls the error rate and p99 look at")] = (
        _BREAKER.window_s
    )
    min_calls: Annotated[int, Meta(ge=1, description="calls in the window before the error rate counts")] = (
        _BREAKER.min_calls
    )
    latency_min_calls: Annotated[
        int, Meta(ge=1, description="calls in the window before the p99 latency counts")
    ] = _BREAKER.latency_min_calls
    error_rate: Annotated[
        float, Meta(gt=0, le=1, description="share of failed calls that trips a version without fallback")
    ] = _BREAKER.error_rate
    canary_error_rate: Annotated[
        float, Meta(gt=0, le=1, description="share of failed canary calls, over stable's share, that trips")
    ] = _BREAKER.canary_error_rate
    latency_multiple: Annotated[
        float, Meta(gt=1, description="a p99 this many times the baseline (a canary's: stable's p99) trips")
    ] = _BREAKER.latency_multiple
    latency_floor_s: Annotated[
        float, Meta(ge=0, description="a p99 below this never trips, however small the baseline")
    ] = _BREAKER.latency_floor_s
    canary_latency_multiple: Annotated[
        float, Meta(gt=1, description="a canary's median this many times stable's median trips")
    ] = _BREAKER.canary_latency_multiple
    canary_latency_floor_s: Annotated[
        float, Meta(ge=0, description="a canary's median below this never trips")
    ] = _BREAKER.canary_latency_floor_s
    latency_check_s: Annotated[
        float, Meta(ge=0, description="seconds between latency checks; 0: every call")
    ] = _BREAKER.latency_check_s
    backoff_s: Annotated[float, Meta(gt=0, description="seconds open before the first probe")] = (
        _BREAKER.backoff_s
    )
    backoff_factor: Annotated[float, Meta(ge=1, description="backoff growth after a failed probe")] = (
        _BREAKER.backoff_factor
    )
    backoff_max_s: Annotated[float, Meta(gt=0, description="the longest backoff, seconds")] = (
        _BREAKER.backoff_max_s
    )
    consecutive_faults: Annotated[
        int, Meta(ge=1, description="faults in a row that trip at once, whatever the window holds")
    ] = _BREAKER.consecutive_faults
    probes: Annotated[
        int, Meta(ge=1, description="probes in flight at once half-open; the shortest run of good probes")
    ] = _BREAKER.probes
    probes_max: Annotated[int, Meta(ge=1, description="the longest run of good probes that closes")] = (
        _BREAKER.probes_max
    )
    probe_escape: Annotated[
        float,
        Meta(
            gt=0,
            lt=1,
            description="chance a version failing as when it tripped passes the probe run (sets its length)",
        ),
    ] = _BREAKER.probe_escape
    max_samples: Annotated[int, Meta(ge=1, description="latency samples kept per window")] = (
        _BREAKER.max_samples
    )


class TenantDoc(_Keys):
    """One tenant's admission (sidecar/tenant_limits.py); 0 = unlimited."""

    rate: Annotated[float, Meta(ge=0, description="calls per second; 0 = no rate limit")] = _TENANT.rate
    burst: Annotated[float, Meta(ge=0, description="bucket size; 0 = max(1, rate)")] = _TENANT.burst
    concurrency: Annotated[int, Meta(ge=0, description="calls in flight; 0 = no limit")] = _TENANT.concurrency


class ShadowDoc(_Keys):
    """Mirroring of stable unary calls to the canary (sidecar/shadow/compare.py)."""

    share: Annotated[float, Meta(ge=0, le=100, description="percent of stable-dyed unary calls mirrored")] = (
        _SHADOW.share
    )
    max_in_flight: Annotated[int, Meta(ge=0, description="mirrored calls in flight at once")] = (
        _SHADOW.max_in_flight
    )


class RolloutDoc(_Keys):
    """A progressive rollout (sidecar/rollout/policy.py): the canary's weight steps up while its gates are
    green, and goes to 0 when one is red. Also the body of POST /rollouts/<model>."""

    steps: Annotated[
        list[Annotated[float, Meta(gt=0, le=100)]],
        Meta(
            min_length=1, max_length=MAX_STEPS, description="canary weights in order, rising, ending at 100"
        ),
    ] = msgspec.field(default_factory=lambda: list(_ROLLOUT.steps))
    dwell_s: Annotated[
        float, Meta(ge=0, le=MAX_DWELL_S, description="seconds each step's gates must stay green")
    ] = _ROLLOUT.dwell_s
    min_calls: Annotated[
        int, Meta(ge=1, le=MAX_CALLS, description="canary calls each step needs before it advances")
    ] = _ROLLOUT.min_calls
    judge_calls: Annotated[
        int,
        Meta(
            ge=1,
            le=MAX_CALLS,
            description="canary calls in a step before a gate may turn red (at most min_calls)",
        ),
    ] = _ROLLOUT.judge_calls
    max_error_excess: Annotated[
        float, Meta(ge=0, le=1, description="red when the canary's error rate exceeds stable's by more")
    ] = _ROLLOUT.max_error_excess
    max_latency_ratio: Annotated[
        float,
        Meta(
            gt=0,
            le=MAX_LATENCY_RATIO,
            description="red when the canary's median or p99 exceeds stable's times this",
        ),
    ] = _ROLLOUT.max_latency_ratio
    latency_floor_s: Annotated[
        float, Meta(ge=0, le=MAX_LATENCY_FLOOR_S, description="a canary p99 below this is never red")
    ] = _ROLLOUT.latency_floor_s
    median_floor_s: Annotated[
        float, Meta(ge=0, le=MAX_LATENCY_FLOOR_S, description="a canary median below this is never red")
    ] = _ROLLOUT.median_floor_s
    min_agreement: Annotated[
        float, Meta(ge=0, le=1, description="red when shadow agreement (argmax rows, greedy tokens) is lower")
    ] = _ROLLOUT.min_agreement


class RouteFileDoc(_Keys):
    """The route file: canary weights, versions, breaker thresholds, tenant limits, shadowing."""

    stickiness_header: Annotated[str, Meta(description="the header whose value keeps a user's dye")] = (
        headers.USER_ID
    )
    canary_weight: Annotated[Weight, Meta(description="default weight for models without their own")] = 0.0
    models: Annotated[dict[str, ModelRouteDoc] | None, Meta(description="routes per model name")] = None
    breaker: BreakerDoc | None = None
    tenants: Annotated[
        dict[str, TenantDoc] | None, Meta(description='limits per tenant; "*": all other tenants, together')
    ] = None
    shadow: ShadowDoc | None = None
    sticky_cohort: Annotated[
        Literal["model", "shared"],
        Meta(
            description="model: each model's canary users are its own (the bucket is salted by its name); "
            "shared: the same users are the canary of every model"
        ),
    ] = "model"
    rollout: Annotated[
        dict[str, RolloutDoc] | None, Meta(description="progressive rollouts per model name")
    ] = None
