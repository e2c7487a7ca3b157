"""The breakers' latency histogram: percentiles within the stated bucket error, O(1) windows; and
what a latency is (the service's x-run-us where the answer carries it)."""

from __future__ import annotations

import math
import random

import pytest

from modelyard.sidecar import forward
from modelyard.sidecar.breaker_policy import RATIO, BreakerPolicy, Latencies, Window, bucket_of, p50, p99

ERROR = math.sqrt(RATIO) - 1  # docs/sidecar.md: a percentile within +-1% of its sample


def _sorted_p99(ordered: list[float]) -> float:
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def test_percentiles_are_within_a_buckets_error_of_the_samples_they_stand_for() -> None:
    rng = random.Random(7)
    for n in (1, 7, 100, 101, 5000):
        samples = [rng.lognormvariate(math.log(0.02), 1.5) for _ in range(n)]
        latencies = Latencies()
        for sample in samples:
            latencies.add(bucket_of(sample))
        ordered = sorted(samples)
        assert len(latencies) == n
        assert abs(p99(latencies) / _sorted_p99(ordered) - 1) <= ERROR
        assert abs(p50(latencies) / ordered[(n - 1) // 2] - 1) <= ERROR
        limit = ordered[n // 2]
        over = sum(1 for s in samples if s > limit)
        # Only samples sharing the limit's bucket may be counted on the other side of it.
        same_bucket = sum(1 for s in samples if bucket_of(s) == bucket_of(limit))
        assert abs(latencies.above(limit) - over) <= same_bucket


def test_latencies_outside_the_range_are_counted_at_its_ends() -> None:
    latencies = Latencies()
    for sample in (0.0, 1e-9, 1e6):
        latencies.add(bucket_of(sample))
    assert p50(latencies) < 2e-5 and p99(latencies) > 900


def test_a_call_leaving_the_window_leaves_its_latency_and_callers_too() -> None:
    window = Window(BreakerPolicy(window_s=10, max_samples=3))
    window.add(0.0, False, 5.0, caller=1)  # slow, first out
    for t in (1.0, 2.0):
        window.add(t, False, 0.01, caller=2)
    assert p99(window.latencies) > 4.9 and window.callers == 2
    window.add(3.0, True, None, caller=2)  # no latency: max_samples pushes the slow one out
    assert len(window) == 3 and len(window.latencies) == 2 and window.callers == 1
    assert p99(window.latencies) < 0.0102 and window.faults == 1
    window.add(20.0, False, 0.02)  # the rest is older than window_s
    assert len(window) == 1 and len(window.latencies) == 1 and window.faults == 0
    assert window.callers == 0


def test_the_top_slow_caller_is_left_out() -> None:
    window = Window(BreakerPolicy())
    for i in range(10):
        window.add(float(i), False, 1.0, caller=1)
        window.add(float(i), False, 0.01, caller=2)
    window.add(10.0, False, 2.0, caller=3)
    others = window.latencies_without_top_caller(0.5)
    assert len(others) == 11 and p99(others) > 1.9 and p50(others) < 0.0102
    assert len(window.latencies) == 21  # the window's own is unchanged
    merged = Latencies.merged([window.latencies, others])
    assert len(merged) == 32 and merged.above(0.5) == 10 + 1 + 1


@pytest.mark.parametrize(
    ("trailing", "seconds"),
    [
        ((("x-served-version", "1"), ("x-queue-us", "9000"), ("x-run-us", "1500")), 0.0015),  # run only
        ((("x-run-us", "0"),), 0.0),
        ((("x-served-version", "1"),), None),  # an older service: the call's duration instead
        (None, None),
        ((("x-run-us", "soon"),), None),  # unreadable: the duration
        ((("x-run-us", "-5"),), None),
    ],
)
def test_a_latency_is_the_services_run_time_where_the_answer_carries_it(
    trailing: tuple[tuple[str, str], ...] | None, seconds: float | None
) -> None:
    assert forward.run_seconds(trailing) == seconds
