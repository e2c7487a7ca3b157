"""Tenant limits hold state only for configured tenants plus one shared bucket for all others."""

from __future__ import annotations

from modelyard.sidecar.tenant_limits import ANY_TENANT, TenantLimit, TenantLimits


def test_unconfigured_tenants_share_one_bucket_and_one_limit() -> None:
    limits = TenantLimits(clock=lambda: 0.0)
    table = {"acme": TenantLimit(rate=10, burst=10), ANY_TENANT: TenantLimit(rate=1, burst=1)}
    assert limits.acquire("acme", table) is None
    assert limits.acquire("tenant-0", table) is None
    for i in range(1, 1000):  # rotating ids buy nothing: the `*` bucket is empty
        refusal = limits.acquire(f"tenant-{i}", table)
        assert refusal is not None and "'*'" in refusal.message
    assert len(limits) == 2


def test_buckets_of_tenants_no_longer_configured_are_dropped_once_idle() -> None:
    limits = TenantLimits(clock=lambda: 0.0)
    old = {"acme": TenantLimit(concurrency=2), "beta": TenantLimit(concurrency=2)}
    assert limits.acquire("acme", old) is None and limits.acquire("beta", old) is None
    limits.release("beta")
    new = {"acme": TenantLimit(concurrency=2)}
    assert limits.acquire("acme", new) is None
    assert len(limits) == 1  # beta was idle; acme stays
    limits.release("acme")
    limits.release("acme")


def test_a_long_tenant_id_is_echoed_capped() -> None:
    limits = TenantLimits(clock=lambda: 0.0)
    table = {"x" * 5000: TenantLimit(concurrency=1)}
    assert limits.acquire("x" * 5000, table) is None
    refusal = limits.acquire("x" * 5000, table)
    assert refusal is not None and len(refusal.message) < 300


def test_a_changed_limit_applies_to_its_tenants_bucket_at_once() -> None:
    now = [0.0]
    limits = TenantLimits(clock=lambda: now[0])
    before = {"acme": TenantLimit(rate=100, burst=100, concurrency=1)}
    assert limits.acquire("acme", before) is None
    assert limits.acquire("acme", before) is not None  # one in flight: the limit
    # A reloaded table: two in flight, and a bucket of 2 (the 99 tokens held are capped to it).
    after = {"acme": TenantLimit(rate=1, burst=2, concurrency=2)}
    assert limits.acquire("acme", after) is None
    limits.release("acme")
    limits.release("acme")
    assert limits.acquire("acme", after) is None
    refusal = limits.acquire("acme", after)  # the capped bucket is empty; 1 token a second
    assert refusal is not None and "1/s" in refusal.message and refusal.retry_after_s == 1.0
    now[0] += 1.0
    assert limits.acquire("acme", after) is None
