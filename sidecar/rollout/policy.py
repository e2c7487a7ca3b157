"""Progressive delivery, the policy: a rollout's state machine and its gates, with no transport and
no clock of its own (every transition takes `now`; the driver, rollout_driver.py, supplies it and
what the sidecar saw).

A rollout steps the canary's weight through `steps` (1, 5, 25, 50, 100). At each step the gates are
judged on the canary's calls made since the step began, against stable's:

- errors: the canary's error rate (server faults, including those answered by stable's fallback)
  at most `max_error_excess` above stable's;
- latency: the canary's median at most `max_latency_ratio` times stable's (never red below
  `median_floor_s`, a few milliseconds: the limit scales with stable), and its p99 at most
  `max_latency_ratio` times stable's (never red below `latency_floor_s`: a fast model's p99 is
  mostly the scheduler's hiccups, which must not fail a rollout). The latencies are the breakers'
  (the service's own run time where its answer carries it);
- shadow: where shadowing is on, the share of mirrored rows (argmax) and greedy tokens that agree
  at least `min_agreement`.

A gate is judged once the step has `judge_calls` canary calls (before: pending). A red gate, or the
canary's breaker opening, fails the rollout at once: weight 0, with the reason. With every gate
green (or without data: no latency for streams, no shadow comparisons) for `dwell_s` and at least
`min_calls` canary calls, the rollout moves to the next step; green at the last step (100) is
`succeeded`. A new canary version while running or paused starts again from the first step.
Paused: the weight holds and the rollout does not advance, but a red gate still fails it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

RUNNING, PAUSED, SUCCEEDED, FAILED, ABORTED = "running", "paused", "succeeded", "failed", "aborted"
ACTIVE = frozenset({RUNNING, PAUSED})
GREEN, RED, PENDING, OFF = "green", "red", "pending", "off"
GATES = ("errors", "latency", "shadow")
RESULTS = (GREEN, RED, PENDING, OFF)
MAX_HISTORY = 200  # events kept per rollout (the newest)
ADMIN, ROUTE_FILE = "admin", "route_file"  # where a rollout was started from
# The knobs' bounds (route_file.RolloutDoc declares them too). MAX_CALLS is what the driver keeps of
# a version's outcomes: a step needing more canary calls could never advance.
MAX_STEPS = 100
MAX_DWELL_S = 7 * 86400.0
MAX_CALLS = 20_000
MAX_LATENCY_RATIO = 1000.0
MAX_LATENCY_FLOOR_S = 3600.0


@dataclass(frozen=True)
class RolloutSpec:
    """What a rollout does; ValueError names what is wrong."""

    steps: tuple[float, ...] = (1.0, 5.0, 25.0, 50.0, 100.0)
    dwell_s: float = 60.0
    min_calls: int = 100
    judge_calls: int = 20
    max_error_excess: float = 0.02
    max_latency_ratio: float = 2.0
    latency_floor_s: float = 0.05
    median_floor_s: float = 0.001
    min_agreement: float = 0.99

    def __post_init__(self) -> None:
        steps = tuple(float(s) for s in self.steps)
        object.__setattr__(self, "steps", steps)
        if not steps or any(not 0 < s <= 100 for s in steps):
            raise ValueError("steps must be weights above 0 and at most 100")
        if any(b <= a for a, b in itertools.pairwise(steps)):
            raise ValueError("steps must rise")
        if steps[-1] != 100:
            raise ValueError("the last step must be 100")
        if len(steps) > MAX_STEPS:
            raise ValueError(f"at most {MAX_STEPS} steps")
        # Every knob finite and bounded: an infinite ratio or floor would turn a gate off unseen, an
        # infinite dwell or call count would hold a step for ever (and GET /rollouts must stay JSON).
        for name, low, high in (
            ("dwell_s", 0.0, MAX_DWELL_S),
            ("max_error_excess", 0.0, 1.0),
            ("max_latency_ratio", 0.0, MAX_LATENCY_RATIO),
            ("latency_floor_s", 0.0, MAX_LATENCY_FLOOR_S),
            ("median_floor_s", 0.0, MAX_LATENCY_FLOOR_S),
            ("min_agreement", 0.0, 1.0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            if not low <= value <= high or (name == "max_latency_ratio" and value == 0):
                raise ValueError(f"{name} must be from {low:g} to {high:g}, got {value!r}")
        for name in ("min_calls", "judge_calls"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CALLS:
                raise ValueError(f"{name} must be an integer from 1 to {MAX_CALLS}, got {value!r}")
        object.__setattr__(self, "judge_calls", min(self.judge_calls, self.min_calls))

    def doc(self) -> dict[str, Any]:
        return {
            "steps": list(self.steps),
            "dwell_s": self.dwell_s,
            "min_calls": self.min_calls,
            "judge_calls": self.judge_calls,
            "max_error_excess": self.max_error_excess,
            "max_latency_ratio": self.max_latency_ratio,
            "latency_floor_s": self.latency_floor_s,
            "median_floor_s": self.median_floor_s,
            "min_agreement": self.min_agreement,
        }


@dataclass(frozen=True)
class Tally:
    """What the sidecar saw of one version: calls, faults, and the p99 of the timed ones."""

    calls: int = 0
    faults: int = 0
    timed: int = 0  # calls with a latency (unary)
    p99_s: float | None = None
    p50_s: float | None = None

    @property
    def error_rate(self) -> float:
        return self.faults / self.calls if self.calls else 0.0


@dataclass(frozen=True)
class Evidence:
    """The step so far: the canary's calls since it began, stable's for comparison."""

    canary: Tally
    stable: Tally
    shadowing: bool = False
    compared: int = 0  # shadow rows and tokens compared in this step
    agreeing: int = 0
    breaker_open: bool = False


@dataclass(frozen=True)
class Verdict:
    result: str
    detail: str = ""


def judge(spec: RolloutSpec, ev: Evidence) -> dict[str, Verdict]:
    """Each gate's result on the evidence."""
    canary, stable = ev.canary, ev.stable
    verdicts: dict[str, Verdict] = {}
    if canary.calls < spec.judge_calls:
        verdicts["errors"] = Verdict(PENDING)
    else:
        allowed = stable.error_rate + spec.max_error_excess
        detail = f"canary error rate {canary.error_rate:.3f} vs stable {stable.error_rate:.3f}"
        verdicts["errors"] = Verdict(RED if canary.error_rate > allowed else GREEN, detail)
    if canary.timed < spec.judge_calls or canary.p99_s is None:
        verdicts["latency"] = Verdict(PENDING)
    elif stable.p99_s is None:
        verdicts["latency"] = Verdict(OFF, "stable has no timed calls to compare with")
    else:
        ratio = spec.max_latency_ratio
        tail = canary.p99_s > max(spec.latency_floor_s, stable.p99_s * ratio)
        most = (
            canary.p50_s is not None
            and stable.p50_s is not None
            and canary.p50_s > max(spec.median_floor_s, stable.p50_s * ratio)
        )
        detail = f"canary p99 {canary.p99_s * 1000:.1f} ms vs stable {stable.p99_s * 1000:.1f} ms"
        if canary.p50_s is not None and stable.p50_s is not None:
            detail += f", median {canary.p50_s * 1000:.1f} ms vs {stable.p50_s * 1000:.1f} ms"
        verdicts["latency"] = Verdict(RED if tail or most else GREEN, detail)
    if not ev.shadowing:
        verdicts["shadow"] = Verdict(OFF)
    elif ev.compared < spec.judge_calls:
        verdicts["shadow"] = Verdict(PENDING)
    else:
        agreement = ev.agreeing / ev.compared
        detail = f"shadow agreement {agreement:.3f} over {ev.compared}"
        verdicts["shadow"] = Verdict(RED if agreement < spec.min_agreement else GREEN, detail)
    return verdicts


