"""No single caller opens a breaker (breaker_policy.py's leave-one-out rule), and what counts as a fault
(proxy.is_fault) and what a client is told (proxy.client_status): pure parts, a stepped clock."""

from __future__ import annotations

import grpc
import pytest

from modelyard.sidecar.breaker_policy import BreakerPolicy, State
from modelyard.sidecar.breakers import Breaker, BreakerKey, Breakers
from modelyard.sidecar.forward import MESSAGE_MAX, client_status, is_fault
from modelyard.sidecar.layers.read import caller_key

POLICY = BreakerPolicy(
    window_s=10,
    min_calls=10,
    latency_min_calls=10,
    error_rate=0.5,
    latency_multiple=4,
    latency_floor_s=0.05,
    latency_check_s=0,
    backoff_s=1,
    backoff_max_s=5,
    probes=2,
)
A, B, C = (hash(("tenant", name)) for name in "abc")


@pytest.fixture
def breaker() -> Breaker:
    return Breaker(BreakerKey("up", "m", "1"), POLICY, lambda: 100.0, lambda *args: None)


def call(breaker: Breaker, caller: int, fault: bool = False, latency: float | None = 0.01) -> None:
    permit = breaker.allow()
    if permit is not None:  # once open, calls are refused: the test looks at the state
        breaker.report(permit, fault, latency, caller)


def test_one_callers_faults_alone_never_trip_even_as_the_whole_window(breaker: Breaker) -> None:
    for _ in range(50):
        call(breaker, A, fault=True)  # e.g. bad values that the model fails on
    assert breaker.state is State.CLOSED
    for _ in range(20):
        call(breaker, B)
        call(breaker, A, fault=True)
    assert breaker.state is State.CLOSED  # B, the only other caller, is fine


def test_a_storm_plus_one_incidental_fault_of_another_caller_does_not_trip(breaker: Breaker) -> None:
    for _ in range(40):
        call(breaker, A, fault=True)
    for _ in range(19):
        call(breaker, B)
    call(breaker, B, fault=True)  # 1 of B's 20: far under the error rate without A
    assert breaker.state is State.CLOSED


def test_a_version_failing_for_everybody_trips(breaker: Breaker) -> None:
    for _ in range(4):
        for caller in (A, B, C):
            call(breaker, caller, fault=True)
    assert breaker.state is State.OPEN and breaker.adaptive.reason is not None


def test_a_dominant_caller_does_not_hide_a_fault_everybody_sees(breaker: Breaker) -> None:
    for _ in range(30):
        call(breaker, A, fault=True)
    for _ in range(3):
        call(breaker, B, fault=True)
        call(breaker, C)
    assert breaker.state is State.OPEN  # without A: 3 faults in 6 calls


def test_one_callers_slow_calls_do_not_trip_on_latency(breaker: Breaker) -> None:
    for _ in range(30):
        call(breaker, B, latency=0.02)
    assert breaker.adaptive.baseline is not None
    for _ in range(30):
        call(breaker, A, latency=1.0)  # its own huge batches
    assert breaker.state is State.CLOSED
    for _ in range(5):
        call(breaker, B, latency=1.0)
        call(breaker, C, latency=1.0)
    assert breaker.snapshot()["state"] == "open" and breaker.adaptive.reason == "latency"


def test_one_callers_failing_probes_do_not_keep_a_breaker_open() -> None:
    now = [100.0]
    breaker = Breaker(BreakerKey("up", "m", "1"), POLICY, lambda: now[0], lambda *args: None)
    for _ in range(4):
        for caller in (A, B, C):
            call(breaker, caller, fault=True)
    assert breaker.state is State.OPEN
    now[0] += 1  # the backoff is over: half-open
    for _ in range(5):
        call(breaker, A, fault=True)  # A's bad values, again and again
    assert breaker.snapshot()["state"] == "half-open"
    call(breaker, B)
    call(breaker, C)
    assert breaker.snapshot()["state"] == "closed"  # the others' probes succeeded


def test_failing_probes_of_two_callers_reopen() -> None:
    now = [100.0]
    breaker = Breaker(BreakerKey("up", "m", "1"), POLICY, lambda: now[0], lambda *args: None)
    for _ in range(4):
        for caller in (A, B, C):
            call(breaker, caller, fault=True)
    now[0] += 1
    call(breaker, A, fault=True)
    assert breaker.snapshot()["state"] == "half-open"
    call(breaker, B, fault=True)
    assert breaker.snapshot()["state"] == "open" and breaker.adaptive.trips == 2


