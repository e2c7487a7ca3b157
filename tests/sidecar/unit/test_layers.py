"""The call path's layers (sidecar/layers/): what a call asks for (read), its route, its first
attempt (balance), what a failed attempt means and the next one (retry), table by table, with
each attempt's verdict given through a real per-call scope (scope.py) as the proxy gives it.
Pure: plain upstream stand-ins, real breakers on a stepped clock, no gRPC."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import pytest

from modelyard.common.names import InvalidName
from modelyard.sidecar.breaker_policy import BreakerPolicy, State
from modelyard.sidecar.breakers import Breakers
from modelyard.sidecar.dyeing import CANARY, PINNED, STABLE, Decision, ModelRoute
from modelyard.sidecar.layers import balance, read, retry, route
from modelyard.sidecar.layers.attempt import (
    FALLBACK_BREAKER,
    FALLBACK_CANARY_FAULT,
    FALLBACK_REPLAYED,
    FALLBACK_UNAVAILABLE,
    Attempt,
)
from modelyard.sidecar.layers.read import OTHER, Asked, Metadata, Refused
from modelyard.sidecar.layers.route import Route
from modelyard.sidecar.layers.view import ModelView, Views, is_stateful, model_view
from modelyard.sidecar.metrics import SidecarMetrics
from modelyard.sidecar.routes.route_table import RouteTable
from modelyard.sidecar.scope import Scope, Scopes
from modelyard.sidecar.tenant_limits import ANY_TENANT, TenantLimit, TenantLimits
from modelyard.sidecar.tracing import Tracing

POLICY = BreakerPolicy(min_calls=2, error_rate=0.5, backoff_s=5, backoff_max_s=5, probes=1)
PATH = "/inference.GRPCInferenceService/ModelInfer"


@dataclass(frozen=True)
class Up:
    address: str


@dataclass
class Pool:
    """What each upstream serves: address -> model -> versions (upstreams.Upstreams' view)."""

    served: dict[str, dict[str, set[str]]]
    ups: dict[str, Up] = field(init=False)

    def __post_init__(self) -> None:
        self.ups = {address: Up(address) for address in self.served}

    def knows(self, model: str, version: str = "") -> bool:
        return any(
            model in models and (not version or version in models[model]) for models in self.served.values()
        )

    def versions(self, model: str) -> Iterable[str]:
        return {v for models in self.served.values() for v in models.get(model, ())}

    def candidates(self, model: str, version: str) -> Sequence[Up]:
        return [
            self.ups[a]
            for a, models in self.served.items()
            if model in models and (not version or version in models[model])
        ]

    serving = candidates  # no turn taken here

    def any(self) -> Sequence[Up]:
        return list(self.ups.values())


def views(pool: Pool, table: RouteTable | None = None) -> Views:
    """Each model's view made afresh (views.ModelViews keeps them; the layers read them)."""
    return lambda model: model_view(model, table or RouteTable(), pool)


class World:
    """A pool, its breakers (on a clock that only moves by hand) and a route table; each call's
    scope, which gives its attempts' verdicts (`calls`: attempt -> its call's scope)."""

    def __init__(self, served: dict[str, dict[str, set[str]]], table: RouteTable | None = None) -> None:
        self.pool = Pool(served)
        self.now = 100.0
        self.breakers = Breakers(POLICY, lambda *args: None, clock=lambda: self.now)
        self.table = table or RouteTable()
        self.scopes = Scopes(TenantLimits(), SidecarMetrics(), Tracing())
        self.calls: dict[int, Scope] = {}
        # Dyed canary by the caller's own x-canary-weight: a shut canary falls back call by call
        # (dyed by the route's weight, it is dyed stable instead: test_a_shut_canary_...).
        self.received: dict[str, str] = {"x-canary-weight": "50"}

    def open(self, address: str, model: str, version: str) -> None:
        breaker = self.breakers.get(address, model, version)
        for caller in range(10):
            permit = breaker.allow()
            if permit is None:
                break
            breaker.report(permit, True, None, caller)
        assert breaker.state is State.OPEN

    def view(self, model: str = "m") -> ModelView[Up]:
        return model_view(model, self.table, self.pool)

    def request(self, model: str = "m", pin: str = "") -> Asked:
        return Asked(model, pin, self.received, (("x-request-id", "r1"),), self.view(model))

    def first(self, decision: Decision, model: str = "m") -> Attempt[Up]:
        asked = self.request(model)
        routed = route.effective(routed_by(decision), asked, self.breakers)
        attempt = balance.first(asked, routed, 7, self.pool, self.breakers)
        scope = self.scopes.open(PATH, ())
        scope.begin(attempt)
        self.calls[id(attempt)] = scope
        return attempt

    def scope(self, attempt: Attempt[Up]) -> Scope:
        return self.calls[id(attempt)]

    def after(
        self, attempt: Attempt[Up], code: str, reason: str = "", tried: list[Up] | None = None
    ) -> Attempt[Up] | None:
        """As the proxy's attempt loop does: the retry policy's next attempt, the failed one's
        verdict through its call's scope, the next one begun there."""
        following = retry.after_failure(
            attempt,
            code,
            reason,
            tried if tried is not None else [],
            self.view(attempt.model),
            self.pool,
            self.breakers,
        )
        scope = self.scope(attempt)
        scope.failed(code, reason, None, following)
        if following is not None:
            scope.begin(following)
            self.calls[id(following)] = scope
        return following


def routed_by(decision: Decision) -> Route:
    """The route `route.decide` gives a data call so decided."""
    return Route(decision.version, decision.dye, decision.stable)


def decision_of(routed: Route) -> Decision:
    """The route as routing.decide gives it."""
    canary = routed.version if routed.dye == CANARY else ""
    return Decision(routed.version, routed.dye, canary, routed.stable)


def shape(plan: Attempt[Up] | None) -> tuple[str, str, str, str, bool] | None:
    if plan is None:
        return None
    return (plan.upstream.address, plan.version, plan.dye, plan.fallback, plan.fell_back)


TWO_VERSIONS = {"a": {"m": {"1", "2"}}}
TWO_UPSTREAMS = {"a": {"m": {"1", "2"}}, "b": {"m": {"1", "2"}}}
STABLE_ELSEWHERE = {"a": {"m": {"1", "2"}}, "b": {"m": {"1"}}}
STABLE_1 = Decision("1", STABLE, stable="1")
CANARY_2 = Decision("2", CANARY, canary="2", stable="1")
PINNED_2 = Decision("2", PINNED)


# --- what counts as a fault ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "reason", "fault"),
    [
        ("OK", "", False),
        ("DEADLINE_EXCEEDED", "", False),  # the caller's own deadline
        ("DEADLINE_EXCEEDED", "internal", False),  # never, whatever the reason says
        ("UNAVAILABLE", "", True),  # unreachable
        ("INTERNAL", "", True),
        ("UNKNOWN", "", True),
        ("CANCELLED", "", True),  # the upstream went away mid-call
        ("INVALID_ARGUMENT", "", False),
        ("RESOURCE_EXHAUSTED", "", False),
        ("NOT_FOUND", "", False),
        ("UNAVAILABLE", "queue_full", False),  # the reason decides: load
        ("UNAVAILABLE", "draining", False),
        ("CANCELLED", "cancelled", False),
        ("INTERNAL", "model_failed", True),
        ("INVALID_ARGUMENT", "internal", True),  # the reason decides, not the code
        ("UNAVAILABLE", "unavailable", True),
    ],
)
def test_is_fault(code: str, reason: str, fault: bool) -> None:
    assert retry.is_fault(code, reason) is fault


