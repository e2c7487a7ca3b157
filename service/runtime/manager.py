"""The model manager: loads models from the repository and owns the table of served versions.

The table is an immutable mapping replaced in one assignment, so a request sees either the old
set of versions or the new one, never half of each. A request resolves its version once, leases
it, and keeps it to the end; a version taken out of the table is drained, then released.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType

from service.errors import InvalidInput, ModelLoadError, ModelNotFound, ModelUnavailable
from service.repository.config import ModelConfig, load_config
from service.repository.scanner import parse_version, scan_model, scan_repository
from service.runtime.providers import ProviderChoice
from service.runtime.served import ServedModel, ServedVersion
from service.runtime.session import ModelRunner, load_runner
from service.runtime.signature import Signature

log = logging.getLogger(__name__)

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


Loader = Callable[[Path, ModelConfig, ProviderChoice], ModelRunner]


class ModelManager:
    def __init__(
        self,
        repository: Path,
        providers: ProviderChoice,
        *,
        drain_timeout_s: float = 30.0,
        loader: Loader = load_runner,  # test seam: a loader that fails or blocks on demand
    ) -> None:
        self.repository = repository
        self.providers = providers
        self.drain_timeout_s = drain_timeout_s
        self._loader = loader
        self._table: Mapping[str, ServedModel] = MappingProxyType({})
        self._status: dict[str, ModelStatus] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._watchers: set[Watcher] = set()
        self._retiring: set[asyncio.Task[None]] = set()
        self.loaded_all = False  # True once the start-up load of the whole repository has finished

    # -- requests --------------------------------------------------------------------------

    def resolve(self, name: str, version: str = "") -> ServedVersion:
        """The served version a request runs on: the pinned one, or the newest served."""
        model = self._table.get(name)
        if model is None:
            status = self._status.get(name)
            if status is None:
                raise ModelNotFound(f"model {name!r} is not in the repository")
            raise ModelUnavailable(f"model {name!r} has no version ready{_because(status)}")
        if not version:
            return model.default
        number = parse_version(version)
        if number is None:
            raise InvalidInput(f"model_version {version!r} is not a version number (e.g. '3' or 'v3')")
        served = model.versions.get(number)
        if served is None:
            raise ModelNotFound(
                f"model {name!r} has no served version {number}; served versions: {sorted(model.versions)}"
            )
        return served

    @contextmanager
    def lease(self, name: str, version: str = "") -> Iterator[ServedVersion]:
        served = self.resolve(name, version)
        served.acquire()
        try:
            yield served
        finally:
            served.release()

    # -- state -----------------------------------------------------------------------------

    def statuses(self) -> list[ModelStatus]:
        return [self._status[name] for name in sorted(self._status)]

    def status(self, name: str) -> ModelStatus:
        status = self._status.get(name)
        if status is None:
            raise ModelNotFound(f"model {name!r} is not in the repository")
        return status

    def served(self, name: str) -> ServedModel | None:
        return self._table.get(name)

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

    # -- control ---------------------------------------------------------------------------

    async def load_all(self) -> None:
        """Load every model of the repository; a model that fails does not stop the others."""
        loop = asyncio.get_running_loop()
        names = await loop.run_in_executor(None, lambda: sorted(scan_repository(self.repository)))
        for name in names:
            await self.load(name)
        self.loaded_all = True

    async def load(self, name: str) -> ModelStatus:
        """(Re)load a model: load and validate every version the policy selects, then swap them in
        together. A version that fails to load never replaces one that serves."""
        async with self._lock(name):
            loop = asyncio.get_running_loop()
            try:
                source = await loop.run_in_executor(None, scan_model, self.repository, name)
                config = await loop.run_in_executor(None, load_config, source.path)
            except ModelLoadError as exc:
                if name not in self._status and not (self.repository / name).is_dir():
                    raise ModelNotFound(str(exc)) from None
                log.error("model %s failed to load: %s", name, exc)
                self._set_model(name, reason=str(exc))
                return self._status[name]
            for problem in source.problems:
                log.error("model %s: %s", name, problem)
            selected = config.version_policy.select(list(source.versions))
            reason = "; ".join(source.problems)
            if not selected:
                reason = reason or f"no version folder with a {source.path}/<version>/model.onnx"
                log.error("model %s has no version to serve: %s", name, reason)
            self._set_model(name, reason=reason, max_batch_size=config.max_batch_size)

            loaded: dict[int, ServedVersion] = {}
            for number in selected:
                self._set_version(name, VersionStatus(number, VersionState.LOADING, time.time()))
                try:
                    runner = await loop.run_in_executor(
                        None, self._loader, source.versions[number], config, self.providers
                    )
                except ModelLoadError as exc:
                    log.error("model %s version %d failed to load: %s", name, number, exc)
                    self._set_version(name, VersionStatus(number, VersionState.FAILED, time.time(), str(exc)))
                    continue
                loaded[number] = ServedVersion(name, number, runner, config)
                log.info(
                    "model %s version %d loaded on %s (warm-up run %.0f us, %s)",
                    name,
                    number,
                    runner.provider,
                    runner.warmup_run_s * 1e6,
                    "inline" if runner.runs_inline else "executor",
                )
            self._publish(name, config, selected, loaded)
            return self._status[name]

    async def unload(self, name: str) -> ModelStatus:
        async with self._lock(name):
            self.status(name)  # NOT_FOUND for a model the manager never saw
            old = self._table.get(name)
            self._swap(name, None)
            if old is not None:
                await asyncio.gather(*(self._retire(v) for v in old.versions.values()))
            return self._status[name]

    async def close(self) -> None:
        """Drain and release every served version (on shutdown, after the server stopped)."""
        for name in list(self._table):
            await self.unload(name)
        if self._retiring:
            await asyncio.gather(*self._retiring)

    # -- internals -------------------------------------------------------------------------

    def _publish(
        self, name: str, config: ModelConfig, selected: list[int], loaded: dict[int, ServedVersion]
    ) -> None:
        old = self._table.get(name)
        versions = dict(loaded)
        if old is not None:
            for number, served in old.versions.items():
                if number in selected and number not in loaded:
                    # Its reload failed: the old session keeps serving, and status says why.
                    versions[number] = served
                    failed = self._status[name].versions[number]
                    self._set_version(
                        name,
                        replace(
                            self._version_ready(served),
                            reason=f"reload failed, previous load serving: {failed.reason}",
                        ),
                        notify=False,
                    )
        for served in loaded.values():
            self._set_version(name, self._version_ready(served))
        self._swap(name, ServedModel(name, config, MappingProxyType(versions)) if versions else None)
        if old is not None:
            for number, served in old.versions.items():
                if versions.get(number) is not served:
                    self._start_retiring(served, replaced=number in versions)

    def _swap(self, name: str, model: ServedModel | None) -> None:
        table = dict(self._table)
        if model is None:
            table.pop(name, None)
        else:
            table[name] = model
        self._table = MappingProxyType(table)  # the one assignment that swaps versions
        status = self._status[name]
        self._status[name] = replace(status, default_version=max(model.versions) if model else None)

    def _start_retiring(self, served: ServedVersion, replaced: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._retire(served, replaced))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _retire(self, served: ServedVersion, replaced: bool = False) -> None:
        """Wait for the version's in-flight requests, then drop the last reference to its session
        (ONNX Runtime frees a session's memory only when the session object is destroyed)."""
        name, number = served.model, served.version
        if not replaced:
            self._set_version(
                name,
                replace(
                    self._status[name].versions[number], state=VersionState.DRAINING, updated_at=time.time()
                ),
            )
        drained = await served.drain(self.drain_timeout_s)
        if not drained:
            log.warning(
                "model %s version %d released with %d requests still running after %.1f s drain",
                name,
                number,
                served.in_flight,
                self.drain_timeout_s,
            )
        if not replaced:
            self._set_version(name, VersionStatus(number, VersionState.UNLOADED, time.time()))
        log.info("model %s version %d released", name, number)

    def _version_ready(self, served: ServedVersion) -> VersionStatus:
        return VersionStatus(
            served.version,
            VersionState.READY,
            time.time(),
            signature=served.runner.signature,
            provider=served.runner.provider,
        )

    def _set_model(self, name: str, reason: str, max_batch_size: int = 0) -> None:
        old = self._status.get(name)
        versions = dict(old.versions) if old else {}
        default = old.default_version if old else None
        self._status[name] = ModelStatus(name, MappingProxyType(versions), reason, max_batch_size, default)

    def _set_version(self, name: str, status: VersionStatus, notify: bool = True) -> None:
        model = self._status[name]
        versions = dict(model.versions)
        versions[status.version] = status
        self._status[name] = replace(model, versions=MappingProxyType(dict(sorted(versions.items()))))
        if notify:
            event = ModelEvent(name, status.version, status.state, status.reason, status.updated_at)
            for watcher in list(self._watchers):
                watcher.offer(event)

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())


def _because(status: ModelStatus) -> str:
    reasons = [status.reason] if status.reason else []
    reasons += [f"version {v.version}: {v.reason}" for v in status.versions.values() if v.reason]
    return f": {'; '.join(reasons)}" if reasons else ""
