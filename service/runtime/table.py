"""The served table: the versions each model serves now, which requests resolve and lease.

The table is an immutable mapping replaced in one assignment, so a request sees either the old
set of versions or the new one, never half of each. A request resolves its version once, leases
it (runtime/served.py's Lease, which the data plane's `open` makes) and keeps it to the end; a
version taken out of the table is drained, then released (the loader does that).

Nothing here knows the repository: what is on disk is the reconciler's, and why a model does not
serve is the status board's (a miss asks `explain` for the error to raise). This is the request
path: a hit is a dict lookup and, for a pinned version, a parse and a second lookup.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from modelyard.common.names import echo
from modelyard.service.errors import UNKNOWN_VERSION, InvalidInput, ServiceError, VersionNotFound
from modelyard.service.runtime.served import ServedModel, ServedVersion
from modelyard.service.versions import parse_version


class ServedTable:
    """Which versions serve each model. `explain(name)` is the error for a model that has none
    (not in the repository, or no version ready); `on_swap(name, default)` hears of every swap,
    with the version that requests without one now get (None: the model serves nothing)."""

    __slots__ = ("_explain", "_models", "_on_swap")

    def __init__(
        self,
        explain: Callable[[str], ServiceError],
        on_swap: Callable[[str, int | None], None],
    ) -> None:
        self._models: Mapping[str, ServedModel] = MappingProxyType({})
        self._explain = explain
        self._on_swap = on_swap

    def resolve(self, name: str, version: str = "") -> ServedVersion:
        """The served version a request runs on: the pinned one, or the newest served."""
        model = self._models.get(name)
        if model is None:
            raise self._explain(name)
        if not version:
            return model.default
        number = parse_version(version)
        if number is None:
            # Triton's words (its clients match them), then what a version is here.
            raise InvalidInput(
                f"failed to get model version from specified version string {echo(version)}: "
                "a version is a number ('3', or 'v3')"
            )
        served = model.versions.get(number)
        if served is None:
            raise VersionNotFound(
                f"{UNKNOWN_VERSION.format(echo(name), number)}; served versions: {sorted(model.versions)}"
            )
        return served

    def get(self, name: str) -> ServedModel | None:
        return self._models.get(name)

    def names(self) -> list[str]:
        return list(self._models)

    def swap(self, name: str, model: ServedModel | None) -> None:
        """Serve `model` for `name` (None: nothing) from the next lookup on."""
        table = dict(self._models)
        if model is None:
            table.pop(name, None)
        else:
            table[name] = model
        self._models = MappingProxyType(table)  # the one assignment that swaps versions
        self._on_swap(name, max(model.versions) if model else None)
