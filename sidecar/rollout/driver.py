"""Progressive delivery, the driver: runs the rollouts (rollout.py) on what the sidecar sees.

`Outcomes` keeps, per model and version, the recent outcomes the breakers were told (fault and
latency of every attempt, a canary fault answered by stable's fallback included), stamped with the
rollouts' clock. Every `tick_s` the driver, for each rollout: finds the canary version (the route's,
else the newest served), judges the step on the canary's outcomes since the step began against
stable's recent ones, the shadow comparisons since then (the shadow counters in the metrics
registry) and the canary's breaker, and applies the resulting weight to the model's route (source
`rollout`). Each transition is an audit line, a history entry, metrics, and a state file write.

The clock is a parameter (wall seconds: a step's start survives a restart), so the tests step it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from modelyard.sidecar.breakers import BreakerKey
from modelyard.sidecar.dyeing import stable_and_canary
from modelyard.sidecar.rollout.policy import (
    ADMIN,
    GATES,
    MAX_CALLS,
    RESULTS,
    ROUTE_FILE,
    Evidence,
    Rollout,
    RolloutSpec,
    Tally,
)
from modelyard.sidecar.routes.route_table import FROM_ROLLOUT, RouteSource
from modelyard.sidecar.routes.state_file import audit

log = logging.getLogger(__name__)

KEEP = MAX_CALLS  # outcomes kept per model and version (the newest): a step's min_calls fit
STABLE_REFERENCE = 2_000  # stable's newest outcomes the canary is compared with


@dataclass(frozen=True, slots=True)
class Outcome:
    at: float
    fault: bool
    latency: float | None


class Outcomes:
    """The recent outcomes per (model, version), as the breakers were told them; kept only for
    the `watched` models (those with an active rollout: the others cost a set lookup per call)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._seen: dict[tuple[str, str], deque[Outcome]] = {}
        self.watched: frozenset[str] = frozenset()
        # Told whether any model is watched (the breakers then tell `record` every outcome; with
        # none watched, they make no call per outcome for it to drop).
        self.on_watch: Callable[[bool], None] | None = None

    def record(self, key: BreakerKey, fault: bool, latency: float | None) -> None:
        if key.model not in self.watched:
            return
        found = self._seen.get((key.model, key.version))
        if found is None:
            found = self._seen[(key.model, key.version)] = deque(maxlen=KEEP)
        found.append(Outcome(self._clock(), fault, latency))

    def tally(self, model: str, version: str, *, since: float | None = None, newest: int = KEEP) -> Tally:
        """The outcomes at or after `since` (None: the `newest` ones, whenever they were)."""
        found = self._seen.get((model, version), ())
        chosen = list(found)[-newest:] if since is None else [o for o in found if o.at >= since]
        calls = faults = 0
        latencies: list[float] = []
        for o in chosen:
            calls += 1
            faults += o.fault
            if o.latency is not None:
                latencies.append(o.latency)
        p99 = _p99(latencies)  # sorts them
        return Tally(
            calls, faults, len(latencies), p99, latencies[(len(latencies) - 1) // 2] if latencies else None
        )

    def watch(self, models: Iterable[str]) -> None:
        self.watched = frozenset(models)
        if self.on_watch is not None:
            self.on_watch(bool(self.watched))
        for key in [k for k in self._seen if k[0] not in self.watched]:
            del self._seen[key]


def _p99(values: list[float]) -> float | None:
    """The nearest-rank p99 of `values`, sorted in place (the median is then the middle one)."""
    if not values:
        return None
    values.sort()
    return values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]


class RolloutMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.step = Gauge(
            "modelyard_sidecar_rollout_step",
            "The step (index into its steps) each model's rollout is at",
            ["model"],
            registry=registry,
        )
        self.weight = Gauge(
            "modelyard_sidecar_rollout_weight",
            "The canary weight each model's rollout has set (0 after a rollback)",
            ["model"],
            registry=registry,
        )
        self.gate = Gauge(
            "modelyard_sidecar_rollout_gate",
            "Each rollout gate's current result: 1 for the result it has, 0 for the others",
            ["model", "gate", "result"],
            registry=registry,
        )

    def show(self, rollout: Rollout) -> None:
        self.step.labels(rollout.model).set(rollout.step)
        self.weight.labels(rollout.model).set(rollout.weight)
        for gate in GATES:
            current = rollout.gates.get(gate)
            for result in RESULTS:
                self.gate.labels(rollout.model, gate, result).set(
                    1 if current is not None and current.result == result else 0
                )