@pytest.mark.parametrize(
    ("code", "reason", "unreachable"),
    [("UNAVAILABLE", "", True), ("UNAVAILABLE", "draining", False), ("INTERNAL", "", False)],
)
def test_is_unreachable(code: str, reason: str, unreachable: bool) -> None:
    assert retry.is_unreachable(code, reason) is unreachable


# --- the first attempt ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("served", "opened", "decision", "expected"),
    [
        # the decided version, on the first upstream whose breaker lets the call through
        (TWO_VERSIONS, [], STABLE_1, ("a", "1", STABLE, "", False)),
        (TWO_VERSIONS, [], CANARY_2, ("a", "2", CANARY, "", False)),
        (TWO_UPSTREAMS, [("a", "2")], CANARY_2, ("b", "2", CANARY, "", False)),
        (TWO_UPSTREAMS, [("a", "1")], STABLE_1, ("b", "1", STABLE, "", False)),
        # a canary whose breakers all refuse falls back to stable
        (TWO_VERSIONS, [("a", "2")], CANARY_2, ("a", "1", STABLE, FALLBACK_BREAKER, True)),
        (
            TWO_UPSTREAMS,
            [("a", "2"), ("b", "2"), ("a", "1")],
            CANARY_2,
            ("b", "1", STABLE, FALLBACK_BREAKER, True),
        ),
        # a pin never falls back
        (TWO_VERSIONS, [("a", "2")], PINNED_2, "breaker_open"),
        # stable has nowhere to fall back to
        (TWO_VERSIONS, [("a", "1")], STABLE_1, "breaker_open"),
        (TWO_VERSIONS, [("a", "1"), ("a", "2")], CANARY_2, "breaker_open"),
        # no upstream at all: unavailable (a canary tries stable first, in vain)
        ({}, [], CANARY_2, "unavailable"),
        ({}, [], STABLE_1, "unavailable"),
    ],
)
def test_first_attempt(
    served: dict[str, dict[str, set[str]]],
    opened: list[tuple[str, str]],
    decision: Decision,
    expected: tuple[str, str, str, str, bool] | str,
) -> None:
    world = World(served)
    for address, version in opened:
        world.open(address, "m", version)
    if isinstance(expected, str):
        with pytest.raises(Refused) as refused:
            world.first(decision)
        assert (refused.value.code, refused.value.reason) == ("UNAVAILABLE", expected)
        return
    plan = world.first(decision)
    assert shape(plan) == expected
    assert plan.breaker is world.breakers.get(plan.upstream.address, "m", plan.version)
    assert plan.permit is not None and plan.caller == 7 and plan.label == "m"
    assert plan.forward[-2:] == (("x-model-version", plan.version), ("x-model-dye", plan.dye))
    assert plan.answer_metadata == (
        (("x-model-dye", plan.dye), ("x-dye-fallback", plan.fallback))
        if plan.fallback
        else (("x-model-dye", plan.dye),)
    )


