"""Per-tenant limits (the `x-tenant-id` header): a token bucket (rate, burst) and a cap on
concurrent calls. A call beyond them is refused with RESOURCE_EXHAUSTED and a retry hint.

Buckets exist only for configured tenants, plus one, `*`, shared by every other tenant (the proxy
passes `*` for them): a client rotating tenant ids gets no bucket of its own. Buckets of tenants
no longer configured are dropped once idle."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from modelyard.common.names import echo

ANY_TENANT = "*"


@dataclass(frozen=True)
class TenantLimit:
    rate: float = 0.0  # calls per second; 0 = no rate limit
    burst: float = 0.0  # bucket size; 0 = max(1, rate)
    concurrency: int = 0  # calls in flight; 0 = no limit

    def __post_init__(self) -> None:
        if self.rate < 0 or self.burst < 0 or self.concurrency < 0:
            raise ValueError("rate, burst and concurrency must not be negative")


@dataclass(frozen=True, slots=True)
class Refusal:
    message: str
    retry_after_s: float


class _Bucket:
    __slots__ = ("in_flight", "limit", "stamp", "tokens")

    def __init__(self, limit: TenantLimit, now: float) -> None:
        self.limit = limit
        self.tokens = self.capacity
        self.stamp = now
        self.in_flight = 0

    @property
    def capacity(self) -> float:
        return self.limit.burst or max(1.0, self.limit.rate)


class TenantLimits:
    """Admission per tenant. `acquire` before the call, `release` after it (when it was admitted)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._limits: Mapping[str, TenantLimit] | None = None

    def __len__(self) -> int:
        return len(self._buckets)

    def acquire(self, tenant: str, limits: Mapping[str, TenantLimit]) -> Refusal | None:
        if limits is not self._limits:  # a new table: forget idle buckets it no longer names
            self._limits = limits
            for name in [n for n, b in self._buckets.items() if n not in limits and not b.in_flight]:
                del self._buckets[name]
        if tenant not in limits:
            tenant = ANY_TENANT
        limit = limits.get(tenant)
        if limit is None:
            return None
        now = self._clock()
        bucket = self._buckets.get(tenant)
        if bucket is None or (bucket.limit is not limit and bucket.limit != limit):  # new, or changed
            bucket = self._buckets[tenant] = _Bucket(limit, now) if bucket is None else bucket
            bucket.limit = limit
            bucket.tokens = min(bucket.tokens, bucket.capacity)
        if limit.concurrency and bucket.in_flight >= limit.concurrency:
            return Refusal(f"{_who(tenant)}: {limit.concurrency} calls in flight (the limit)", 0.05)
        if limit.rate:
            bucket.tokens = min(bucket.capacity, bucket.tokens + (now - bucket.stamp) * limit.rate)
            bucket.stamp = now
            if bucket.tokens < 1.0:
                wait = (1.0 - bucket.tokens) / limit.rate
                return Refusal(f"{_who(tenant)}: over the rate limit of {limit.rate:g}/s", wait)
            bucket.tokens -= 1.0
        bucket.in_flight += 1
        return None

    def release(self, tenant: str) -> None:
        bucket = self._buckets.get(tenant) or self._buckets.get(ANY_TENANT)
        if bucket is not None and bucket.in_flight > 0:
            bucket.in_flight -= 1


def _who(tenant: str) -> str:
    return f"tenant {echo(tenant)}" if tenant != ANY_TENANT else "tenants without their own limit ('*')"
