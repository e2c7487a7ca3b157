"""Version dyeing: which version answers a request.

Precedence: a pin (field 2 of the request or the `x-model-version` header) chooses the version.
Otherwise the request is dyed `stable` or `canary`: its sticky key (the `x-user-id` header, or
the configured header; else `x-request-id`; else random) hashes, salted with the model's name,
into one of 10,000 buckets, and buckets below weight x 100 are canary. The same key always lands in
the same bucket, so a user keeps their dye for a given weight, and raising the weight only moves
users from stable to canary. The salt makes each model's canary users a different set (a user is
not everybody's guinea pig); `sticky_cohort: shared` in the route file drops it (one cohort).

The weight (0-100) comes from the `x-canary-weight` header when present, else from the model's
route (config file or admin endpoint). The stable and canary versions come from the route, else
from the versions the upstreams serve: the newest is the canary, the one before it stable.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache

from modelyard.common.headers import DYE_CANARY, DYE_STABLE
from modelyard.common.names import echo

BUCKETS = 10_000
STABLE = DYE_STABLE
CANARY = DYE_CANARY
PINNED = "pinned"


class RoutingError(ValueError):
    """A request header the router cannot use (the message names it)."""


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """How one model's traffic splits. Empty versions: taken from what the upstreams serve."""

    canary_weight: float = 0.0
    stable: str = ""
    canary: str = ""
    # The stickiness salt (the model's name; empty: the cohort shared by all models); not part of
    # what the route says, so routes compare without it.
    cohort: str = field(default="", compare=False)


# Not frozen (a value all the same): a frozen dataclass's __init__ sets each field through
# object.__setattr__, a Python-level call per field, and a Decision may be made per call.
@dataclass(slots=True)
class Decision:
    version: str  # empty: the model's versions are unknown; the service picks its default
    dye: str  # stable, canary or pinned; empty when the versions are unknown
    canary: str = ""  # the canary version when dyed canary (for the fallback), else empty
    stable: str = ""  # the stable version, where a canary may fall back to


def normalize_version(text: str) -> str:
    """The service accepts "3" and "v3"; compare versions in one spelling."""
    return text[1:] if text[:1] in ("v", "V") and text[1:].isdigit() else text


def bucket(key: str, cohort: str = "") -> int:
    """A stable bucket in [0, 10000): the same in every process (Python's hash() is salted).
    `cohort` salts it (blake2b's own salt is 16 bytes at most: the name goes in the key instead)."""
    salted = f"{cohort}\0{key}" if cohort else key
    digest = hashlib.blake2b(salted.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % BUCKETS


def is_canary(key: str, weight: float, cohort: str = "") -> bool:
    return bucket(key, cohort) < weight * (BUCKETS / 100)


# A weight as JSON writes a non-negative number, in ASCII: float() would also take " 50 ", "5_0",
# other scripts' digits and "1e1" spelled many ways.
_WEIGHT = re.compile(r"(?:0|[1-9][0-9]*)(?:\.[0-9]+)?")


def parse_weight(text: str) -> float:
    weight = float(text) if len(text) <= 32 and _WEIGHT.fullmatch(text) else -1.0
    if not 0.0 <= weight <= 100.0:
        raise RoutingError(f"x-canary-weight must be a number from 0 to 100, not {echo(text)}")
    return weight


def stable_and_canary(route: ModelRoute, served: Iterable[str]) -> tuple[str, str]:
    """(stable, canary) for a model: the route's versions where set, else the two newest served
    versions (numeric order); with one served version there is no canary."""
    served = served if isinstance(served, frozenset) else frozenset(served)
    return _stable_and_canary(route.stable, route.canary, served)


@lru_cache(maxsize=1024)
def _stable_and_canary(stable: str, canary: str, served: frozenset[str]) -> tuple[str, str]:
    # Asked on every dyed call, with the same few answers: computed once per route and versions
    # served (the served sets are the upstreams' own, rebound whole when they change).
    ordered = sorted(served, key=_version_key)
    canary = canary or (ordered[-1] if len(ordered) >= 2 else "")
    stable = stable or next((v for v in reversed(ordered) if v != canary), "")
    return stable, canary


def _version_key(version: str) -> tuple[int, str]:
    return (int(version), "") if version.isdigit() else (-1, version)


def decide(
    route: ModelRoute,
    served: Iterable[str],
    *,
    pin: str,
    sticky_key: str | None,
    header_weight: str | None,
) -> Decision:
    """The version for one request. `sticky_key` None means no key: a random bucket."""
    stable, canary = stable_and_canary(route, served)
    version, dye, stable = choose(route, stable, canary, pin, sticky_key, header_weight)
    return Decision(version, dye, version if dye == CANARY else "", stable)


Choice = tuple[str, str, str]  # a Decision's version, dye and stable, as a dyed call uses them


def choose(
    route: ModelRoute, stable: str, canary: str, pin: str, sticky_key: str | None, header_weight: str | None
) -> Choice:
    """`decide`, given the route's stable and canary (stable_and_canary): what a dyed call runs,
    with those two read from its model's view (layers.view.ModelView). A tuple, not a Decision:
    the route layer takes it as its Route (layers/route.py: decide)."""
    if pin:
        return normalize_version(pin), PINNED, ""
    if not stable:
        return "", "", ""  # versions unknown (yet): undyed, the service answers as it would
    if not canary or canary == stable:
        return stable, STABLE, stable
    weight = route.canary_weight if header_weight is None else parse_weight(header_weight)
    key = sticky_key if sticky_key is not None else os.urandom(8).hex()
    if bucket(key, route.cohort) < weight * (BUCKETS / 100):  # is_canary, inline
        return canary, CANARY, stable
    return stable, STABLE, stable