def test_a_model_the_upstreams_do_not_serve_goes_anywhere_without_state() -> None:
    world = World(TWO_VERSIONS)
    plan = world.first(Decision("", ""), model="made-up")
    assert shape(plan) == ("a", "", "", "", False)
    assert (plan.breaker, plan.permit, plan.label) == (None, None, OTHER)
    assert plan.forward == (("x-request-id", "r1"),)  # no version: no version or dye headers
    assert plan.answer_metadata == ()
    assert len(world.breakers) == 0


@pytest.mark.parametrize(
    ("model", "version", "route", "stateful"),
    [
        ("m", "1", None, True),  # served
        ("m", "", None, True),  # the model is served; its default version
        ("m", "9", None, False),  # a version a client made up
        ("m", "9", ModelRoute(canary="9"), True),  # ...unless the route names it
        ("m", "9", ModelRoute(stable="9"), True),
        ("x", "1", None, False),  # a model nobody serves
        ("", "", None, False),
    ],
)
def test_which_versions_get_a_breaker(
    model: str, version: str, route: ModelRoute | None, stateful: bool
) -> None:
    table = RouteTable(models={"m": route}) if route is not None else RouteTable()
    assert is_stateful(model, version, table, Pool(TWO_VERSIONS)) is stateful


# --- what a failed attempt means, and the next one -----------------------------------------