def test_pruned_breakers_are_gone() -> None:
    breakers = Breakers(POLICY, lambda *args: None, lambda: 100.0)
    for version in ("1", "2", "3"):
        breakers.get("up", "m", version)
    assert [k.version for k in breakers.prune(lambda key: key.version == "1")] == ["2", "3"]
    assert len(breakers) == 1


def md(reason: str | None) -> tuple[tuple[str, str], ...]:
    return (("x-error-reason", reason),) if reason else ()


@pytest.mark.parametrize(
    ("code", "reason", "fault"),
    [
        (grpc.StatusCode.DEADLINE_EXCEEDED, None, False),  # the caller's own deadline
        (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline", False),  # the service's queue timeout
        (grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", False),  # bad values
        (grpc.StatusCode.INVALID_ARGUMENT, None, False),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue_full", False),
        (grpc.StatusCode.ABORTED, "reader_stalled", False),
        (grpc.StatusCode.UNAVAILABLE, "draining", False),
        (grpc.StatusCode.INTERNAL, "model_failed", True),
        (grpc.StatusCode.INTERNAL, None, True),
        (grpc.StatusCode.UNAVAILABLE, None, True),  # unreachable
        (grpc.StatusCode.CANCELLED, None, True),  # the upstream went away mid-call
        (grpc.StatusCode.OK, None, False),
    ],
)
def test_what_counts_as_a_fault(code: grpc.StatusCode, reason: str | None, fault: bool) -> None:
    assert is_fault(code, md(reason)) is fault


@pytest.mark.parametrize(
    ("code", "answered", "reason"),
    [
        (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE, "unavailable"),
        (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE, "unavailable"),
        (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED, "too_large"),
        (grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNKNOWN, "internal"),
    ],
)
def test_every_error_reaches_the_client_with_a_reason(
    code: grpc.StatusCode, answered: grpc.StatusCode, reason: str
) -> None:
    got, _, trailing = client_status(code, "x", ())
    assert got == answered and dict(trailing)["x-error-reason"] == reason
    # A reason the upstream gave is kept, and its code with it.
    got, _, trailing = client_status(code, "x", md("queue_full"))
    assert got == code and [v for k, v in trailing if k == "x-error-reason"] == ["queue_full"]


def test_a_long_upstream_message_is_capped() -> None:
    _, details, _ = client_status(grpc.StatusCode.INVALID_ARGUMENT, "v" * 100_000, md("invalid_argument"))
    assert len(details) == MESSAGE_MAX + 3 and details.endswith("...")


def test_the_caller_is_the_tenant_else_the_user_else_the_connection() -> None:
    peer = "ipv4:127.0.0.1:5000"
    tenant = caller_key({"x-tenant-id": "acme", "x-user-id": "u1"}, "x-user-id", peer)
    assert tenant == caller_key({"x-tenant-id": "acme", "x-user-id": "u2"}, "x-user-id", "other")
    assert caller_key({"x-user-id": "u1"}, "x-user-id", peer) != caller_key(
        {"x-user-id": "u2"}, "x-user-id", peer
    )
    assert caller_key({}, "x-user-id", peer) != caller_key({}, "x-user-id", "ipv4:127.0.0.1:5001")


def canary_call(breaker: Breaker, caller: int, fault: bool = False, latency: float | None = 0.01) -> None:
    permit = breaker.allow()
    if permit is not None:
        breaker.report(permit, fault, latency, caller, lone_trips=True)


def test_a_failing_canary_with_one_caller_trips(breaker: Breaker) -> None:
    # The gateway's one connection, or a single client process: the window's only caller. A
    # canary has a fallback, so its breaker opens (that caller gets stable) ...
    for _ in range(10):
        canary_call(breaker, A, fault=True)
    assert breaker.state is State.OPEN


def test_a_version_without_fallback_never_trips_on_a_lone_callers_faults(breaker: Breaker) -> None:
    # ... while a stable version, which has nowhere to fall back to, needs a second caller's faults.
    for _ in range(50):
        call(breaker, A, fault=True)
    assert breaker.state is State.CLOSED


def test_a_lone_caller_cannot_trip_a_canary_that_other_callers_use_fine(breaker: Breaker) -> None:
    for _ in range(20):
        canary_call(breaker, B)
        canary_call(breaker, A, fault=True)
    assert breaker.state is State.CLOSED  # two callers in the window: leave-one-out decides


def test_a_slow_canary_with_one_caller_trips_on_latency(breaker: Breaker) -> None:
    for _ in range(30):
        canary_call(breaker, A, latency=0.02)
    assert breaker.adaptive.baseline is not None
    for _ in range(30):
        canary_call(breaker, A, latency=1.0)
    assert breaker.state is State.OPEN
