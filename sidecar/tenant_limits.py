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
    # The limit's figures are copied here (the limit is a plain dataclass: each read of one of
    # its fields is a dict look-up, and the capacity a computation, per call).
    __slots__ = ("capacity", "concurrency", "in_flight", "limit", "rate", "stamp", "tokens")

    def __init__(self, limit: TenantLimit, now: float) -> None:
        self.in_flight = 0
        self.tokens = 0.0
        self.stamp = now
        self.limit = limit
        self.set(limit)
        self.tokens = self.capacity

    def set(self, limit: TenantLimit) -> None:
        """Apply `limit` (a new table's): the tokens held are capped by its capacity."""
        self.limit = limit
        self.capacity = limit.burst or max(1.0, limit.rate)
        self.rate = limit.rate
        self.concurrency = limit.concurrency
        self.tokens = min(self.tokens, self.capacity)


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
        limit = limits.get(tenant)
        if limit is None:
            tenant = ANY_TENANT
            limit = limits.get(tenant)
            if limit is None:
                return None
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = _Bucket(limit, self._clock())
        elif bucket.limit is not limit and bucket.limit != limit:  # changed
            bucket.set(limit)
        if bucket.concurrency and bucket.in_flight >= bucket.concurrency:
            return Refusal(f"{_who(tenant)}: {limit.concurrency} calls in flight (the limit)", 0.05)
        rate = bucket.rate
        if rate:
            now = self._clock()
            tokens = bucket.tokens + (now - bucket.stamp) * rate
            if tokens > bucket.capacity:
                tokens = bucket.capacity
            bucket.stamp = now
            if tokens < 1.0:
                bucket.tokens = tokens
                wait = (1.0 - tokens) / rate
                return Refusal(f"{_who(tenant)}: over the rate limit of {rate:g}/s", wait)
            bucket.tokens = tokens - 1.0
        bucket.in_flight += 1
        return None

    def release(self, tenant: str) -> None:
        bucket = self._buckets.get(tenant) or self._buckets.get(ANY_TENANT)
        if bucket is not None and bucket.in_flight > 0:
            bucket.in_flight -= 1


def _who(tenant: str) -> str:
    return f"tenant {echo(tenant)}" if tenant != ANY_TENANT else "tenants without their own limit ('*')"