@pytest.mark.parametrize(
    ("served", "decision", "code", "reason", "expected"),
    [
        # the failure is the answer: a client mistake, load, the caller's deadline, a stable fault
        (TWO_UPSTREAMS, STABLE_1, "INVALID_ARGUMENT", "invalid_argument", None),
        (TWO_UPSTREAMS, STABLE_1, "INTERNAL", "model_failed", None),
        (TWO_UPSTREAMS, CANARY_2, "RESOURCE_EXHAUSTED", "queue_full", None),
        (TWO_UPSTREAMS, CANARY_2, "UNAVAILABLE", "draining", None),
        (TWO_UPSTREAMS, CANARY_2, "DEADLINE_EXCEEDED", "", None),
        (TWO_UPSTREAMS, CANARY_2, "INVALID_ARGUMENT", "invalid_argument", None),
        # an unreachable upstream: another one for the same version
        (TWO_UPSTREAMS, STABLE_1, "UNAVAILABLE", "", ("b", "1", STABLE, "", False)),
        (TWO_UPSTREAMS, CANARY_2, "UNAVAILABLE", "", ("b", "2", CANARY, "", False)),
        (TWO_VERSIONS, STABLE_1, "UNAVAILABLE", "", None),  # no other upstream
        (TWO_VERSIONS, PINNED_2, "UNAVAILABLE", "", None),
        # ...and for a canary with no other upstream, stable elsewhere
        (STABLE_ELSEWHERE, CANARY_2, "UNAVAILABLE", "", ("b", "1", STABLE, FALLBACK_UNAVAILABLE, True)),
        (TWO_VERSIONS, CANARY_2, "UNAVAILABLE", "", None),  # stable only on the unreachable one
        # a canary fault: stable answers instead, on any upstream (the same one included)
        (TWO_VERSIONS, CANARY_2, "INTERNAL", "model_failed", ("a", "1", STABLE, FALLBACK_CANARY_FAULT, True)),
        (TWO_VERSIONS, CANARY_2, "INTERNAL", "", ("a", "1", STABLE, FALLBACK_CANARY_FAULT, True)),
        (TWO_VERSIONS, CANARY_2, "CANCELLED", "", ("a", "1", STABLE, FALLBACK_CANARY_FAULT, True)),
        # a pinned version's fault is the answer
        (TWO_VERSIONS, PINNED_2, "INTERNAL", "model_failed", None),
    ],
)
def test_after_a_failed_attempt(
    served: dict[str, dict[str, set[str]]],
    decision: Decision,
    code: str,
    reason: str,
    expected: tuple[str, str, str, str, bool] | None,
) -> None:
    world = World(served)
    plan = world.first(decision)
    assert plan.upstream.address == "a"
    tried: list[Up] = []
    following = world.after(plan, code, reason, tried)
    assert shape(following) == expected
    scope = world.scope(plan)
    assert scope.settled or scope.current is not plan  # its verdict went to its breaker, whatever follows
    window = world.breakers.get("a", "m", decision.version).adaptive.window
    assert (len(window), window.faults) == (1, int(retry.is_fault(code, reason)))
    if following is not None:
        assert tried == [world.pool.ups["a"]]
        assert following.permit is not None and scope.current is following and not scope.settled
        assert (following.caller, following.label, following.stable) == (7, "m", plan.stable)
        dyed = (("x-model-dye", following.dye),)
        fell_back = (("x-dye-fallback", following.fallback),) if following.fallback else ()
        assert following.answer_metadata == (*dyed, *fell_back)  # the new attempt's own
        # the version and dye headers are the new attempt's, once each
        versions = [v for k, v in following.forward if k == "x-model-version"]
        dyes = [v for k, v in following.forward if k == "x-model-dye"]
        assert (versions, dyes) == ([following.version], [following.dye])