@dataclass(frozen=True)
class Event:
    """A transition, for the history, the audit log and the metrics."""

    kind: str  # started, step, succeeded, failed, paused, resumed, aborted, restarted
    step: int
    weight: float
    at: float
    reason: str | None = None
    by: str = ""

    def doc(self) -> dict[str, Any]:
        return {
            "event": self.kind,
            "step": self.step,
            "weight": self.weight,
            "at": self.at,
            "reason": self.reason,
            "by": self.by,
        }


@dataclass
class Rollout:
    """One model's rollout. Every method that changes it returns the Event (None: no change)."""

    model: str
    spec: RolloutSpec
    started: float
    state: str = RUNNING
    step: int = 0
    step_started: float = 0.0
    reason: str | None = None
    canary: str = ""  # the canary version this analysis is about (empty: none served yet)
    origin: str = ADMIN  # or ROUTE_FILE (a file rollout whose spec changes starts anew)
    gates: dict[str, Verdict] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def weight(self) -> float:
        return 0.0 if self.state in (FAILED, ABORTED) else self.spec.steps[self.step]

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    @staticmethod
    def begin(model: str, spec: RolloutSpec, now: float, canary: str, *, by: str, origin: str) -> Rollout:
        rollout = Rollout(model, spec, now, step_started=now, canary=canary, origin=origin)
        rollout._event("started", now, by=by)
        return rollout

    def _event(self, kind: str, now: float, reason: str | None = None, by: str = "") -> Event:
        event = Event(kind, self.step, self.weight, now, reason, by)
        self.history.append(event.doc())
        del self.history[:-MAX_HISTORY]
        return event

    def canary_is(self, canary: str, now: float) -> Event | None:
        """The canary version the upstreams serve now; a new one restarts an active rollout. None
        known (a sidecar just started, before its upstreams report what they serve, or every
        upstream gone) holds the rollout where it is: only a different version restarts it."""
        if not self.active or canary == self.canary or not canary:
            return None
        before, self.canary = self.canary, canary
        self.step, self.step_started, self.gates = 0, now, {}
        if not before:
            return None  # the first canary to analyse: the step begins now
        return self._event("restarted", now, f"new canary version {canary or '(none)'} (was {before})")

    def evaluate(self, ev: Evidence, now: float) -> Event | None:
        """Judge the step on `ev`: fail, advance, succeed, or nothing yet."""
        if not self.active or not self.canary:
            return None
        self.gates = judge(self.spec, ev)
        if ev.breaker_open:
            return self._fail(now, f"the canary's ({self.canary}) breaker opened")
        red = [f"{gate}: {v.detail}" for gate, v in self.gates.items() if v.result == RED]
        if red:
            return self._fail(now, "gate red: " + "; ".join(red))
        if self.state == PAUSED:
            return None
        ready = (
            now - self.step_started >= self.spec.dwell_s
            and ev.canary.calls >= self.spec.min_calls
            and self.gates["errors"].result == GREEN
        )
        if not ready:
            return None
        if self.step == len(self.spec.steps) - 1:
            self.state = SUCCEEDED
            return self._event("succeeded", now)
        self.step, self.step_started = self.step + 1, now  # the gates shown stay the last judged
        return self._event("step", now)

    def _fail(self, now: float, reason: str) -> Event:
        self.state, self.reason = FAILED, reason
        return self._event("failed", now, reason)

    def pause(self, now: float, by: str) -> Event | None:
        if self.state != RUNNING:
            return None
        self.state = PAUSED
        return self._event("paused", now, by=by)

    def resume(self, now: float, by: str) -> Event | None:
        if self.state != PAUSED:
            return None
        self.state, self.step_started = RUNNING, now  # the dwell counts again from here
        return self._event("resumed", now, by=by)

    def abort(self, now: float, by: str) -> Event | None:
        if not self.active:
            return None
        self.state, self.reason = ABORTED, f"aborted by {by}" if by else "aborted"
        return self._event("aborted", now, self.reason, by=by)

    def view(self) -> dict[str, Any]:
        """GET /rollouts/<model>."""
        return {
            "model": self.model,
            "state": self.state,
            "step": self.step,
            "weight": self.weight,
            "reason": self.reason,
            "canary": self.canary,
            "spec": self.spec.doc(),
            "started": self.started,
            "step_started": self.step_started,
            "gates": {gate: {"result": v.result, "detail": v.detail} for gate, v in self.gates.items()},
            "history": list(self.history),
        }

    def doc(self) -> dict[str, Any]:
        """What the state file keeps (a restart resumes from it)."""
        return {
            "spec": self.spec.doc(),
            "started": self.started,
            "state": self.state,
            "step": self.step,
            "step_started": self.step_started,
            "reason": self.reason,
            "canary": self.canary,
            "origin": self.origin,
            "history": list(self.history),
        }

    @staticmethod
    def from_doc(model: str, raw: Mapping[str, Any]) -> Rollout:
        spec = RolloutSpec(**raw["spec"])
        step = int(raw["step"])
        known = raw["state"] in (RUNNING, PAUSED, SUCCEEDED, FAILED, ABORTED)
        if not known or not 0 <= step < len(spec.steps):
            raise ValueError(f"state {raw['state']!r} step {step} is not one it can be in")
        return Rollout(
            model,
            spec,
            float(raw["started"]),
            state=str(raw["state"]),
            step=step,
            step_started=float(raw["step_started"]),
            reason=raw.get("reason"),
            canary=str(raw.get("canary", "")),
            origin=str(raw.get("origin", ADMIN)),
            history=list(raw.get("history", [])),
        )
