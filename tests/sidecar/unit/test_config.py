"""Sidecar settings, upstream labels, the route file and tenant buckets (clock stepped by hand)."""

from __future__ import annotations

import pytest

from modelyard.sidecar.dyeing import ModelRoute
from modelyard.sidecar.routes.route_table import ConfigError, parse_table
from modelyard.sidecar.settings import parse_settings
from modelyard.sidecar.tenant_limits import TenantLimit, TenantLimits
from modelyard.sidecar.upstreams import UpstreamSpec


def test_settings_from_flags_and_environment() -> None:
    settings = parse_settings([], {"MODELYARD_SIDECAR_UPSTREAM": "a:1, b:2@2"})
    assert settings.upstream == ("a:1", "b:2@2") and settings.listen == "127.0.0.1:50051"
    settings = parse_settings(
        ["--upstream", "c:3", "--upstream", "d:4"], {"MODELYARD_SIDECAR_UPSTREAM": "a:1"}
    )
    assert settings.upstream == ("c:3", "d:4")
    assert parse_settings([], {}).upstream == ("127.0.0.1:50052",)


def test_upstream_labels() -> None:
    assert UpstreamSpec.parse("10.0.0.7:50052") == UpstreamSpec("10.0.0.7:50052", None)
    assert UpstreamSpec.parse("h:1@2") == UpstreamSpec("h:1", frozenset({"2"}))
    assert UpstreamSpec.parse("h:1@v1+2") == UpstreamSpec("h:1", frozenset({"1", "2"}))
    with pytest.raises(ValueError, match="HOST:PORT"):
        UpstreamSpec.parse("nohost")
    for bad in ("h:0", "h:65536", ":1", "h:1@", "h:1@1+", "h:1@../x", "h:1@a b"):
        with pytest.raises(ValueError, match="upstream"):
            UpstreamSpec.parse(bad)


def test_route_file() -> None:
    table = parse_table(
        {
            "canary_weight": 5,
            "stickiness_header": "X-Session",
            "models": {"a": {"canary_weight": 50, "stable": "v1", "canary": 2}, "b": {}},
            "breaker": {"min_calls": 3, "error_rate": 0.25},
            "tenants": {"acme": {"rate": 2, "burst": 4}},
        }
    )
    assert table.route("a") == ModelRoute(50.0, "1", "2")
    assert (table.route("a").cohort, table.route("other").cohort) == ("a", "other")  # salted per model
    shared = parse_table({"sticky_cohort": "shared", "models": {"a": {}}})
    assert (shared.route("a").cohort, shared.route("other").cohort) == ("", "")
    assert table.route("b") == ModelRoute(5.0) and table.route("other") == ModelRoute(5.0)
    assert table.stickiness_header == "x-session"
    assert (table.breaker.min_calls, table.breaker.error_rate) == (3, 0.25)
    assert table.tenants["acme"] == TenantLimit(rate=2.0, burst=4.0)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"modles": {}}, r"config: unknown key\(s\) modles \(expected one of stickiness_header, "),
        ({"models": {"a": {"canary_weight": 150}}}, "models.a.canary_weight"),
        ({"models": {"a": {"weight": 1}}}, r"models.a: unknown key\(s\) weight"),
        ({"breaker": {"error_rate": 2}}, "breaker"),
        ({"breaker": {"min_calls": "many"}}, "breaker.min_calls"),
        ({"tenants": {"t": {"rate": -1}}}, "tenants.t"),
        ([1, 2], "expected a mapping"),
    ],
)
def test_route_file_mistakes_name_the_key(doc: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_table(doc)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_and_concurrency() -> None:
    clock = Clock()
    limits = TenantLimits(clock)
    table = {"acme": TenantLimit(rate=2, burst=2), "*": TenantLimit(concurrency=1)}
    assert limits.acquire("acme", table) is None
    assert limits.acquire("acme", table) is None
    refusal = limits.acquire("acme", table)
    assert refusal is not None and refusal.retry_after_s == pytest.approx(0.5)
    clock.now += 0.5  # one token back
    assert limits.acquire("acme", table) is None
    assert limits.acquire("acme", table) is not None
    # Any other tenant: one call at a time.
    assert limits.acquire("zed", table) is None
    assert limits.acquire("zed", table) is not None
    limits.release("zed")
    assert limits.acquire("zed", table) is None
    assert limits.acquire("free", {}) is None