def test_a_canary_refusal_is_replayed_on_stable_and_charged_only_when_stable_answers() -> None:
    world = World(TWO_UPSTREAMS)
    canary_window = world.breakers.get("a", "m", "2").adaptive.window
    # Stable answers: the canary's graph was at fault, charged as a fault once the replay ended.
    plan = world.first(CANARY_2)
    replay = world.after(plan, "FAILED_PRECONDITION", "model_rejected")
    assert shape(replay) == ("a", "1", STABLE, FALLBACK_CANARY_FAULT, False)  # counted once settled
    scope = world.scope(plan)
    assert replay is not None and replay.replay_of is plan and scope.pending is plan  # its verdict waits
    assert len(canary_window) == 0
    assert replay.answer_metadata == (("x-model-dye", STABLE), ("x-dye-fallback", FALLBACK_CANARY_FAULT))
    scope.report("OK", "", 0.001)
    assert (scope.pending, scope.charged, scope.current) == (None, True, replay)
    assert (len(canary_window), canary_window.faults) == (1, 1)

    # Stable refuses it too: the request's fault, charged to neither, and the answer says so.
    plan = world.first(CANARY_2)
    replay = world.after(plan, "FAILED_PRECONDITION", "model_rejected")
    assert replay is not None
    assert world.after(replay, "FAILED_PRECONDITION", "model_rejected") is None
    scope = world.scope(plan)
    assert scope.pending is None and not scope.charged
    assert (len(canary_window), canary_window.faults) == (1, 1)  # no verdict: nothing recorded
    assert scope.current is not None and scope.current.fallback == FALLBACK_REPLAYED
    answer = (("x-model-dye", STABLE), ("x-dye-fallback", FALLBACK_REPLAYED))
    assert scope.current.answer_metadata == answer
    stable_window = world.breakers.get("a", "m", "1").adaptive.window
    assert (len(stable_window), stable_window.faults) == (2, 0)  # stable's refusal is no fault

    # An unreachable stable: the replay goes to another, the canary still waiting for its verdict.
    plan = world.first(CANARY_2)
    replay = world.after(plan, "FAILED_PRECONDITION", "model_rejected")
    assert replay is not None
    again = world.after(replay, "UNAVAILABLE", "")
    assert shape(again) == ("b", "1", STABLE, FALLBACK_CANARY_FAULT, False)
    scope = world.scope(plan)
    assert again is not None and again.replay_of is plan and scope.pending is plan
    scope.report("CANCELLED", "", None, gone=True)  # the caller left: no verdict on the canary
    assert scope.current is not None
    assert (scope.pending, scope.charged, scope.current.fallback) == (None, False, FALLBACK_REPLAYED)
    assert (len(canary_window), canary_window.faults) == (1, 1)


def test_a_refusal_of_stable_or_a_pinned_version_is_the_answer() -> None:
    world = World(TWO_VERSIONS)
    for decision in (STABLE_1, PINNED_2):
        plan = world.first(decision)
        assert world.after(plan, "FAILED_PRECONDITION", "model_rejected") is None
        window = world.breakers.get("a", "m", decision.version).adaptive.window
        assert (len(window), window.faults) == (1, 0)


def test_a_fallen_back_attempt_that_is_unreachable_keeps_its_fallback_and_is_not_counted_again() -> None:
    world = World(TWO_UPSTREAMS)
    world.open("a", "m", "2")
    world.open("b", "m", "2")
    plan = world.first(CANARY_2)
    assert shape(plan) == ("a", "1", STABLE, FALLBACK_BREAKER, True)
    assert shape(world.after(plan, "UNAVAILABLE")) == ("b", "1", STABLE, FALLBACK_BREAKER, False)


def test_retries_skip_every_upstream_tried_so_far() -> None:
    world = World({"a": {"m": {"1"}}, "b": {"m": {"1"}}, "c": {"m": {"1"}}})
    tried: list[Up] = []
    plan = world.first(STABLE_1)
    seen = [plan.upstream.address]
    for _ in range(5):  # bounded: a retry policy that forgot `tried` would go round for ever
        following = world.after(plan, "UNAVAILABLE", tried=tried)
        if following is None:
            break
        plan = following
        seen.append(plan.upstream.address)
    assert seen == ["a", "b", "c"]


def test_a_retry_for_a_version_nobody_serves_does_not_go_to_any_upstream() -> None:
    world = World(TWO_UPSTREAMS)
    plan = world.first(Decision("9", PINNED))  # a made-up pin: any upstream, no state
    assert (plan.upstream.address, plan.breaker) == ("a", None)
    assert world.after(plan, "UNAVAILABLE") is None


# --- reporting an attempt ------------------------------------------------------------------


def test_an_attempt_is_reported_once_and_a_gone_caller_only_frees_its_probe() -> None:
    world = World(TWO_VERSIONS)
    plan = world.first(STABLE_1)
    world.scope(plan).report("INTERNAL", "", 0.01)
    world.scope(plan).report("INTERNAL", "", 0.01)
    window = world.breakers.get("a", "m", "1").adaptive.window
    assert (len(window), window.faults) == (1, 1)

    world.open("a", "m", "2")
    world.now += 10  # the backoff is over: the next call is the one probe
    probe = world.first(PINNED_2)
    assert probe.permit is not None and probe.permit.probe
    assert world.breakers.get("a", "m", "2").allow() is None  # the probe slot is taken
    world.scope(probe).report("CANCELLED", "", None, gone=True)
    assert world.breakers.get("a", "m", "2").state is State.HALF_OPEN  # no verdict
    assert world.breakers.get("a", "m", "2").allow() is not None  # the slot is free again


