"""The adaptive breaker's state machine with a clock stepped by hand: trips on error rate and on
latency, backoff that grows and is capped, limited half-open probes, recovery, stale reports."""

from __future__ import annotations

import pytest

from modelyard.sidecar.breaker_policy import BreakerPolicy, State
from modelyard.sidecar.breakers import Breaker, BreakerKey, Breakers

POLICY = BreakerPolicy(
    window_s=10,
    min_calls=10,
    latency_min_calls=10,
    error_rate=0.5,
    latency_multiple=4,
    latency_floor_s=0.05,
    latency_check_s=0,
    backoff_s=1,
    backoff_factor=2,
    backoff_max_s=5,
    probes=2,
    consecutive_faults=100,  # the window's rules alone here; the fast path has its own tests
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def changes() -> list[tuple[State, State, str]]:
    return []


@pytest.fixture
def breaker(clock: FakeClock, changes: list[tuple[State, State, str]]) -> Breaker:
    return Breaker(
        BreakerKey("up", "m", "2"), POLICY, clock, lambda key, old, new, why: changes.append((old, new, why))
    )


def state(breaker: Breaker) -> State:
    return breaker.state


def call(breaker: Breaker, fault: bool = False, latency: float | None = 0.01) -> bool:
    permit = breaker.allow()
    if permit is None:
        return False
    breaker.report(permit, fault, latency)
    return True


def test_faults_below_the_minimum_number_of_calls_never_trip(breaker: Breaker) -> None:
    for _ in range(POLICY.min_calls - 1):
        call(breaker, fault=True)
    assert state(breaker) is State.CLOSED


def test_trips_on_the_error_rate_over_the_window(breaker: Breaker, changes, clock: FakeClock) -> None:
    for _ in range(6):
        call(breaker)
    for _ in range(5):
        call(breaker, fault=True)
    assert state(breaker) is State.CLOSED  # 5 faults in 11 calls: under half
    call(breaker, fault=True)
    assert state(breaker) is State.OPEN  # 6 in 12
    assert changes == [(State.CLOSED, State.OPEN, "error_rate")]
    assert breaker.allow() is None


def test_old_calls_leave_the_window(breaker: Breaker, clock: FakeClock) -> None:
    for _ in range(9):
        call(breaker, fault=True)
    clock.now += POLICY.window_s + 1  # the faults age out
    for _ in range(10):
        call(breaker)
    call(breaker, fault=True)
    assert state(breaker) is State.CLOSED


def test_half_open_after_the_backoff_lets_a_limited_number_of_probes(breaker: Breaker, clock) -> None:
    for _ in range(10):
        call(breaker, fault=True)
    assert state(breaker) is State.OPEN
    clock.now += 0.99
    assert breaker.allow() is None
    clock.now += 0.02
    first, second = breaker.allow(), breaker.allow()
    assert first is not None and second is not None and first.probe and second.probe
    assert state(breaker) is State.HALF_OPEN
    assert breaker.allow() is None  # two probes in flight: the limit
    breaker.report(first, False, 0.01)
    assert state(breaker) is State.HALF_OPEN
    breaker.report(second, False, 0.01)
    assert state(breaker) is State.CLOSED
    assert call(breaker)


def test_a_failed_probe_reopens_with_a_growing_capped_backoff(breaker: Breaker, clock, changes) -> None:
    for _ in range(10):
        call(breaker, fault=True)
    waits = []
    for _ in range(5):
        assert state(breaker) is State.OPEN
        waits.append(breaker.adaptive.backoff_s)
        clock.now += breaker.adaptive.backoff_s
        assert call(breaker, fault=True)  # the probe fails
    assert waits == [1, 2, 4, 5, 5]
    assert changes[-1] == (State.HALF_OPEN, State.OPEN, "probe_failed")
    # Recovery resets the backoff.
    clock.now += breaker.adaptive.backoff_s
    assert call(breaker) and call(breaker)
    assert state(breaker) is State.CLOSED and breaker.adaptive.backoff_s == 1


def test_trips_when_p99_latency_exceeds_the_learned_baseline(breaker: Breaker, changes) -> None:
    for _ in range(40):
        call(breaker, latency=0.020)
    assert breaker.adaptive.baseline == pytest.approx(0.020, rel=0.01)  # a bucket: breaker_policy.RATIO
    for _ in range(10):
        call(breaker, latency=0.030)  # slower, but under 4x the baseline
    assert state(breaker) is State.CLOSED
    call(breaker, latency=0.200)  # p99 of the window now 10x the baseline
    assert state(breaker) is State.OPEN
    assert changes[-1][2] == "latency"


def test_a_slide_towards_slow_is_not_learned(breaker: Breaker, changes) -> None:
    for _ in range(40):
        call(breaker, latency=0.020)
    for _ in range(30):
        call(breaker, latency=0.050)  # 2.5x: not a trip, not healthy enough to learn from
    assert breaker.adaptive.baseline == pytest.approx(0.020, rel=0.01)  # a bucket: breaker_policy.RATIO
    call(breaker, latency=0.090)  # 4.5x the baseline (a learned 50 ms would have hidden it)
    assert state(breaker) is State.OPEN and changes[-1][2] == "latency"


def test_a_slow_probe_counts_as_failed(breaker: Breaker, clock) -> None:
    for _ in range(20):
        call(breaker, latency=0.020)
    call(breaker, latency=1.0)
    assert state(breaker) is State.OPEN
    clock.now += 1
    call(breaker, latency=1.0)
    assert state(breaker) is State.OPEN and breaker.adaptive.trips == 2


def test_latency_under_the_floor_never_trips(breaker: Breaker) -> None:
    for _ in range(30):
        call(breaker, latency=0.001)
    for _ in range(30):
        call(breaker, latency=0.040)  # 40x the baseline, but under the 50 ms floor
    assert state(breaker) is State.CLOSED


def test_a_report_from_before_a_state_change_is_ignored(breaker: Breaker) -> None:
    early = breaker.allow()
    for _ in range(10):
        call(breaker, fault=True)
    assert state(breaker) is State.OPEN and early is not None
    breaker.report(early, False, 0.01)
    assert state(breaker) is State.OPEN


def test_a_cancelled_probe_frees_its_slot(breaker: Breaker, clock) -> None:
    for _ in range(10):
        call(breaker, fault=True)
    clock.now += 1
    probes = [breaker.allow(), breaker.allow()]
    assert breaker.allow() is None
    assert probes[0] is not None
    breaker.release(probes[0])
    assert breaker.allow() is not None


def test_the_set_keeps_one_breaker_per_upstream_model_and_version(clock) -> None:
    breakers = Breakers(POLICY, lambda *args: None, clock)
    assert breakers.get("a", "m", "1") is breakers.get("a", "m", "1")
    assert breakers.get("a", "m", "1") is not breakers.get("a", "m", "2")
    assert breakers.get("a", "m", "1") is not breakers.get("b", "m", "1")
    for _ in range(10):
        call(breakers.get("a", "m", "2"), fault=True)
    states = {(s["upstream"], s["version"]): s["state"] for s in breakers.snapshot()}
    assert states == {("a", "1"): "closed", ("a", "2"): "open", ("b", "1"): "closed"}


def test_bad_policies_are_refused() -> None:
    with pytest.raises(ValueError):
        BreakerPolicy(error_rate=0)
    with pytest.raises(ValueError):
        BreakerPolicy(backoff_s=10, backoff_max_s=1)
