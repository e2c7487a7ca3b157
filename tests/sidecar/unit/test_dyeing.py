"""Dyeing: precedence, weights, stickiness, monotonic weight changes, versions from the served set."""

from __future__ import annotations

import pytest

from modelyard.sidecar.dyeing import (
    BUCKETS,
    CANARY,
    PINNED,
    STABLE,
    ModelRoute,
    RoutingError,
    bucket,
    decide,
    stable_and_canary,
)

SERVED = {"1", "2"}


def dye(user: str, weight: float, route: ModelRoute | None = None, header: str | None = None) -> str:
    route = route or ModelRoute(canary_weight=weight)
    return decide(route, SERVED, pin="", sticky_key=user, header_weight=header).dye


def test_the_newest_of_two_served_versions_is_the_canary() -> None:
    assert stable_and_canary(ModelRoute(), {"1", "2"}) == ("1", "2")
    assert stable_and_canary(ModelRoute(), {"9", "10"}) == ("9", "10")  # numeric, not text order
    assert stable_and_canary(ModelRoute(), {"3"}) == ("3", "")
    assert stable_and_canary(ModelRoute(stable="2", canary="1"), {"1", "2"}) == ("2", "1")


def test_with_one_version_everything_is_stable() -> None:
    decision = decide(ModelRoute(canary_weight=100), {"3"}, pin="", sticky_key="u", header_weight=None)
    assert (decision.version, decision.dye) == ("3", STABLE)


def test_a_pin_wins_over_any_weight() -> None:
    decision = decide(ModelRoute(canary_weight=100), SERVED, pin="v1", sticky_key="u", header_weight="100")
    assert (decision.version, decision.dye) == ("1", PINNED)


def test_canary_share_matches_the_weight() -> None:
    users = [f"user-{i}" for i in range(20_000)]
    for weight in (1, 10, 25, 50, 90):
        share = sum(dye(u, weight) == CANARY for u in users) / len(users)
        assert abs(share - weight / 100) < 0.01, (weight, share)
    assert all(dye(u, 0) == STABLE for u in users[:2000])
    assert all(dye(u, 100) == CANARY for u in users[:2000])


def test_a_user_keeps_their_dye_and_raising_the_weight_never_moves_one_back() -> None:
    users = [f"user-{i}" for i in range(5000)]
    previous = {u: dye(u, 0) for u in users}
    for weight in (5, 10, 10, 30, 60, 99, 100):
        current = {u: dye(u, weight) for u in users}
        assert all(current[u] == CANARY for u in users if previous[u] == CANARY)
        previous = current
    assert dye("alice", 30) == dye("alice", 30)


def test_buckets_are_the_same_in_every_process() -> None:
    # blake2b, not Python's salted hash(): fixed values for fixed keys.
    assert bucket("alice") == bucket("alice") and 0 <= bucket("alice") < BUCKETS
    assert len({bucket(f"k{i}") for i in range(1000)}) > 900


def test_the_header_weight_overrides_the_route() -> None:
    users = [f"user-{i}" for i in range(2000)]
    route = ModelRoute(canary_weight=0)
    assert all(dye(u, 0, route, header="100") == CANARY for u in users)
    assert all(dye(u, 0, ModelRoute(canary_weight=100), header="0") == STABLE for u in users)
    assert all(dye(u, 0, route, header="100.0") == CANARY for u in users)


@pytest.mark.parametrize(
    "header",
    ["-1", "101", "lots", "", " 50 ", "5_0", "+50", "050", "\u0665\u0660", "nan", "inf", "5e1", "50."],
)
def test_a_bad_header_weight_is_a_clear_error(header: str) -> None:
    with pytest.raises(RoutingError, match="x-canary-weight"):
        dye("u", 0, header=header)


def test_without_a_key_requests_spread_by_the_weight() -> None:
    route = ModelRoute(canary_weight=50)
    dyes = [decide(route, SERVED, pin="", sticky_key=None, header_weight=None).dye for _ in range(2000)]
    assert 0.4 < dyes.count(CANARY) / len(dyes) < 0.6


def test_unknown_versions_leave_the_call_undyed() -> None:
    decision = decide(ModelRoute(canary_weight=100), set(), pin="", sticky_key="u", header_weight=None)
    assert (decision.version, decision.dye) == ("", "")
