"""The per-call scope (sidecar/scope.py): a tenant slot held for the call and given back once, the
call's attempt (a frozen layers.attempt.Attempt) settled with its breaker, a fallback counted
once, metrics once per call, however often (and however) it is closed. Real limits, metrics
and breakers; tracing off."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import pytest
from prometheus_client import generate_latest

from modelyard.sidecar.breaker_policy import BreakerPolicy, State
from modelyard.sidecar.breakers import Breakers
from modelyard.sidecar.layers.attempt import Attempt, answer_metadata
from modelyard.sidecar.layers.read import OTHER, Refused
from modelyard.sidecar.metrics import SidecarMetrics
from modelyard.sidecar.scope import Scopes
from modelyard.sidecar.tenant_limits import ANY_TENANT, TenantLimit, TenantLimits
from modelyard.sidecar.tracing import Tracing

PATH = "/inference.GRPCInferenceService/ModelInfer"
TENANTS = {"acme": TenantLimit(concurrency=1), ANY_TENANT: TenantLimit(concurrency=1)}


@dataclass(frozen=True)
class Up:
    address: str


@pytest.fixture
def metrics() -> SidecarMetrics:
    return SidecarMetrics()


@pytest.fixture
def scopes(metrics: SidecarMetrics) -> Scopes:
    return Scopes(TenantLimits(), metrics, Tracing())


def sample(metrics: SidecarMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def requests(
    metrics: SidecarMetrics,
    model: str = "",
    dye: str = "",
    code: str = "OK",
    version: str = "",
    fallback: str = "",
) -> float:
    labels = {"method": "ModelInfer", "model": model, "version": version, "dye": dye, "code": code}
    return sample(metrics, "modelyard_sidecar_requests_total", **labels, fallback=fallback)


def attempts(metrics: SidecarMetrics, version: str, dye: str, code: str, fault: bool) -> float:
    labels = {"model": "m", "version": version, "dye": dye, "code": code, "fault": str(fault).lower()}
    return sample(metrics, "modelyard_sidecar_attempts_total", **labels)


async def test_a_tenant_slot_is_held_until_the_call_closes_and_given_back_once(
    scopes: Scopes, metrics: SidecarMetrics
) -> None:
    first = scopes.open(PATH, ())
    first.admit("acme", TENANTS)
    with pytest.raises(Refused) as refused:
        scopes.open(PATH, ()).admit("acme", TENANTS)
    assert (refused.value.code, refused.value.reason) == ("RESOURCE_EXHAUSTED", "tenant_limit")
    assert [key for key, _ in refused.value.extra] == ["grpc-retry-pushback-ms"]
    assert sample(metrics, "modelyard_sidecar_tenant_refusals_total", tenant="acme") == 1
    scopes.open(PATH, ()).admit(ANY_TENANT, TENANTS)  # another bucket: not refused
    first.close()
    first.close()  # a second close gives nothing back twice (nor counts twice)
    with scopes.open(PATH, ()) as again:
        again.admit("acme", TENANTS)
    with pytest.raises(Refused):
        scopes.open(PATH, ()).admit(ANY_TENANT, TENANTS)  # the `*` slot is still held
    assert sample(metrics, "modelyard_sidecar_tenant_refusals_total", tenant=OTHER) == 1
    assert requests(metrics) == 2  # first, again: once each


def plan(
    breakers: Breakers, *, version: str = "1", fallback: str = "", label: str = "m", dye: str = "stable"
) -> Attempt[Up]:
    breaker = breakers.get("a", "m", version)
    permit = breaker.allow()
    assert permit is not None
    answer = answer_metadata(dye, fallback)
    return Attempt(
        "m",
        version,
        dye,
        fallback,
        "1",
        Up("a"),
        breaker,
        permit,
        (),
        None,
        label,
        answer,
        None,
        bool(fallback),
    )


@pytest.mark.parametrize(
    ("code", "fault", "gone"),
    [
        (grpc.StatusCode.OK, False, False),
        (grpc.StatusCode.UNAVAILABLE, True, False),  # a reason-less UNAVAILABLE is a fault
        (grpc.StatusCode.INVALID_ARGUMENT, False, False),
        (grpc.StatusCode.CANCELLED, False, True),  # the caller went away: no verdict at all
    ],
)
async def test_closing_settles_the_attempts_permit_with_the_calls_code(
    scopes: Scopes, metrics: SidecarMetrics, code: grpc.StatusCode, fault: bool, gone: bool
) -> None:
    breakers = Breakers(BreakerPolicy(), lambda *args: None)
    attempt = plan(breakers)
    with scopes.open(PATH, ()) as scope:
        scope.begin(attempt)
        scope.code = code
    scope.close()
    window = breakers.get("a", "m", "1").adaptive.window
    assert scope.settled
    assert (len(window), window.faults) == ((0, 0) if gone else (1, int(fault)))
    assert requests(metrics, "m", "stable", code.name, version="1") == 1
    assert attempts(metrics, "1", "stable", code.name, fault) == 1


async def test_a_cancelled_probe_is_freed_for_the_next_caller(scopes: Scopes) -> None:
    now = [100.0]
    breakers = Breakers(
        BreakerPolicy(min_calls=1, probes=1, backoff_s=1), lambda *args: None, clock=lambda: now[0]
    )
    breaker = breakers.get("a", "m", "1")
    for caller in (1, 2):
        permit = breaker.allow()
        assert permit is not None
        breaker.report(permit, True, None, caller)
    assert breaker.state is State.OPEN
    now[0] += 5
    with scopes.open(PATH, ()) as scope:
        scope.begin(plan(breakers))  # the one probe
        assert breaker.allow() is None
        scope.code = grpc.StatusCode.CANCELLED
    assert breaker.allow() is not None


async def test_a_fallback_is_counted_once_and_only_for_a_model_with_a_label(
    scopes: Scopes, metrics: SidecarMetrics
) -> None:
    breakers = Breakers(BreakerPolicy(), lambda *args: None)
    with scopes.open(PATH, ()) as scope:
        scope.begin(plan(breakers, fallback="breaker-open"))
        scope.begin(plan(breakers))  # a retry on another upstream: not a new fallback
    with scopes.open(PATH, ()) as scope:
        scope.begin(plan(breakers, fallback="canary-fault", label=OTHER))
    assert sample(metrics, "modelyard_sidecar_dye_fallbacks_total", model="m", reason="breaker-open") == 1
    assert sample(metrics, "modelyard_sidecar_dye_fallbacks_total", model="m", reason="canary-fault") == 0


async def test_a_refused_call_is_counted_without_a_model_or_dye(
    scopes: Scopes, metrics: SidecarMetrics
) -> None:
    with scopes.open(PATH, ()) as scope:
        code = scope.refused(Refused("INVALID_ARGUMENT", "bad", "invalid_argument"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert requests(metrics, code="INVALID_ARGUMENT") == 1


async def test_a_canary_fault_answered_by_stable_counts_as_a_canary_fault(
    scopes: Scopes, metrics: SidecarMetrics
) -> None:
    breakers = Breakers(BreakerPolicy(), lambda *args: None)
    with scopes.open(PATH, ()) as scope:
        scope.begin(plan(breakers, version="2", dye="canary"))
        scope.code = grpc.StatusCode.INTERNAL  # the canary failed; the retry policy sends it to stable
        scope.begin(plan(breakers, fallback="canary-fault"))
        scope.code = grpc.StatusCode.OK
    assert attempts(metrics, "2", "canary", "INTERNAL", True) == 1
    assert attempts(metrics, "1", "stable", "OK", False) == 1
    assert requests(metrics, "m", "stable", "OK", version="1", fallback="canary-fault") == 1
    assert requests(metrics, "m", "canary", "INTERNAL", version="2") == 0  # the client got stable's


async def test_a_version_without_a_breaker_is_labelled_other(scopes: Scopes, metrics: SidecarMetrics) -> None:
    made_up: Attempt[Up] = Attempt(
        "m", "987", "", "", "", Up("a"), None, None, (), None, "m", ()
    )  # a pin nobody serves
    with scopes.open(PATH, ()) as scope:
        scope.begin(made_up)
        scope.code = grpc.StatusCode.NOT_FOUND
    assert requests(metrics, "m", "", "NOT_FOUND", version=OTHER) == 1
    assert '"987"' not in generate_latest(metrics.registry).decode()  # as a label (a timestamp may hold 987)
