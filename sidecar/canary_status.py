"""A model's canary as the admin endpoint (GET /canary) and the metrics collector show it: its
versions, its configured and effective weight, the worst state of its breakers. Read-only
shaping for the admin side, kept out of the call path's layers (which apply the same rule to each
call: layers.route.effective)."""

from __future__ import annotations

from dataclasses import dataclass

from modelyard.sidecar.breakers import Breakers
from modelyard.sidecar.dyeing import stable_and_canary
from modelyard.sidecar.layers.view import Pool, Target
from modelyard.sidecar.routes.route_table import RouteTable


@dataclass(frozen=True, slots=True)
class CanaryStatus:
    """A model's canary as routing sees it now: `weight` the route's (configured), and
    `effective_weight` what routing applies (0 while the canary's breakers are all open, or when
    there is no canary); `breaker` the worst state of the canary's breakers (None: no call yet)."""

    model: str
    stable: str
    canary: str
    weight: float
    effective_weight: float
    breaker: str | None

    def doc(self) -> dict[str, object]:
        return {
            "effective_weight": self.effective_weight,
            "breaker": self.breaker,
            "stable_version": self.stable,
            "canary_version": self.canary,
        }


def canary_status(model: str, table: RouteTable, pool: Pool[Target], breakers: Breakers) -> CanaryStatus:
    """The canary of a model: its versions, configured and effective weight, breaker state. Reads
    only (no breaker is made): the metrics collector calls it from its own thread."""
    route = table.route(model)
    stable, canary = stable_and_canary(route, pool.versions(model) if pool.knows(model) else ())
    if not canary or canary == stable:
        return CanaryStatus(model, stable, "", route.canary_weight, 0.0, None)
    state = breakers.state_of(model, canary)
    shut = breakers.shut(model, canary)
    return CanaryStatus(
        model,
        stable,
        canary,
        route.canary_weight,
        0.0 if shut else route.canary_weight,
        state.value if state is not None else None,
    )