# --- reading the request -------------------------------------------------------------------


def message(name: str = "", version: str = "") -> bytes:
    def text(number: int, value: str) -> bytes:
        raw = value.encode()
        return bytes([number << 3 | 2, len(raw)]) + raw

    return (text(1, name) if name else b"") + (text(2, version) if version else b"")


@pytest.mark.parametrize(
    ("body", "md", "expected"),
    [
        (message("m", "2"), (), ("m", "2")),
        (message("m"), (("x-model-version", "1"),), ("m", "1")),  # the header where the field is empty
        (message("m", "2"), (("x-model-version", "1"),), ("m", "2")),  # the field wins
        (b"", (("x-model-name", "m"),), ("m", "")),
        (message("bad name!"), (), "model_name"),
        (b"", (("x-model-name", "../etc"),), "x-model-name"),
        (message("m", "v 1"), (), "model_version"),
        (b"\x0a\xff", (), "not a valid message"),
    ],
)
def test_reading_the_model_and_pin(body: bytes, md: Metadata, expected: tuple[str, str] | str) -> None:
    pool = Pool(TWO_VERSIONS)
    if isinstance(expected, str):
        with pytest.raises(Refused) as refused:
            read.read(body, md, views(pool), read.Names(), True)
        assert (refused.value.code, refused.value.reason) == ("INVALID_ARGUMENT", "invalid_argument")
        assert expected in str(refused.value)
        assert refused.value.metadata == (("x-error-reason", "invalid_argument"),)
        return
    asked = read.read(body, md, views(pool), read.Names(), True)
    assert (asked.model, asked.pin, asked.view.known, asked.label) == (*expected, True, "m")


def test_reading_drops_what_the_sidecar_sets_itself_and_ignores_fields_of_unaddressed_calls() -> None:
    md: Metadata = (
        ("x-model-version", "1"),
        ("x-model-dye", "canary"),
        ("user-agent", "u"),
        ("te", "trailers"),
        ("content-type", "application/grpc"),
        (":authority", "x"),
        ("x-user-id", "u1"),
        ("bin-bin", b"\x00"),
    )
    asked = read.read(message("nobody"), md, views(Pool(TWO_VERSIONS)), read.Names(), False)
    assert (asked.model, asked.pin, asked.view.known, asked.label) == ("", "", False, OTHER)
    assert asked.forward == (("x-user-id", "u1"), ("bin-bin", b"\x00"))
    assert "bin-bin" not in asked.received and asked.received["x-user-id"] == "u1"
    unknown = read.read(message("nobody"), (), views(Pool(TWO_VERSIONS)), read.Names(), True)
    assert (unknown.model, unknown.view.known, unknown.label) == ("nobody", False, OTHER)


def test_a_call_that_is_not_dyed_goes_to_a_serving_upstream_else_any() -> None:
    pool = Pool({"a": {"other": {"1"}}, "b": {"m": {"1"}}})
    view = views(pool)
    plan = balance.unrouted_first(Asked("m", "", {}, (), view("m")), pool, True)
    assert (plan.upstream.address, plan.breaker, plan.dye, plan.label) == ("b", None, "", "m")
    plan = balance.unrouted_first(Asked("m", "", {}, (), view("m")), pool, False)
    assert plan.upstream.address == "a"
    plan = balance.unrouted_first(Asked("x", "", {}, (), view("x")), pool, True)
    assert (plan.upstream.address, plan.label) == ("a", OTHER)


def test_a_bad_weight_header_is_refused_and_a_good_one_decides() -> None:
    view = views(Pool(TWO_VERSIONS))

    def decided(body: bytes, md: Metadata) -> Route:
        breakers = Breakers(POLICY, lambda *a: None)
        return route.decide(read.read(body, md, view, read.Names(), True), breakers)

    with pytest.raises(Refused) as refused:
        decided(message("m"), (("x-canary-weight", "101"),))
    assert (refused.value.code, refused.value.reason) == ("INVALID_ARGUMENT", "invalid_argument")
    md = (("x-canary-weight", "100"), ("x-user-id", "u"))
    assert decision_of(decided(message("m"), md)) == CANARY_2
    assert decision_of(decided(message("m", "v2"), md)) == PINNED_2
    assert decision_of(decided(message("x"), md)) == Decision("", "")  # versions not known
    # A call that is not dyed is not decided (a bad weight header is no business of it).
    read.read(message("m"), (("x-canary-weight", "101"),), view, read.Names(), True)


