"""Circuit breakers, one per upstream x model x version, on `pybreaker` wrapped for asyncio.

pybreaker keeps the state (in its pluggable storage) and tells listeners about transitions;
its own `call` can't guard a coroutine (it counts the un-awaited coroutine as a success and
holds a thread lock across the call). So the proxy asks `allow()` before the call and reports
the outcome with `report()` when the call (or stream) has ended; the decisions (when to trip,
backoff, probes) come from breaker_policy.py. Everything runs on the event loop thread.

A canary-dyed call's outcome is judged against stable: `report(..., stable=VERSION)` hands the
policy the stable version's calls over the same window (breaker_policy.Reference, from every
breaker of that model and version). While every breaker of a canary version is open (its backoff
running), the canary's effective weight is 0 (`Breakers.shut`, read by the route layer:
layers/route.py); `Breakers.is_open` answers "is this model's canary breaker open?" for whoever
acts on it (a rollout).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pybreaker

from modelyard.sidecar.breaker_policy import (
    AdaptivePolicy,
    BreakerPolicy,
    Caller,
    Clock,
    Reference,
    State,
    Trip,
    Window,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BreakerKey:
    upstream: str
    model: str
    version: str


@dataclass(frozen=True, slots=True)
class Permit:
    """Leave to make one call; hand it back with the outcome."""

    generation: int  # the breaker's state generation when allowed; a stale report is ignored
    probe: bool


# key, old state, new state, why (the trip reason on opening, else empty)
OnChange = Callable[[BreakerKey, State, State, str], None]
# key, fault, latency: every outcome reported (the rollouts' gates read them: rollout/driver.py)
Observe = Callable[[BreakerKey, bool, float | None], None]
# (model, version) -> the windows of that version's breakers (a canary's reference)
Windows = Callable[[str, str], list[Window]]


class _Listener(pybreaker.CircuitBreakerListener):
    def __init__(self, breaker: Breaker) -> None:
        self._breaker = breaker

    def state_change(self, cb: Any, old_state: Any, new_state: Any) -> None:
        if old_state is None or old_state.name == new_state.name:
            return
        self._breaker.changed(State(old_state.name), State(new_state.name))


class Breaker:
    def __init__(
        self,
        key: BreakerKey,
        policy: BreakerPolicy,
        clock: Clock,
        on_change: OnChange,
        windows: Windows | None = None,  # Breakers: where a canary finds stable's calls
    ) -> None:
        self.key = key
        self.adaptive = AdaptivePolicy(policy, clock)
        self._on_change = on_change
        self._windows = windows
        self._cb = pybreaker.CircuitBreaker(
            fail_max=2**31 - 1,  # never trips by pybreaker's own count; breaker_policy.py decides
            reset_timeout=policy.backoff_s,
            name=f"{key.upstream}/{key.model}/{key.version}",
            listeners=[_Listener(self)],
        )
        # pybreaker's state as of the last transition (only _transition changes it): read per call
        # here rather than through its two properties and its storage.
        self._current: str = self._cb.current_state
        self._generation = 0
        self._closed_permit = Permit(0, False)  # every closed call's, until the state changes
        self._changes: list[tuple[State, State]] = []  # told after the transition (_transition)
        self._probes_in_flight = 0
        self._probe_successes = 0
        self._probe_failers: set[Caller] = set()  # callers whose probes failed, this half-open
        self.observe: Observe | None = None

    @property
    def state(self) -> State:
        return State(self._current)

    @property
    def shut(self) -> bool:
        """Open with its backoff still running: no call would be let through, not even a probe."""
        return self._current == pybreaker.STATE_OPEN and not self.adaptive.backoff_over()

    def would_allow(self) -> bool:
        """Whether `allow` would let a call through now, without taking a probe slot."""
        state = self._current
        if state == pybreaker.STATE_CLOSED:
            return True
        if state == pybreaker.STATE_OPEN:
            return self.adaptive.backoff_over()
        return self._probe_slot()

    def _probe_slot(self) -> bool:
        """Half-open: `probes` at a time, and no more than the run still needs."""
        in_flight, policy = self._probes_in_flight, self.adaptive
        return in_flight < policy.policy.probes and in_flight + self._probe_successes < policy.run

    def allow(self) -> Permit | None:
        state = self._current
        if state == pybreaker.STATE_CLOSED:
            return self._closed_permit
        if state == pybreaker.STATE_OPEN:
            if not self.adaptive.backoff_over():
                return None
            self._transition(self._cb.half_open)
        if not self._probe_slot():
            return None
        self._probes_in_flight += 1
        return Permit(self._generation, True)

    def report(
        self,
        permit: Permit,
        fault: bool,
        latency: float | None,
        caller: Caller = None,
        lone_trips: bool = False,
        stable: str = "",
    ) -> None:
        """The outcome of an allowed call: `fault` counts against the upstream; `latency` (s) is
        given for calls whose duration means something (unary), else None; `caller` is who made
        it (breaker_policy.py: no single caller trips a breaker); `lone_trips`: the version has a
        fallback, so a lone caller's faults may open it (AdaptivePolicy.record); `stable`: the
        stable version a canary-dyed call is judged against (empty: none)."""
        if self.observe is not None:
            self.observe(self.key, fault, latency)
        if permit.generation != self._generation:
            return  # the state changed while the call ran; its outcome belongs to the past
        if permit.probe:
            self._probes_in_flight -= 1
            if self.adaptive.probe_failed(fault, latency):
                # One caller's failing probes alone (its own bad values) do not re-open: its slot
                # is freed for another probe; failures from a second caller do.
                self._probe_failers.add(caller)
                if caller is None or lone_trips or len(self._probe_failers) >= 2:
                    self._open(Trip.PROBE_FAILED)
                return
            self._probe_successes += 1
            if self._probe_successes >= self.adaptive.run:
                self.adaptive.closed()
                self._transition(self._cb.close)
            return
        reference = None
        if stable and stable != self.key.version and self._windows is not None:
            reference = Reference(functools.partial(self._windows, self.key.model, stable), self.adaptive.now)
        trip = self.adaptive.record(fault, latency, caller, lone_trips, reference)
        if trip is not None:
            self._open(trip)

    def reachable(self) -> None:
        """Its upstream is reachable again: the backoff starts over (AdaptivePolicy.reachable)."""
        self.adaptive.reachable()
        self._cb._reset_timeout = self.adaptive.backoff_s

    def release(self, permit: Permit) -> None:
        """The call ended with no verdict on the upstream (the client cancelled)."""
        if permit.probe and permit.generation == self._generation:
            self._probes_in_flight -= 1

    def _open(self, reason: Trip) -> None:
        self.adaptive.opened(reason)
        self._cb._reset_timeout = self.adaptive.backoff_s  # shown by pybreaker's own views
        self._transition(self._cb.open)

    def _transition(self, change: Callable[[], object]) -> None:
        self._generation += 1
        self._closed_permit = Permit(self._generation, False)
        self._probes_in_flight = 0
        self._probe_successes = 0
        self._probe_failers = set()
        change()
        self._current = self._cb.current_state
        # Told once the change is complete (pybreaker's listener runs before its storage holds
        # the new state): whoever is told reads the new state (the effective weight, the log).
        changes, self._changes = self._changes, []
        for old, new in changes:
            reason = self.adaptive.reason.value if new is State.OPEN and self.adaptive.reason else ""
            self._on_change(self.key, old, new, reason)

    def changed(self, old: State, new: State) -> None:
        self._changes.append((old, new))

    def snapshot(self) -> dict[str, object]:
        a = self.adaptive
        return {
            "upstream": self.key.upstream,
            "model": self.key.model,
            "version": self.key.version,
            "state": self.state.value,
            "reason": a.reason.value if a.reason else None,
            "backoff_s": a.backoff_s if self.state is not State.CLOSED else None,
            "window_calls": len(a.window),
            "window_faults": a.window.faults,
            "baseline_p99_s": a.baseline,
            "limit_s": a.latency_limit(),
            "probe_run": a.run if self.state is not State.CLOSED else None,
            "probe_successes": self._probe_successes if self.state is State.HALF_OPEN else None,
            "trips": a.trips,
        }


class Breakers:
    """All breakers of a sidecar, created on first use."""

    def __init__(
        self,
        policy: BreakerPolicy,
        on_change: OnChange,
        clock: Clock = time.monotonic,  # test seam: stepped by hand in the unit tests
        on_made: Callable[[BreakerKey], None] = lambda key: None,  # its state series starts at 0
    ) -> None:
        self._policy = policy
        self._clock = clock
        self._on_change = on_change
        self._on_made = on_made
        self._breakers: dict[BreakerKey, Breaker] = {}
        # The same breakers by plain tuple: looked up per call without making a BreakerKey.
        self._by_names: dict[tuple[str, str, str], Breaker] = {}
        self._observe: Observe | None = None  # given every breaker's outcomes

    def get(self, upstream: str, model: str, version: str) -> Breaker:
        breaker = self._by_names.get((upstream, model, version))
        if breaker is None:
            key = BreakerKey(upstream, model, version)
            breaker = self._breakers[key] = Breaker(
                key, self._policy, self._clock, self._on_change, self._windows
            )
            self._by_names[(upstream, model, version)] = breaker
            self._on_made(key)
            breaker.observe = self._observe
        return breaker

    @property
    def observe(self) -> Observe | None:
        return self._observe

    @observe.setter
    def observe(self, observe: Observe | None) -> None:
        """Every breaker's outcomes go to `observe`, those made already included (ensure() makes
        the served versions' breakers at start)."""
        self._observe = observe
        for breaker in list(self._breakers.values()):
            breaker.observe = observe

    def find(self, upstream: str, model: str, version: str) -> Breaker | None:
        """The breaker if it exists (never creates one: safe from the metrics thread)."""
        return self._breakers.get(BreakerKey(upstream, model, version))

    def of_version(self, model: str, version: str) -> list[Breaker]:
        """Every breaker of a model's version (one per upstream serving it)."""
        # list() copies in one step: the metrics collector reads from its own thread.
        return [b for b in list(self._breakers.values()) if b.key.model == model and b.key.version == version]

    def _windows(self, model: str, version: str) -> list[Window]:
        return [b.adaptive.window for b in self.of_version(model, version)]

    def is_open(self, model: str, version: str) -> bool:
        """Whether a breaker of the version has tripped and not yet recovered (open or half-open):
        "is this model's canary breaker open?" for a rollout's rollback."""
        return any(b.state is not State.CLOSED for b in self.of_version(model, version))

    def shut(self, model: str, version: str) -> bool:
        """Whether every breaker of the version is open with its backoff running (and there is
        one): no call would reach that version, so a canary's effective weight is 0."""
        found = self.of_version(model, version)
        return bool(found) and all(b.shut for b in found)

    def state_of(self, model: str, version: str) -> State | None:
        """The worst state among the version's breakers (open > half-open > closed); None: none."""
        states = {b.state for b in self.of_version(model, version)}
        for state in (State.OPEN, State.HALF_OPEN, State.CLOSED):
            if state in states:
                return state
        return None

    def ensure(self, keys: Iterable[BreakerKey]) -> None:
        """Make the breakers of what the upstreams serve before their first call, so that their
        state series exist from the start (`on_made`)."""
        for key in keys:
            self.get(key.upstream, key.model, key.version)

    def reachable(self, upstream: str) -> None:
        """The upstream is reachable again (its health answered SERVING): its breakers' backoff
        growth starts over."""
        for key, breaker in self._breakers.items():
            if key.upstream == upstream:
                breaker.reachable()

    def set_policy(self, policy: BreakerPolicy) -> None:
        """New thresholds (config reload) apply to breakers made from now on and to existing ones."""
        if policy == self._policy:
            return
        self._policy = policy
        for breaker in self._breakers.values():
            breaker.adaptive.policy = policy
            breaker.adaptive.window.policy = policy

    def __len__(self) -> int:
        return len(self._breakers)

    def prune(self, keep: Callable[[BreakerKey], bool]) -> list[BreakerKey]:
        """Drop the breakers `keep` says no to (a model or version no upstream serves any more);
        returns their keys (for their metric series)."""
        gone = [key for key in self._breakers if not keep(key)]
        for key in gone:
            del self._breakers[key]
            del self._by_names[(key.upstream, key.model, key.version)]
        return gone

    def snapshot(self) -> list[dict[str, object]]:
        return [b.snapshot() for _, b in sorted(self._breakers.items(), key=lambda kv: str(kv[0]))]
