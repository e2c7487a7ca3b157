"""What the manager reports about models: version states, their changes as events, the
watchers that receive those events, and the status board that holds them all."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import MappingProxyType

from modelyard.common.names import echo
from modelyard.service.errors import UNKNOWN_MODEL, ModelNotFound, ModelUnavailable, ServiceError
from modelyard.service.runtime.signature import Signature

WATCH_QUEUE_SIZE = 1024


class VersionState(enum.Enum):
    LOADING = "LOADING"
    READY = "READY"
    FAILED = "FAILED"
    DRAINING = "DRAINING"
    UNLOADED = "UNLOADED"


@dataclass(frozen=True)
class VersionStatus:
    version: int
    state: VersionState
    updated_at: float
    reason: str = ""
    signature: Signature | None = None
    provider: str = ""
    # What a layer above recognised in the graph (a decoder's DecoderModel: ModelService shows
    # its generation settings); None for plain graphs and versions not loaded.
    kind: object | None = None


@dataclass(frozen=True)
class ModelStatus:
    name: str
    versions: Mapping[int, VersionStatus]
    reason: str = ""  # model-level problem (bad config.yaml, no versions on disk)
    max_batch_size: int = 0
    default_version: int | None = None


@dataclass(frozen=True)
class ModelEvent:
    model: str
    version: int
    state: VersionState
    reason: str
    time: float


class WatchOverflow(Exception):
    """A watcher fell so far behind that events were lost; it must re-list and watch again."""


class Watcher:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[ModelEvent] = asyncio.Queue(WATCH_QUEUE_SIZE)
        self.overflowed = False

    def offer(self, event: ModelEvent) -> None:
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.overflowed = True

    async def get(self) -> ModelEvent:
        if self.overflowed and self.queue.empty():
            raise WatchOverflow("watcher fell behind and missed model events; list models and watch again")
        return await self.queue.get()


class StatusBoard:
    """The status of every model of the repository, served or not, and the watchers told of
    each version's change. The reconciler and the loader write it (reasons already scrubbed of
    absolute paths); the APIs read it; the served table asks it why a model has no version."""

    def __init__(self) -> None:
        self._status: dict[str, ModelStatus] = {}
        self._watchers: set[Watcher] = set()
        self._reloading: set[str] = set()  # in a drain-first gap (memory budget)

    # -- reading ---------------------------------------------------------------------------

    def statuses(self) -> list[ModelStatus]:
        return [self._status[name] for name in sorted(self._status)]

    def status(self, name: str) -> ModelStatus:
        status = self._status.get(name)
        if status is None:
            raise ModelNotFound(UNKNOWN_MODEL.format(echo(name)))
        return status

    def get(self, name: str) -> ModelStatus | None:
        return self._status.get(name)

    def names(self) -> set[str]:
        return set(self._status)

    def knows(self, name: str) -> bool:
        """True while `name` is a model of the repository (served or not)."""
        return name in self._status

    def unavailable(self, name: str) -> ServiceError:
        """Why `name` has no version to serve (the served table's miss)."""
        status = self._status.get(name)
        if status is None:
            return ModelNotFound(UNKNOWN_MODEL.format(echo(name)))
        if name in self._reloading:
            return ModelUnavailable(
                f"model {echo(name)} is swapping versions within its memory budget; retry shortly"
            )
        return ModelUnavailable(f"model {echo(name)} has no version ready{_because(status)}")

    # -- watchers --------------------------------------------------------------------------

    def subscribe(self) -> Watcher:
        """A watcher that receives every model event from now on, until unsubscribed."""
        watcher = Watcher()
        self._watchers.add(watcher)
        return watcher

    def unsubscribe(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)

    @contextmanager
    def watch(self) -> Iterator[Watcher]:
        watcher = self.subscribe()
        try:
            yield watcher
        finally:
            self.unsubscribe(watcher)

    # -- writing ---------------------------------------------------------------------------

    def set_model(self, name: str, reason: str, max_batch_size: int = 0) -> None:
        old = self._status.get(name)
        versions = dict(old.versions) if old else {}
        default = old.default_version if old else None
        self._status[name] = ModelStatus(name, MappingProxyType(versions), reason, max_batch_size, default)

    def set_version(self, name: str, status: VersionStatus, notify: bool = True) -> None:
        model = self._status[name]
        versions = dict(model.versions)
        versions[status.version] = status
        self._status[name] = replace(model, versions=MappingProxyType(dict(sorted(versions.items()))))
        if notify:
            event = ModelEvent(name, status.version, status.state, status.reason, status.updated_at)
            for watcher in list(self._watchers):
                watcher.offer(event)

    def set_default(self, name: str, version: int | None) -> None:
        """The served table swapped `name`: requests without a version now get `version`."""
        self._status[name] = replace(self._status[name], default_version=version)

    def keep_versions(self, name: str, selected: list[int]) -> None:
        """List the versions disk and policy select, and those still serving or draining."""
        model = self._status[name]
        keep = {
            n: v
            for n, v in model.versions.items()
            if n in selected or v.state not in (VersionState.FAILED, VersionState.UNLOADED)
        }
        if len(keep) != len(model.versions):
            self._status[name] = replace(model, versions=MappingProxyType(keep))

    def start_reloading(self, name: str) -> None:
        """`name` released a version to make room for its next (until `end_reloading`)."""
        self._reloading.add(name)

    def end_reloading(self, name: str) -> None:
        self._reloading.discard(name)

    def remove(self, name: str) -> None:
        del self._status[name]


def _because(status: ModelStatus) -> str:
    reasons = [status.reason] if status.reason else []
    reasons += [f"version {v.version}: {v.reason}" for v in status.versions.values() if v.reason]
    return f": {'; '.join(reasons)}" if reasons else ""