def test_names_seen_valid_are_kept_bounded() -> None:
    names = read.Names()
    for n in range(read.VALID_NAMES_KEPT + 5):
        assert names.checked(f"m{n}", {}) == f"m{n}"
    assert len(names.valid) == read.VALID_NAMES_KEPT
    with pytest.raises(InvalidName):
        names.checked("bad name!", {})


# --- tenants and callers -------------------------------------------------------------------

TENANTS = {"acme": TenantLimit(concurrency=1), ANY_TENANT: TenantLimit(concurrency=5)}


@pytest.mark.parametrize(
    ("tenants", "received", "bucket"),
    [
        ({}, {"x-tenant-id": "acme"}, ""),  # no tenant configured: no bucket
        (TENANTS, {"x-tenant-id": "acme"}, "acme"),
        (TENANTS, {"x-tenant-id": "rotating-1"}, ANY_TENANT),
        (TENANTS, {"x-tenant-id": ANY_TENANT}, ANY_TENANT),
        (TENANTS, {}, ANY_TENANT),
    ],
)
def test_tenant_bucket(tenants: dict[str, TenantLimit], received: dict[str, str], bucket: str) -> None:
    assert read.tenant_bucket(tenants, received) == bucket


def test_the_caller_is_its_tenant_else_its_sticky_key_else_its_connection() -> None:
    key = read.caller_key
    assert key({"x-tenant-id": "t", "x-user-id": "u"}, "x-user-id", "p") == hash(("tenant", "t"))
    assert key({"x-user-id": "u"}, "x-user-id", "p") == hash(("user", "u"))
    assert key({"x-user-id": "u"}, "x-session", "p") == hash(("peer", "p"))


# --- shadowing -----------------------------------------------------------------------------


def test_the_shadow_target_is_the_canary_on_an_upstream_whose_breaker_would_allow() -> None:
    world = World(TWO_UPSTREAMS)
    stable = world.first(STABLE_1)
    target = balance.shadow_target(stable, world.table, world.pool, world.breakers)
    assert target is not None
    canary, upstream, md = target
    assert (canary, upstream.address) == ("2", "a")
    assert md == (("x-request-id", "r1"), ("x-model-version", "2"), ("x-model-dye", "shadow"))
    world.open("a", "m", "2")
    target = balance.shadow_target(stable, world.table, world.pool, world.breakers)
    assert target is not None and target[1].address == "b"
    world.open("b", "m", "2")
    assert balance.shadow_target(stable, world.table, world.pool, world.breakers) is None
    canary_plan = World(TWO_VERSIONS).first(CANARY_2)
    assert balance.shadow_target(canary_plan, world.table, world.pool, world.breakers) is None
    one_version = World({"a": {"m": {"1"}}})
    only = one_version.first(STABLE_1)
    assert balance.shadow_target(only, one_version.table, one_version.pool, one_version.breakers) is None


def test_the_body_gets_the_chosen_version_unless_it_names_one() -> None:
    plan = World(TWO_VERSIONS).first(CANARY_2)
    assert plan.body(message("m")) == message("m", "2")
    assert plan.body(message("m", "1")) == message("m", "1")
    assert plan.body(message("other")) == message("other")
    assert plan.body(b"\x0a\xff") == b"\x0a\xff"


def test_the_values_between_the_layers_are_frozen() -> None:
    world = World(TWO_VERSIONS)
    asked = world.request()
    attempt = world.first(CANARY_2)
    for value, name in ((asked, "model"), (attempt, "version"), (attempt, "permit")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, name, "x")
        with pytest.raises(dataclasses.FrozenInstanceError):
            delattr(value, name)
    assert (asked.model, attempt.version) == ("m", "2")
    with pytest.raises(AttributeError):
        routed_by(CANARY_2).version = "1"  # type: ignore[misc]  # a Route is a tuple
