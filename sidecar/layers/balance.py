"""Layer 3, balance: an upstream for a routed call's version whose breaker lets the call through
(its permit taken: `take`), and the call's first attempt made there (`first`): a canary with none
falls back to its stable (`breaker-open` when a breaker refused, else `unavailable`); with none
for the version either, the call is refused. Also the upstream a stable answer is mirrored to
(`shadow_target`: one whose breaker would let a call through, no permit taken).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from modelyard.common import headers
from modelyard.common.names import echo
from modelyard.common.reasons import ErrorReason
from modelyard.sidecar.breakers import Breaker, Breakers, Permit
from modelyard.sidecar.dyeing import CANARY, PINNED, STABLE, stable_and_canary
from modelyard.sidecar.layers.attempt import (
    ANSWERS,
    FALLBACK_BREAKER,
    FALLBACK_UNAVAILABLE,
    Attempt,
    answer_metadata,
    stripped,
    unrouted,
)
from modelyard.sidecar.layers.read import Asked, Metadata, Refused
from modelyard.sidecar.layers.route import Route
from modelyard.sidecar.layers.view import ModelView, Pool, Served, U, is_stateful
from modelyard.sidecar.routes.route_table import RouteTable

Found = tuple[U, Breaker | None, Permit | None]


def first(
    asked: Asked, route: Route, caller: int, pool: Pool[U], breakers: Breakers, exclude: Sequence[U] = ()
) -> Attempt[U]:
    """The first attempt of a data call on its route (route.effective: the canary's weight-0
    rule applied): see the module's docstring. `exclude`: upstreams it may not go to (a
    sequence's step goes to its sequence's: sequences.py)."""
    version, dye, stable = route
    fallback = ""
    view = asked.view
    found, blocked, served = take(view, version, exclude, pool, breakers)
    if found is None and dye == CANARY and stable:
        fallback = FALLBACK_BREAKER if blocked else FALLBACK_UNAVAILABLE
        dye, version = STABLE, stable
        found, _, served = take(view, version, (), pool, breakers)
    if found is None:
        if blocked:
            raise Refused(
                "UNAVAILABLE",
                f"model {echo(asked.model)} version {echo(version)}: circuit breaker open",
                ErrorReason.BREAKER_OPEN,
            )
        raise Refused(
            "UNAVAILABLE",
            f"model {echo(asked.model)} version {echo(version or '(default)')}: no upstream left to try",
            ErrorReason.UNAVAILABLE,
        )
    upstream, breaker, permit = found
    forward = (*asked.forward, *served.headers[dye]) if version else asked.forward
    return Attempt(
        asked.model,
        version,
        dye,
        fallback,
        stable,
        upstream,
        breaker,
        permit,
        forward,
        caller,
        view.label,
        ANSWERS[dye] if not fallback else answer_metadata(dye, fallback),
        asked,
        bool(fallback),
        None,
    )


def unrouted_first(asked: Asked, pool: Pool[U], model_addressed: bool) -> Attempt[U]:
    """A call that is not dyed: to an upstream serving the model it names, else to any; no state."""
    candidates = pool.candidates(asked.model, asked.pin) if model_addressed else []
    upstream = (candidates or pool.any())[0]
    return unrouted(asked, upstream)


def take(
    view: ModelView[U],
    version: str,
    exclude: Sequence[U],
    pool: Pool[U],
    breakers: Breakers,
    fallback_to_any: bool = True,
) -> tuple[Found[U] | None, bool, Served[U]]:
    """The first upstream for the version whose breaker lets a call through (its permit taken);
    whether a breaker refused; and the version as the view holds it. With no upstream known to
    serve it, any (it answers NOT_FOUND itself), unless `fallback_to_any` is off."""
    served = view.versions.get(version)
    if served is None:
        served = _served(view, version, pool, breakers)
    only = served.only
    if only is not None:  # the usual pod: one upstream serves it, its breaker at hand
        if only in exclude:
            return None, False, served
        breaker = served.breaker
        if breaker is None:
            return (only, None, None), False, served
        permit = breaker.allow()
        return ((only, breaker, permit), False, served) if permit is not None else (None, True, served)
    blocked = False
    model = view.model
    candidates = pool.candidates(model, version)  # several in turn, reachable ones first; or none
    if not candidates and fallback_to_any:
        candidates = pool.any()
    for upstream in candidates:
        if upstream in exclude:
            continue
        if not served.stateful:
            return (upstream, None, None), blocked, served
        breaker = breakers.get(upstream.address, model, version)
        permit = breaker.allow()
        if permit is not None:
            return (upstream, breaker, permit), blocked, served
        blocked = True
    return None, blocked, served


def _served(view: ModelView[U], version: str, pool: Pool[U], breakers: Breakers) -> Served[U]:
    """A version of the view's model, kept in the view when it gets state (a version the
    upstreams serve or the route names: a bounded few; a pin a client made up is not kept)."""
    model = view.model
    stateful = is_stateful(model, version, view.table, pool)
    serving = pool.serving(model, version)
    only = serving[0] if len(serving) == 1 else None
    breaker = breakers.get(only.address, model, version) if only is not None and stateful else None
    sent = {d: ((headers.MODEL_VERSION, version), (headers.MODEL_DYE, d)) for d in (STABLE, CANARY, PINNED)}
    served = Served(stateful, only, breaker, sent)
    if stateful:
        view.versions[version] = served
    return served


def shadow_target(
    attempt: Attempt[Any], table: RouteTable, pool: Pool[U], breakers: Breakers
) -> tuple[str, U, Metadata] | None:
    """Where a stable answer's request is mirrored: the canary version, an upstream whose breaker
    would let a call through (no permit is taken), and the metadata; None when there is none."""
    if not attempt.version:
        return None  # the model's versions are not known (yet): nothing to compare against
    _, canary = stable_and_canary(table.route(attempt.model), pool.versions(attempt.model))
    if not canary or canary == attempt.version:
        return None
    for upstream in pool.candidates(attempt.model, canary):
        if breakers.get(upstream.address, attempt.model, canary).would_allow():
            md = (
                *stripped(attempt.forward),
                (headers.MODEL_VERSION, canary),
                (headers.MODEL_DYE, headers.DYE_SHADOW),
            )
            return canary, upstream, md
    return None