class RolloutError(Exception):
    """An admin request about rollouts that cannot be done: `status` is its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# The shadow counters (shadow.py) the agreement gate reads: compared, agreeing.
_SHADOW_COUNTERS = (
    ("modelyard_sidecar_shadow_rows_total", "modelyard_sidecar_shadow_rows_agreeing_total"),
    ("modelyard_sidecar_shadow_tokens_total", "modelyard_sidecar_shadow_tokens_agreeing_total"),
)


class RolloutDriver:
    def __init__(
        self,
        routes: RouteSource,
        served: Callable[[str], Iterable[str]],  # the versions the upstreams serve of a model
        breaker_open: Callable[[str, str], bool],  # whether a model version's breaker is open
        registry: CollectorRegistry,
        *,
        saved: Mapping[str, Any] | None = None,  # the state file's "rollouts"
        clock: Callable[[], float] = time.time,
        on_change: Callable[[], None] = lambda: None,
        tick_s: float = 1.0,
    ) -> None:
        self._routes = routes
        self._served = served
        self._breaker_open = breaker_open
        self._registry = registry
        self._clock = clock
        self.on_change = on_change  # after every transition (the state file's writer)
        self.tick_s = tick_s
        self.outcomes = Outcomes(clock)
        self.metrics = RolloutMetrics(registry)
        self.rollouts: dict[str, Rollout] = {}
        self._shadow_base: dict[str, tuple[float, float]] = {}  # per model, at its step's start
        for model, raw in (saved or {}).items():
            try:
                self.rollouts[model] = Rollout.from_doc(model, raw)
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"state file: rollout {model}: {exc}") from exc
        for rollout in self.rollouts.values():
            self.metrics.show(rollout)
        self.outcomes.watch(m for m, r in self.rollouts.items() if r.active)
        self.from_file()

    # --- what operators ask (admin endpoint, route file) ---------------------------------

    def start(self, model: str, spec: RolloutSpec, by: str, origin: str = ADMIN) -> Rollout:
        current = self.rollouts.get(model)
        if current is not None and current.active and origin != ROUTE_FILE:
            raise RolloutError(409, f"model {model} has a {current.state} rollout: abort it first")
        now = self._clock()
        rollout = Rollout.begin(model, spec, now, self._canary(model), by=by, origin=origin)
        self.rollouts[model] = rollout
        self._shadow_base[model] = self._shadow_counts(model)
        self._applied(rollout, rollout.history[-1], by)
        return rollout

    def control(self, model: str, action: str, by: str) -> Rollout:
        rollout = self.rollouts.get(model)
        if rollout is None:
            raise RolloutError(404, f"model {model} has no rollout")
        now = self._clock()
        change = {"pause": rollout.pause, "resume": rollout.resume, "abort": rollout.abort}[action]
        event = change(now, by)
        if event is None:
            raise RolloutError(409, f"the rollout of {model} is {rollout.state}: it cannot {action}")
        if action == "resume":
            self._shadow_base[model] = self._shadow_counts(model)
        self._applied(rollout, event.doc(), by)
        return rollout

    def steering(self, model: str) -> bool:
        """Whether an active rollout sets this model's weight (an admin PUT would be overwritten)."""
        rollout = self.rollouts.get(model)
        return rollout is not None and rollout.active

    def from_file(self) -> None:
        """Rollouts named in the route file start, unless one with the same spec is there already
        (a restart, or a reload that left them as they were)."""
        for model, spec in self._routes.table.rollouts.items():
            current = self.rollouts.get(model)
            if current is not None and current.spec == spec:
                continue
            if current is not None and current.active and current.origin != ROUTE_FILE:
                log.warning("route file: rollout of %s: an admin rollout is running; the file's waits", model)
                continue
            self.start(model, spec, "route file", origin=ROUTE_FILE)

    # --- the loop ----------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                self.tick()
            except Exception:  # a bug here must not end the rollouts' loop silently
                log.exception("rollouts: a tick failed")

    def tick(self) -> None:
        now = self._clock()
        for model, rollout in list(self.rollouts.items()):
            if not rollout.active:
                continue
            event = rollout.canary_is(self._canary(model), now)
            if event is not None or not self._shadow_base.get(model):
                self._shadow_base[model] = self._shadow_counts(model)
            if event is not None:
                self._applied(rollout, event.doc(), "")
            event = rollout.evaluate(self._evidence(rollout), now)
            if event is not None:
                self._shadow_base[model] = self._shadow_counts(model)
                self._applied(rollout, event.doc(), "")
            else:
                self.metrics.show(rollout)  # the gates' results, between transitions too
            self._hold(rollout)

    def _hold(self, rollout: Rollout) -> None:
        """An active rollout owns its model's weight: a route-file edit of it is undone (an admin
        PUT is refused with 409 instead), with a warning and an audit line."""
        route = self._routes.table.route(rollout.model)
        if not rollout.active or route.canary_weight == rollout.weight:
            return
        log.warning(
            "rollout of %s: its weight was set to %g elsewhere (the route file?); the rollout's %g holds",
            rollout.model,
            route.canary_weight,
            rollout.weight,
        )
        self._routes.set_route(
            rollout.model, replace(route, canary_weight=rollout.weight), source=FROM_ROLLOUT, by="rollout"
        )
        held = f"canary_weight {route.canary_weight:g} -> {rollout.weight:g}"
        audit(f"model={rollout.model} rollout holds {held}", "rollout", self._clock())

    def _canary(self, model: str) -> str:
        route = self._routes.table.route(model)
        stable, canary = stable_and_canary(route, self._served(model))
        return canary if canary and canary != stable else ""

    def _evidence(self, rollout: Rollout) -> Evidence:
        model = rollout.model
        route = self._routes.table.route(model)
        stable, _ = stable_and_canary(route, self._served(model))
        canary = self.outcomes.tally(model, rollout.canary, since=rollout.step_started)
        reference = self.outcomes.tally(model, stable, newest=STABLE_REFERENCE)
        base = self._shadow_base.get(model, (0.0, 0.0))
        compared, agreeing = self._shadow_counts(model)
        return Evidence(
            canary,
            reference,
            shadowing=self._routes.table.shadow.share > 0,
            compared=int(compared - base[0]),
            agreeing=int(agreeing - base[1]),
            breaker_open=self._breaker_open(model, rollout.canary),
        )

    def _shadow_counts(self, model: str) -> tuple[float, float]:
        compared = agreeing = 0.0
        for total, agree in _SHADOW_COUNTERS:
            compared += self._registry.get_sample_value(total, {"model": model}) or 0.0
            agreeing += self._registry.get_sample_value(agree, {"model": model}) or 0.0
        return compared, agreeing

    def _applied(self, rollout: Rollout, event: Mapping[str, Any], by: str) -> None:
        """A transition: the weight to the route, an audit line, the metrics, the state file."""
        self.outcomes.watch(m for m, r in self.rollouts.items() if r.active)
        model = rollout.model
        route = self._routes.table.route(model)
        if route.canary_weight != rollout.weight:
            self._routes.set_route(
                model, replace(route, canary_weight=rollout.weight), source=FROM_ROLLOUT, by=by or "rollout"
            )
        reason = f" reason={event['reason']!r}" if event.get("reason") else ""
        audit(
            f"model={model} rollout {event['event']} step={rollout.step} "
            f"canary_weight {route.canary_weight:g} -> {rollout.weight:g} state={rollout.state}{reason}",
            by or "rollout",
            float(event["at"]),
        )
        self.metrics.show(rollout)
        self.on_change()

    def saved(self) -> dict[str, Any]:
        return {model: rollout.doc() for model, rollout in sorted(self.rollouts.items())}

    def views(self) -> dict[str, Any]:
        return {model: rollout.view() for model, rollout in sorted(self.rollouts.items())}
