"""A canary's breaker judged against stable (breaker_policy.Reference), the burst fast path, the
run of good probes sized by the share seen, the backoff reset when an upstream is reachable
again, and the effective weight (layers.route.effective, canary_status, the metrics): real
breakers, a clock stepped by hand, no sockets."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from modelyard.sidecar.breaker_policy import BreakerPolicy, State
from modelyard.sidecar.breakers import Breaker, BreakerKey, Breakers
from modelyard.sidecar.canary_status import canary_status
from modelyard.sidecar.dyeing import CANARY, STABLE, ModelRoute
from modelyard.sidecar.layers import balance, route
from modelyard.sidecar.layers.attempt import Attempt
from modelyard.sidecar.layers.read import Asked
from modelyard.sidecar.layers.route import Route
from modelyard.sidecar.layers.view import model_view
from modelyard.sidecar.metrics import SidecarMetrics
from modelyard.sidecar.routes.route_table import RouteTable
from tests.support import metric

DEFAULT = BreakerPolicy()
USERS = [hash(("user", f"u{i}")) for i in range(1000)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def versions(clock: Clock, policy: BreakerPolicy = DEFAULT) -> tuple[Breakers, Breaker, Breaker]:
    breakers = Breakers(policy, lambda *args: None, clock)
    return breakers, breakers.get("s", "m", "1"), breakers.get("c", "m", "2")


def state(breaker: Breaker) -> State:
    return breaker.state  # a call: mypy does not narrow it across the test's steps


def stable_call(breaker: Breaker, i: int, fault: bool = False, latency: float | None = 0.01) -> None:
    permit = breaker.allow()
    assert permit is not None
    breaker.report(permit, fault, latency, USERS[i % len(USERS)])


def canary_call(breaker: Breaker, i: int, fault: bool = False, latency: float | None = 0.01) -> bool:
    """A canary-dyed call (judged against stable "1"); False when the breaker refused it."""
    permit = breaker.allow()
    if permit is None:
        return False
    breaker.report(permit, fault, latency, USERS[i % len(USERS)], True, stable="1")
    return True


def thirty_percent(i: int) -> bool:
    """3 faults in every 10 calls, spread out: at most 3 good calls in a row."""
    return i % 10 in (0, 3, 6)


# --- judged against stable -------------------------------------------------------------------

SLOW_POLICY = dataclasses.replace(
    DEFAULT, latency_min_calls=20, latency_check_s=0, canary_latency_floor_s=0.1
)


def test_a_canary_slow_from_its_first_call_is_cut_off_against_stable(clock: Clock) -> None:
    _, stable, canary = versions(clock, SLOW_POLICY)
    for i in range(40):
        stable_call(stable, i, latency=0.02)
    calls = 0
    while canary_call(canary, calls, latency=0.4):  # 20x stable from the start
        calls += 1
    # latency_min_calls of them, and one more: the p99 holds without the slowest caller too
    assert calls == SLOW_POLICY.latency_min_calls + 1
    assert state(canary) is State.OPEN and canary.adaptive.reason == "latency"
    assert canary.adaptive.latency_limit() == pytest.approx(0.1)  # the floor: 3 x 20 ms is under it
    # Judged against itself alone (no stable calls), the same canary learns 0.4 s as normal.
    _, _, alone = versions(Clock(), SLOW_POLICY)
    for i in range(60):
        canary_call(alone, i, latency=0.4)
    assert state(alone) is State.CLOSED and alone.adaptive.baseline == pytest.approx(0.4, rel=0.01)


def test_a_slow_canary_of_little_traffic_is_judged_by_medians_at_the_defaults(clock: Clock) -> None:
    policy = dataclasses.replace(DEFAULT, latency_check_s=0)  # latency_min_calls 100: too many here
    _, stable, canary = versions(clock, policy)
    for i in range(40):
        stable_call(stable, i, latency=0.02)
    for i in range(DEFAULT.min_calls):
        canary_call(canary, i, latency=0.02 if i % 10 else 2.0)  # hiccups: the median is untouched
    assert state(canary) is State.CLOSED
    calls = 0
    while canary_call(canary, 100 + calls, latency=0.5):  # slow on most calls
        calls += 1
    assert state(canary) is State.OPEN and canary.adaptive.reason == "latency"
    assert calls <= DEFAULT.min_calls + 1
    # The limit scales with stable: a multiple of its median (20 ms, counted within +-1%), not the
    # fixed floor of a version judged by its own baseline (latency_floor_s, 0.25 s).
    limit = canary.adaptive.latency_limit()
    assert limit == pytest.approx(DEFAULT.canary_latency_multiple * 0.02, rel=0.02)
    assert limit is not None and limit < DEFAULT.latency_floor_s


def test_the_floor_keeps_jitter_from_tripping_a_canary(clock: Clock) -> None:
    _, stable, canary = versions(clock, SLOW_POLICY)
    for i in range(40):
        stable_call(stable, i, latency=0.001)
    for i in range(40):
        canary_call(canary, i, latency=0.05)  # 50x stable, but under the 100 ms floor
    assert state(canary) is State.CLOSED


def test_a_canary_as_slow_as_stable_is_not_cut_off(clock: Clock) -> None:
    _, stable, canary = versions(clock, SLOW_POLICY)
    for i in range(40):
        stable_call(stable, i, latency=0.4)  # the machine is slow for everybody
    for i in range(40):
        canary_call(canary, i, latency=0.5)
    assert state(canary) is State.CLOSED


def test_a_canary_is_cut_off_for_faults_over_stables_share_only(clock: Clock) -> None:
    policy = dataclasses.replace(DEFAULT, consecutive_faults=100)  # the window's rule alone
    _, stable, canary = versions(clock, policy)
    for i in range(60):
        stable_call(stable, i, fault=i % 20 in (0, 7, 14))  # a dependency both versions share: 15%
    for i in range(50):
        canary_call(canary, i, fault=thirty_percent(i))
    assert state(canary) is State.CLOSED  # 30%: over error_rate, but not error_rate over stable's 15%
    for i in range(50, 90):
        canary_call(canary, i, fault=i % 2 == 0)  # 50% (on average 40% in the window): over 35%
    assert state(canary) is State.OPEN and canary.adaptive.reason == "error_rate"


# --- the default policy on a 30% failing canary ---------------------------------------------


def test_a_thirty_percent_failing_canary_is_cut_off_at_the_defaults_and_does_not_flap(clock: Clock) -> None:
    _, _, canary = versions(clock)
    for i in range(DEFAULT.min_calls):
        canary_call(canary, i, fault=thirty_percent(i))
    assert state(canary) is State.OPEN and canary.adaptive.reason == "error_rate"
    # The share seen (30%) asks for a run of 9 good probes: a 30% canary passes it 4% of the time.
    assert canary.adaptive.run == 9
    served = closes = 0
    for i in range(2000):
        clock.now += 0.1
        was = state(canary)
        served += canary_call(canary, i, fault=thirty_percent(i))
        closes += was is State.HALF_OPEN and state(canary) is State.CLOSED
    # Three good probes in a row (the run before) occur in every 10 calls: it flapped shut again.
    assert closes == 0 and state(canary) is not State.CLOSED
    assert served < 0.05 * 2000  # the probes of each backoff only


def test_a_canary_that_heals_closes_after_its_run(clock: Clock) -> None:
    _, _, canary = versions(clock)
    for i in range(DEFAULT.min_calls):
        canary_call(canary, i, fault=thirty_percent(i))
    clock.now += DEFAULT.backoff_s
    for i in range(8):
        assert canary_call(canary, i)
        assert state(canary) is State.HALF_OPEN
    assert canary_call(canary, 8) and state(canary) is State.CLOSED


def test_half_open_lets_probes_at_a_time_up_to_the_run(clock: Clock) -> None:
    _, _, canary = versions(clock)
    for i in range(DEFAULT.min_calls):
        canary_call(canary, i, fault=thirty_percent(i))
    clock.now += DEFAULT.backoff_s
    permits = [canary.allow() for _ in range(DEFAULT.probes)]
    assert all(p is not None and p.probe for p in permits) and canary.allow() is None
    for permit in permits:
        assert permit is not None
        canary.report(permit, False, 0.01, USERS[0], True, stable="1")
    assert state(canary) is State.HALF_OPEN and canary.snapshot()["probe_successes"] == 3


# --- the fast path ----------------------------------------------------------------------------


def test_a_canary_that_dies_after_a_healthy_window_trips_on_its_burst(clock: Clock) -> None:
    _, _, canary = versions(clock)
    for i in range(200):
        canary_call(canary, i)  # a full, healthy window
    for i in range(DEFAULT.consecutive_faults - 1):
        canary_call(canary, i, fault=True)
    assert state(canary) is State.CLOSED
    canary_call(canary, 99, fault=True)
    assert state(canary) is State.OPEN and canary.adaptive.reason == "consecutive_faults"


def test_one_callers_burst_never_trips_a_version_without_fallback(clock: Clock) -> None:
    _, stable, _ = versions(clock)
    for _ in range(19):
        stable_call(stable, 1)  # another caller's good calls
    for _ in range(50):
        stable_call(stable, 0, fault=True)  # one caller's bad values
    stable_call(stable, 1, fault=True)  # and incidental faults of the other, in the burst
    stable_call(stable, 1, fault=True)
    assert state(stable) is State.CLOSED  # the window without caller 0 holds 2 faults in 21
    stable_call(stable, 1, fault=True)  # half the burst's length from the others: not one caller's
    assert state(stable) is State.OPEN and stable.adaptive.reason == "consecutive_faults"


def test_a_canarys_lone_callers_burst_trips(clock: Clock) -> None:
    _, _, canary = versions(clock)
    for _ in range(DEFAULT.consecutive_faults):
        canary_call(canary, 0, fault=True)
    assert state(canary) is State.OPEN


def test_a_good_call_ends_the_burst(clock: Clock) -> None:
    _, _, canary = versions(clock)
    for i in range(40):
        canary_call(canary, i, fault=i % 5 != 4)  # 4 faults, then a good call: 80%, never 5 in a row
        if i < DEFAULT.min_calls - 1:
            assert state(canary) is State.CLOSED


# --- backoff --------------------------------------------------------------------------------


def test_the_backoff_grown_while_down_resets_when_the_upstream_is_reachable(clock: Clock) -> None:
    breakers, _, canary = versions(clock)
    for i in range(DEFAULT.consecutive_faults):
        canary_call(canary, i, fault=True)
    for i in range(6):  # down: each probe fails, the backoff doubles up to the cap
        clock.now += canary.adaptive.backoff_s
        assert canary_call(canary, i, fault=True)
    assert canary.adaptive.backoff_s == DEFAULT.backoff_max_s
    breakers.reachable("s")  # another upstream: nothing changes
    assert canary.adaptive.backoff_s == DEFAULT.backoff_max_s
    breakers.reachable("c")
    assert canary.adaptive.backoff_s == DEFAULT.backoff_s
    clock.now += DEFAULT.backoff_s
    assert canary_call(canary, 0) and state(canary) is State.HALF_OPEN


# --- effective weight ------------------------------------------------------------------------


@dataclass(frozen=True)
class Up:
    address: str


@dataclass
class Pool:
    served: dict[str, set[str]]  # address -> versions of "m"
    ups: dict[str, Up] = field(init=False)

    def __post_init__(self) -> None:
        self.ups = {address: Up(address) for address in self.served}

    def knows(self, model: str, version: str = "") -> bool:
        return model == "m" and any(not version or version in v for v in self.served.values())

    def versions(self, model: str) -> Iterable[str]:
        return {v for vs in self.served.values() for v in vs} if model == "m" else set()

    def candidates(self, model: str, version: str) -> Sequence[Up]:
        return [self.ups[a] for a, vs in self.served.items() if model == "m" and version in vs]

    serving = candidates  # no turn taken here

    def any(self) -> Sequence[Up]:
        return list(self.ups.values())


def test_an_open_canary_has_effective_weight_zero_until_its_backoff_ends(clock: Clock) -> None:
    breakers, _, canary = versions(clock)
    pool = Pool({"s": {"1"}, "c": {"2"}})
    table = RouteTable(models={"m": ModelRoute(canary_weight=30)})
    view = model_view("m", table, pool)

    def first(received: dict[str, str]) -> Attempt[Any]:
        """The first attempt of a call dyed canary (version 2, stable 1) by route.decide."""
        asked = Asked("m", "", received, (), view)
        return balance.first(
            asked, route.effective(Route("2", CANARY, "1"), asked, breakers), 7, pool, breakers
        )

    def status() -> tuple[float, float, str | None]:
        found = canary_status("m", table, pool, breakers)
        return found.weight, found.effective_weight, found.breaker

    assert status() == (30, 30, "closed")
    for i in range(DEFAULT.consecutive_faults):
        canary_call(canary, i, fault=True)
    assert status() == (30, 0, "open") and breakers.is_open("m", "2") and not breakers.is_open("m", "1")
    # Dyed canary by the route: stable, with no fallback to tell (no new user goes there).
    plan = first({})
    assert (plan.version, plan.dye, plan.fallback) == ("1", STABLE, "")
    # Asked for by the caller's own header: a per-call fallback, told.
    plan = first({"x-canary-weight": "100"})
    assert (plan.version, plan.dye, plan.fallback) == ("1", STABLE, "breaker-open")
    clock.now += DEFAULT.backoff_s  # probes may go: the weight is back, for the probes to come
    assert status() == (30, 30, "open")
    plan = first({})
    assert (plan.version, plan.dye, plan.fallback) == ("2", CANARY, "")
    assert status() == (30, 30, "half-open") and breakers.is_open("m", "2")


def test_a_model_without_a_canary_has_effective_weight_zero(clock: Clock) -> None:
    breakers, _, _ = versions(clock)
    table = RouteTable(models={"m": ModelRoute(canary_weight=30)})
    found = canary_status("m", table, Pool({"s": {"1"}}), breakers)
    assert (found.canary, found.weight, found.effective_weight) == ("", 30, 0)


# --- metrics -----------------------------------------------------------------------------------


def test_breaker_series_exist_from_the_start_and_follow_the_state(clock: Clock) -> None:
    metrics = SidecarMetrics()
    breakers = Breakers(
        DEFAULT, lambda key, old, new, why: metrics.breaker_changed(key, new), clock, metrics.breaker_known
    )
    name = "modelyard_sidecar_breaker_state"
    assert metric(metrics.registry, name, upstream="c", model="m", version="2") is None
    breakers.ensure([BreakerKey("s", "m", "1"), BreakerKey("c", "m", "2")])
    assert metric(metrics.registry, name, upstream="s", model="m", version="1") == 0
    assert metric(metrics.registry, name, upstream="c", model="m", version="2") == 0
    canary = breakers.get("c", "m", "2")
    for i in range(DEFAULT.consecutive_faults):
        canary_call(canary, i, fault=True)
    assert metric(metrics.registry, name, upstream="c", model="m", version="2") == 2


def test_the_canary_weights_are_exported_at_each_scrape(clock: Clock) -> None:
    metrics = SidecarMetrics()
    breakers, _, canary = versions(clock)
    pool = Pool({"s": {"1"}, "c": {"2"}})
    table = RouteTable(models={"m": ModelRoute(canary_weight=30)})
    metrics.canary_weights(
        lambda: [(s.model, s.weight, s.effective_weight) for s in [canary_status("m", table, pool, breakers)]]
    )
    assert metric(metrics.registry, "modelyard_sidecar_canary_effective_weight", model="m") == 30
    for i in range(DEFAULT.consecutive_faults):
        canary_call(canary, i, fault=True)
    assert metric(metrics.registry, "modelyard_sidecar_canary_effective_weight", model="m") == 0
    assert metric(metrics.registry, "modelyard_sidecar_canary_weight", model="m") == 30
