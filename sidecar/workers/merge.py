"""The supervisor's answers to reads, from its workers' views: one scrape (summed), the breakers
(per worker, merged: the worst state per upstream, model and version), the canaries (each
worker's effective weight differs only by its own breakers: the lowest is shown)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Gauges of state, not amounts: the same (or nearly) in every worker; summing would multiply them.
HIGHEST = frozenset({"modelyard_sidecar_breaker_state"})  # the worst worker's breaker
LOWEST = frozenset(
    {
        "modelyard_sidecar_canary_weight",
        "modelyard_sidecar_canary_effective_weight",
        "modelyard_sidecar_rollout_step",
        "modelyard_sidecar_rollout_weight",
        "modelyard_sidecar_rollout_gate",  # 1 only where every worker's gate has that result
    }
)

_RANK = {None: -1, "closed": 0, "half-open": 1, "open": 2}


def _worse(a: Any, b: Any) -> bool:
    return _RANK.get(a, -1) > _RANK.get(b, -1)


def breakers(views: Sequence[tuple[int, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """GET /breakers: one entry per upstream, model and version, the worst worker's, with every
    worker's state under `workers` (worker index -> state)."""
    merged: dict[tuple[str, str, str], dict[str, Any]] = {}
    for index, view in views:
        for entry in view:
            key = (str(entry["upstream"]), str(entry["model"]), str(entry["version"]))
            found = merged.get(key)
            states = {**(found["workers"] if found else {}), str(index): entry["state"]}
            if found is None or _worse(entry["state"], found["state"]):
                merged[key] = {**entry}
            merged[key]["workers"] = states
    return [merged[key] for key in sorted(merged)]


def canary(views: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """GET /canary: the routes as the first worker has them (every admin change reaches every
    worker), each model's `effective_weight` the lowest and `breaker` the worst over the workers."""
    if not views:
        return {}
    first = {**views[0], "models": {m: {**v} for m, v in views[0].get("models", {}).items()}}
    for view in views[1:]:
        for model, other in view.get("models", {}).items():
            mine = first["models"].get(model)
            if mine is None:
                first["models"][model] = {**other}
                continue
            if "effective_weight" in other:
                mine["effective_weight"] = min(
                    mine.get("effective_weight", other["effective_weight"]), other["effective_weight"]
                )
            if _worse(other.get("breaker"), mine.get("breaker")):
                mine["breaker"] = other["breaker"]
    return first
