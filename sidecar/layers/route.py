"""Layer 2, route: which version a data call runs and its dye (stable, canary or pinned), from
its model's view and its headers (routing.choose: the pin wins, else the sticky bucket under the
canary's weight), and the rule that a canary whose breakers are all open has an effective weight
of 0 (`effective`). The value it gives the balance layer is `Route` (a sequence's step may take
its sequence's route instead: sequences.SequencePins.route).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

from modelyard.common import headers
from modelyard.common.reasons import ErrorReason
from modelyard.sidecar.breakers import Breakers
from modelyard.sidecar.dyeing import CANARY, STABLE, RoutingError, choose
from modelyard.sidecar.layers.read import Asked, Refused


class Route(NamedTuple):
    """Where a data call goes: its version ("" while the model's versions are not known: undyed,
    the service answers with its default), its dye, and the stable version a canary attempt
    falls back to (empty: no fallback, as for a pinned call or a sequence's step)."""

    version: str
    dye: str
    stable: str


UNDYED = Route("", "", "")
# routing.choose's tuple as a Route, in one C call (a NamedTuple's own __new__ is a Python function).
_as_route: Callable[[tuple[str, str, str]], Route] = functools.partial(tuple.__new__, Route)


def decide(asked: Asked, breakers: Breakers) -> Route:
    """The routing decision of a data call (routing.choose, with the stable and canary read from
    its model's view), under the canary's breakers (`effective`); a routing header it cannot use
    is refused."""
    view = asked.view
    received = asked.received
    sticky = received.get(view.table.stickiness_header) or received.get(headers.REQUEST_ID)
    try:
        chosen = choose(
            view.route, view.stable, view.canary, asked.pin, sticky, received.get(headers.CANARY_WEIGHT)
        )
    except RoutingError as exc:
        raise Refused("INVALID_ARGUMENT", str(exc), ErrorReason.INVALID_ARGUMENT) from exc
    routed = _as_route(chosen)
    return effective(routed, asked, breakers) if chosen[1] == CANARY else routed


def effective(route: Route, asked: Asked, breakers: Breakers) -> Route:
    """The route under the canary's breakers: while every breaker of the canary is open
    (`Breakers.shut`), a call dyed canary by the route's weight is dyed stable (the effective
    weight is 0: no new user is sent there, and none is told of a fallback). A call that asked
    for the canary itself with `x-canary-weight` keeps its route (and falls back when balanced)."""
    if (
        route.dye == CANARY
        and route.stable
        and headers.CANARY_WEIGHT not in asked.received
        and breakers.shut(asked.model, route.version)
    ):
        return Route(route.stable, STABLE, route.stable)
    return route
