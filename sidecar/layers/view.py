"""What a dyed call reads of its model: its route, its stable and canary versions, and per
version the upstream and breaker that serve it (`ModelView`). A view changes only when the route
table, the versions the upstreams serve or the breakers do; views.ModelViews keeps one per served
model and drops them all on each such change, so that a call reads its model in one look.

Also the two protocols through which the layers see the upstreams (`Target`, `Pool`): an
upstream is anything with an `address`, so no layer imports the transport.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from modelyard.sidecar.breakers import Breaker
from modelyard.sidecar.dyeing import ModelRoute, stable_and_canary
from modelyard.sidecar.layers.read import OTHER, Metadata
from modelyard.sidecar.routes.route_table import RouteTable


class Target(Protocol):
    """An upstream as the layers see it (upstreams.Upstream)."""

    @property
    def address(self) -> str: ...


U = TypeVar("U", bound=Target)
U_co = TypeVar("U_co", bound=Target, covariant=True)


class Pool(Protocol[U_co]):
    """The upstreams as the layers see them (upstreams.Upstreams)."""

    def knows(self, model: str, version: str = "") -> bool: ...

    def versions(self, model: str) -> Iterable[str]: ...

    def candidates(self, model: str, version: str) -> Sequence[U_co]: ...

    def serving(self, model: str, version: str) -> Sequence[U_co]: ...

    def any(self) -> Sequence[U_co]: ...


@dataclass(slots=True, eq=False)
class Served(Generic[U]):
    """One version of a model as `balance.take` finds it while its view stands: whether it gets
    state (is_stateful), the upstream serving it when exactly one does, with its breaker (None:
    none, or several, whose turn and reachability `take` asks of the pool per call), and the
    headers an attempt at it carries, by dye. Made once per version and view, never per call."""

    stateful: bool
    only: U | None
    breaker: Breaker | None
    headers: Mapping[str, Metadata]


@dataclass(slots=True, eq=False)
class ModelView(Generic[U]):
    """A model as a dyed call reads it (see the module's docstring). Its one mutable part is
    `versions`, the versions `balance.take` has met under this view (a bounded few: only those
    that get state), so that the next call finds them made."""

    model: str
    known: bool
    label: str
    route: ModelRoute
    stable: str
    canary: str
    table: RouteTable
    # The table mirrors a share of stable answers to the canary (its shadow policy's share > 0):
    # only then is an answer offered to the mirror (shadow/mirror.py), which decides per call.
    mirrored: bool = False
    versions: dict[str, Served[U]] = field(default_factory=dict)


def model_view(model: str, table: RouteTable, pool: Pool[U]) -> ModelView[U]:
    """The view of a model under this table and what the pool serves now."""
    known = bool(model) and pool.knows(model)
    route = table.route(model)
    stable, canary = stable_and_canary(route, pool.versions(model) if known else ())
    mirrored = table.shadow.share > 0
    return ModelView(model, known, model if known else OTHER, route, stable, canary, table, mirrored)


Views = Callable[[str], ModelView[Any]]  # model -> its view (views.ModelViews.of)


def is_stateful(model: str, version: str, table: RouteTable, pool: Pool[Target]) -> bool:
    """Whether a (model, version) gets a breaker: only what the upstreams serve (WatchModels),
    or a version the route names for a served model. Anything a client makes up is forwarded
    without state, and answered by the upstream (NOT_FOUND)."""
    if not model:
        return False
    if version and pool.knows(model, version):  # the usual answer, in one look
        return True
    if not pool.knows(model):
        return False
    if not version:
        return True
    route = table.models.get(model)
    return route is not None and version in (route.stable, route.canary)
