"""When a breaker trips, and how it recovers: the adaptive policy, apart from any transport.

State machine (one instance per upstream x model x version):

    closed --(error rate, p99 latency, or a burst of consecutive faults)--> open
    open --(backoff elapsed; the next call asks)--> half-open
    half-open --(a run of good probes)--> closed        (backoff resets)
    half-open --(a probe fails or is slow)--> open      (backoff x factor, capped)

Closed: every call is recorded in a sliding window of `window_s` seconds (at most `max_samples`).
Once the window holds `min_calls`, it trips when the share of faults reaches `error_rate` (for a
canary-dyed call, which falls back to stable when it opens: `canary_error_rate`), or
when the window's p99 latency (of at least `latency_min_calls` timed calls) exceeds both
`latency_floor_s` and `latency_multiple` x the baseline. Whatever the window holds, it trips
on `consecutive_faults` faults in a row (the fast path: a dead upstream is cut off in a few
calls, not once its earlier successes have aged out of the window).
A canary is judged against stable (`Reference`: the stable version's calls over the same window,
given by breakers.py for canary-dyed calls): its fault share must reach `canary_error_rate`
*above* stable's; it trips on latency when its median exceeds `canary_latency_multiple` x stable's
median over the window (and `canary_latency_floor_s`, a few milliseconds: the limit scales with
stable, not with a fixed floor), once both hold `min_calls` timed calls, or when its p99 exceeds
`latency_multiple` x stable's p99 and `latency_floor_s` once both hold `latency_min_calls` (a tail
is judged as any version's: a fast model's p99 is mostly the scheduler's hiccups). So a canary slow
from its first call is cut off (its own baseline would learn the slowness as normal), and a fault
both versions see (a shared dependency) does not cut the canary off for a stable that fails as
much. Without enough stable calls, a canary is judged by its own baseline. A latency is what the
proxy reports: the service's own run time where the answer carries it (x-run-us), which another
version sharing the service cannot inflate, else the call's duration.
No single caller decides: each call is recorded with its caller (layers.read.caller_key: the tenant,
else the user's sticky key, else the connection), and a trip must also hold on the window without
the caller who contributes most to it (leave-one-out): without the caller with the most faults,
the others' calls must still have at least one fault and a fault share of `error_rate`; without
the caller with the most calls over the latency limit, the others' p99 (or median) must still
exceed it; at least half of a burst's `consecutive_faults`
must come from callers other than the burst's biggest. So one client's deadlines,
bad values or huge batches never open a breaker that then refuses everyone else, and a genuinely
broken version, which fails for everybody, still trips. (A caller counts as one however many
calls it makes; one that forges many identities is the business of authentication and tenant
limits.) Half-open, one caller's failing probes only free their slot for another probe; a failed
probe of a second caller re-opens (breakers.py).
The baseline is the p99 learned while healthy (a moving average, updated at most every
`latency_check_s`, from windows whose p99 is at most 1.5x the baseline).
Half-open lets `probes` calls through at a time, and closes after a run of good probes as long as
a version still failing at the share seen when it tripped would pass at most `probe_escape` of
the time: ceil(log(probe_escape) / log(1 - share)), at least `probes`, at most `probes_max` (a
30% failing canary needs 9 in a row; one dead from its first call, `probes`; one that died after
a healthy window, whose share is diluted by its earlier successes, up to `probes_max`).

Time comes from an injectable clock, so tests step it instead of sleeping.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from itertools import accumulate

Clock = Callable[[], float]
HEALTHY = 1.5  # a window's p99 up to this multiple of the baseline still teaches the baseline


class State(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


class Trip(StrEnum):
    ERROR_RATE = "error_rate"
    LATENCY = "latency"
    CONSECUTIVE = "consecutive_faults"
    PROBE_FAILED = "probe_failed"


@dataclass(frozen=True)
class BreakerPolicy:
    window_s: float = 10.0
    min_calls: int = 20
    latency_min_calls: int = 100  # a p99 of fewer samples is just their maximum: one hiccup
    error_rate: float = 0.5  # a version without fallback: its trip refuses calls, so only a heavy fault share
    canary_error_rate: float = 0.2  # over stable's share; measured: docs/sidecar.md "Breaker defaults"
    consecutive_faults: int = 5  # the fast path: faults in a row that trip whatever the window holds
    latency_multiple: float = 4.0  # a version judged by its own baseline (no stable to compare)
    latency_floor_s: float = 0.25  # ...whose p99 below this never trips, however small the baseline
    # A canary judged against stable: its median over this multiple of stable's median, and over
    # the floor, trips. Measured: docs/sidecar.md "Breaker defaults" (bench/breaker_defaults.py).
    canary_latency_multiple: float = 2.5
    canary_latency_floor_s: float = 0.001
    latency_check_s: float = 0.1
    backoff_s: float = 1.0
    backoff_factor: float = 2.0
    backoff_max_s: float = 30.0
    probes: int = 3  # probes in flight at once half-open, and the shortest run that closes
    probes_max: int = 20  # the longest run of good probes asked for
    probe_escape: float = 0.05  # the chance a version failing as when it tripped passes the run
    max_samples: int = 5000

    def __post_init__(self) -> None:
        if (
            min(
                self.min_calls,
                self.latency_min_calls,
                self.consecutive_faults,
                self.probes,
                self.max_samples,
            )
            < 1
            or self.window_s <= 0
        ):
            raise ValueError(
                "window_s, min_calls, latency_min_calls, consecutive_faults, probes and max_samples "
                "must be positive"
            )
        if self.probes_max < self.probes:
            raise ValueError("probes_max must be at least probes")
        if not 0 < self.probe_escape < 1:
            raise ValueError("probe_escape must be in (0, 1)")
        if not (0 < self.error_rate <= 1 and 0 < self.canary_error_rate <= 1):
            raise ValueError("error_rate and canary_error_rate must be in (0, 1]")
        if self.latency_multiple <= 1 or self.canary_latency_multiple <= 1 or self.backoff_factor < 1:
            raise ValueError(
                "latency_multiple and canary_latency_multiple must exceed 1 and backoff_factor be at least 1"
            )
        if self.latency_floor_s < 0 or self.canary_latency_floor_s < 0:
            raise ValueError("latency_floor_s and canary_latency_floor_s must not be negative")
        if not 0 < self.backoff_s <= self.backoff_max_s:
            raise ValueError("backoff_s must be positive and at most backoff_max_s")


# The window's latencies are counted in log-spaced buckets, each RATIO wide, from LOW up (below:
# the first bucket; above the last: the last): a percentile is its bucket's geometric middle, so
# within +-1% of the sample it stands for (sqrt(RATIO) - 1), from 10 us to over 15 minutes.
LOW = 1e-5
RATIO = 1.02
BUCKETS = 1024
# Where each bucket but the first starts: a latency's bucket is one bisect (C) among them, not a
# logarithm and its arithmetic in Python (this runs per call).
_EDGES: list[float] = [LOW * RATIO**i for i in range(1, BUCKETS)]
_MIDDLES: list[float] = [LOW * RATIO ** (i + 0.5) for i in range(BUCKETS)]


def bucket_of(latency: float) -> int:
    """The bucket a latency (s) is counted in: the first for LOW and below, the last for all
    beyond it."""
    return bisect_right(_EDGES, latency)


class Latencies:
    """Latencies as counts per bucket (bucket_of): O(1) to add or remove one; a percentile is
    a running sum over the buckets (C: itertools.accumulate) and a bisect, and how many are
    above a limit a sum over the buckets (both only when a trip is considered)."""

    __slots__ = ("counts", "total")

    def __init__(self, counts: list[int] | None = None) -> None:
        self.counts = counts if counts is not None else [0] * BUCKETS
        self.total = sum(self.counts)

    def __len__(self) -> int:
        return self.total

    def add(self, bucket: int) -> None:
        self.counts[bucket] += 1
        self.total += 1

    def remove(self, bucket: int) -> None:
        self.counts[bucket] -= 1
        self.total -= 1

    def clear(self) -> None:
        self.counts = [0] * BUCKETS
        self.total = 0

    def copy(self) -> Latencies:
        return Latencies(list(self.counts))

    @staticmethod
    def merged(parts: Iterable[Latencies]) -> Latencies:
        found = [part.counts for part in parts]
        return Latencies([sum(column) for column in zip(*found, strict=True)] if found else None)

    def ranked(self, rank: int) -> float:
        """The rank-th smallest latency (1-based), as its bucket's middle: the first bucket whose
        running count reaches it (beyond the count: the largest bucket, never asked)."""
        return _MIDDLES[min(BUCKETS - 1, bisect_left(list(accumulate(self.counts)), rank))]

    def above(self, limit: float) -> int:
        """How many are above `limit` (whose bucket's middle is)."""
        first = bisect_right(_MIDDLES, limit)
        return sum(self.counts[first:])


def p99(latencies: Latencies) -> float:
    """The nearest-rank p99 (as the sorted list's index ceil(0.99 n) - 1 gave it)."""
    n = latencies.total
    return latencies.ranked(min(n, math.ceil(0.99 * n)))


def p50(latencies: Latencies) -> float:
    """The lower median (the sorted list's index (n - 1) // 2)."""
    return latencies.ranked((latencies.total - 1) // 2 + 1)


Caller = int | None  # a hash of the caller's identity; None: unknown (counted as nobody's)


class Window:
    """Calls of the last `window_s` seconds: (time, fault, latency bucket or -1, caller). Running
    counts (in total and per caller) and the latencies' histogram (Latencies) keep recording O(1)
    and a call's leaving the window O(1); the leave-one-out checks are computed only when a trip
    is considered."""

    def __init__(self, policy: BreakerPolicy) -> None:
        self.policy = policy
        self._calls: deque[tuple[float, bool, int, Caller]] = deque()
        self.latencies = Latencies()  # the window's latencies, bucketed
        self.faults = 0
        self._callers: dict[int, list[int]] = {}  # caller -> [calls, faults] in the window

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, now: float, fault: bool, latency: float | None, caller: Caller = None) -> int:
        """Record one call; returns how many calls the window holds (after its trim)."""
        bucket = -1
        if latency is not None:
            # bucket_of and Latencies.add, inline: this runs per call
            bucket = bisect_right(_EDGES, latency)
            latencies = self.latencies
            latencies.counts[bucket] += 1
            latencies.total += 1
        calls = self._calls
        calls.append((now, fault, bucket, caller))
        if fault:
            self.faults += 1
        if caller is not None:
            counts = self._callers.get(caller)
            if counts is None:
                counts = self._callers[caller] = [0, 0]
            counts[0] += 1
            counts[1] += fault
        policy = self.policy
        if calls[0][0] < now - policy.window_s or len(calls) > policy.max_samples:
            self.trim(now)
        return len(calls)

    def trim(self, now: float) -> None:
        horizon = now - self.policy.window_s
        calls = self._calls
        while calls and (calls[0][0] < horizon or len(calls) > self.policy.max_samples):
            _, fault, bucket, caller = calls.popleft()
            self.faults -= fault
            if bucket >= 0:
                self.latencies.remove(bucket)
            if caller is not None:
                counts = self._callers[caller]
                counts[0] -= 1
                counts[1] -= fault
                if not counts[0]:
                    del self._callers[caller]

    @property
    def callers(self) -> int:
        return len(self._callers)

    def faulty_without_top_caller(self, error_rate: float) -> bool:
        """Whether the fault share reaches `error_rate` without the caller with the most faults
        (and at least one fault remains)."""
        top_calls = top_faults = 0
        for calls, faults in self._callers.values():
            if faults > top_faults:
                top_calls, top_faults = calls, faults
        calls, faults = len(self._calls) - top_calls, self.faults - top_faults
        return faults >= 1 and faults >= error_rate * calls

    def latencies_without_top_caller(self, limit: float) -> Latencies:
        """The latencies without the calls of the caller with the most calls over `limit`."""
        first_over = bisect_right(_MIDDLES, limit)  # the buckets over the limit (Latencies.above)
        slow: dict[int, int] = {}
        for _, _, bucket, caller in self._calls:
            if caller is not None and bucket >= first_over:
                slow[caller] = slow.get(caller, 0) + 1
        top = max(slow, key=slow.__getitem__, default=None)
        others = self.latencies.copy()
        if top is not None:
            for _, _, bucket, caller in self._calls:
                if caller == top and bucket >= 0:
                    others.remove(bucket)
        return others

    def clear(self) -> None:
        self._calls.clear()
        self.latencies.clear()
        self._callers.clear()
        self.faults = 0


class Reference:
    """The stable version's calls over the canary's window (its breakers' windows, trimmed to now):
    what a canary is judged against. Found (`find`) and trimmed only when a check asks, not for
    every canary-dyed call recorded."""

    def __init__(self, find: Callable[[], Iterable[Window]], clock: Clock) -> None:
        self._find = find
        self._clock = clock
        self._found: list[Window] | None = None

    @property
    def _windows(self) -> list[Window]:
        if self._found is None:
            now = self._clock()
            self._found = list(self._find())
            for window in self._found:
                window.trim(now)
        return self._found

    @property
    def calls(self) -> int:
        return sum(len(w) for w in self._windows)

    @property
    def faults(self) -> int:
        return sum(w.faults for w in self._windows)

    def fault_share(self, min_calls: int) -> float:
        """Stable's share of faults; 0 for fewer than `min_calls` calls (too few to say)."""
        calls = self.calls
        return self.faults / calls if calls >= min_calls else 0.0

    def latencies(self) -> Latencies:
        """Stable's latencies over the window (one window's own: read only)."""
        if len(self._windows) == 1:
            return self._windows[0].latencies
        return Latencies.merged(w.latencies for w in self._windows)


class AdaptivePolicy:
    """The decisions of one breaker; the caller applies them (breakers.py)."""

    def __init__(self, policy: BreakerPolicy, clock: Clock = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        self.window = Window(policy)
        self.baseline: float | None = None  # learned p99 while healthy
        self.reference_limit: float | None = None  # the latency limit last judged against stable
        self._last_check = -math.inf
        self.trips = 0  # consecutive trips without recovery: the backoff's exponent
        self.opened_at = 0.0
        self.reason: Trip | None = None
        self.seen = 1.0  # the share of bad calls when it last tripped: sets the probe run
        self._share = 1.0  # the share behind the trip `record` just returned
        self._burst = 0  # faults in a row, and whose (the leave-one-out of the fast path)
        self._burst_callers: dict[int, int] = {}

    def now(self) -> float:
        return self._clock()

    @property
    def backoff_s(self) -> float:
        p = self.policy
        return min(p.backoff_max_s, p.backoff_s * p.backoff_factor ** max(0, self.trips - 1))

    @property
    def run(self) -> int:
        """Good probes in a row that close it: a version still failing at the share seen when it
        tripped passes that many with at most `probe_escape` chance."""
        p = self.policy
        if self.seen >= 1:
            return p.probes
        if self.seen <= 0:
            return p.probes_max
        need = math.ceil(math.log(p.probe_escape) / math.log(1 - self.seen))
        return max(p.probes, min(p.probes_max, need))

    def latency_limit(self) -> float | None:
        if self.reference_limit is not None:
            return self.reference_limit
        if self.baseline is None:
            return None
        return max(self.policy.latency_floor_s, self.policy.latency_multiple * self.baseline)

    def record(
        self,
        fault: bool,
        latency: float | None,
        caller: Caller = None,
        lone_trips: bool = False,
        reference: Reference | None = None,
    ) -> Trip | None:
        """A call that ended while closed; returns why to open, or None. `lone_trips`: the version
        has a fallback (a canary: its callers get stable when it opens), so when every call of
        the window came from one caller, that caller's faults may open it: nobody else is refused,
        and a client that is the only caller (one process, or the gateway's one connection) is
        still protected from a failing canary. Without a fallback the rule must hold without the
        top caller (leave-one-out), so one caller never takes a version from everyone.
        `reference`: stable's calls over the same window, for a canary-dyed call."""
        now = self._clock()
        window = self.window
        calls = window.add(now, fault, latency, caller)
        lone = lone_trips and window.callers <= 1
        # A success after a success has no burst to end: no call (this runs per call).
        if (fault or self._burst) and self._burst_over(fault, caller, lone):
            # The window's share (the burst included), not 1: a canary failing 30% bursts too,
            # and 3 good probes would let it flap back.
            self._share = window.faults / calls
            return Trip.CONSECUTIVE
        policy = self.policy
        if calls < policy.min_calls:
            return None
        # A canary-dyed call (its callers get stable when it opens): `canary_error_rate` over
        # stable's share; a version without fallback (its trip refuses calls): `error_rate`.
        rate = policy.canary_error_rate if lone_trips else policy.error_rate
        faults = window.faults
        if faults >= rate * calls:
            if reference is not None:
                rate = min(1.0, rate + reference.fault_share(policy.min_calls))
            if faults >= rate * calls and (lone or window.faulty_without_top_caller(rate)):
                self._share = faults / calls
                return Trip.ERROR_RATE
        if latency is not None and now - self._last_check >= policy.latency_check_s:
            self._last_check = now
            return self._check_latency(lone, reference)
        return None

    def _burst_over(self, fault: bool, caller: Caller, lone: bool) -> bool:
        """Whether this call ends a burst of `consecutive_faults` faults in a row that trips:
        one caller's alone (its own bad values) does not, unless it is a canary's lone caller."""
        if not fault:
            self._burst = 0
            self._burst_callers.clear()
            return False
        self._burst += 1
        if caller is not None:
            self._burst_callers[caller] = self._burst_callers.get(caller, 0) + 1
        need = self.policy.consecutive_faults
        if self._burst < need:
            return False
        others = self._burst - max(self._burst_callers.values(), default=0)
        return lone or others >= math.ceil(need / 2)

    def _check_latency(self, lone: bool = False, reference: Reference | None = None) -> Trip | None:
        latencies = self.window.latencies
        p = self.policy
        stable = reference.latencies() if reference is not None else None
        if stable is not None and min(len(stable), len(latencies)) >= p.min_calls:
            # A canary, judged against stable over the same window. Most of its calls: its median
            # over `canary_latency_multiple` x stable's and `canary_latency_floor_s` (a few ms: the
            # limit scales with stable); a hiccup cannot move a median, a canary slow on most
            # calls does, from `min_calls` calls on. Its tail, once both hold `latency_min_calls`:
            # its p99 over `latency_multiple` x stable's and `latency_floor_s`, as any version's
            # (a fast model's p99 is the scheduler's hiccups: measured, docs/sidecar.md).
            limit = max(p.canary_latency_floor_s, p.canary_latency_multiple * p50(stable))
            self.reference_limit = limit
            trip = self._latency_trip(latencies, p50, p.min_calls, limit, lone)
            if trip is None and min(len(stable), len(latencies)) >= p.latency_min_calls:
                tail = max(p.latency_floor_s, p.latency_multiple * p99(stable))
                trip = self._latency_trip(latencies, p99, p.latency_min_calls, tail, lone)
            return trip
        if len(latencies) < p.latency_min_calls:
            return None
        observed = p99(latencies)  # once: a walk over the histogram
        own = self._own_limit()
        if own is not None and observed > own:
            return self._latency_trip(latencies, p99, p.latency_min_calls, own, lone, observed)
        # Learn slowly, and only from windows that look healthy (at most HEALTHY x the baseline;
        # faster is always learned), so that a slide towards slow cannot drag the baseline along.
        base = self.baseline
        if base is None:
            self.baseline = observed
        elif observed <= HEALTHY * base:
            self.baseline = base + 0.2 * (observed - base)
        return None

    def _latency_trip(
        self,
        latencies: Latencies,
        stat: Callable[[Latencies], float],
        need: int,
        limit: float,
        lone: bool,
        value: float | None = None,
    ) -> Trip | None:
        """LATENCY when `stat` of the window's latencies (`value`, when computed already) exceeds
        `limit`, and still does without the caller with the most calls over it (unless `lone`)."""
        if (stat(latencies) if value is None else value) <= limit:
            return None
        if not lone:
            others = self.window.latencies_without_top_caller(limit)
            if len(others) < need or stat(others) <= limit:
                return None  # slow for one caller only (its own huge batches): not the version's
        self._share = latencies.above(limit) / len(latencies)
        return Trip.LATENCY

    def _own_limit(self) -> float | None:
        if self.baseline is None:
            return None
        return max(self.policy.latency_floor_s, self.policy.latency_multiple * self.baseline)

    def probe_failed(self, fault: bool, latency: float | None) -> bool:
        limit = self.latency_limit()
        return fault or (latency is not None and limit is not None and latency > limit)

    def opened(self, reason: Trip) -> None:
        self.trips += 1
        self.opened_at = self._clock()
        self.reason = reason
        if reason is not Trip.PROBE_FAILED:  # a failed probe says nothing new about the share
            self.seen = self._share
        self.window.clear()
        self._burst = 0
        self._burst_callers.clear()

    def closed(self) -> None:
        self.trips = 0
        self.reason = None
        self.window.clear()
        self._burst = 0
        self._burst_callers.clear()

    def reachable(self) -> None:
        """The upstream answers again (its health came back): the backoff that grew while it was
        down starts over, so recovery does not wait out a doubled backoff."""
        self.trips = min(self.trips, 1)

    def backoff_over(self) -> bool:
        return self._clock() - self.opened_at >= self.backoff_s
