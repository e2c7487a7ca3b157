"""The model manager: the runtime's parts, put together, behind the API the service uses.

- the served table (table.py): what serves now; requests resolve and lease there;
- the status board (status.py): every model's state, and the watchers told of its changes;
- the reconciler (reconciler.py): what is on disk against what is served, by name, under a lock;
- the loader (loader.py): a version's sessions built, warmed up, within the memory budget, and
  released once drained.

The request path (the data plane, generation) holds the table itself; the APIs and the server
read status and control models through the manager.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path

from modelyard.common.names import echo
from modelyard.service.errors import ModelNotFound
from modelyard.service.gpu_memory import DeviceMemory, read_nvml
from modelyard.service.metrics import ServiceMetrics
from modelyard.service.runtime.capacity import RunCapacity
from modelyard.service.runtime.instances import Loader
from modelyard.service.runtime.loader import LoadHook, PlatformLoad, VersionLoader
from modelyard.service.runtime.providers import ProviderChoice
from modelyard.service.runtime.reconciler import LoadOverride, RepositoryReconciler
from modelyard.service.runtime.runs import ActiveRuns
from modelyard.service.runtime.served import ServedModel, ServedVersion
from modelyard.service.runtime.session import load_runner
from modelyard.service.runtime.status import ModelStatus, StatusBoard, Watcher
from modelyard.service.runtime.table import ServedTable

__all__ = ["LoadOverride", "ModelManager"]

log = logging.getLogger(__name__)


class ModelManager:
    def __init__(
        self,
        repository: Path,
        providers: ProviderChoice,
        *,
        metrics: ServiceMetrics | None = None,
        drain_timeout_s: float = 30.0,
        max_run_s: float = 0.0,  # the longest one run on an executor thread may take; 0: no bound
        run_threads: int = 0,  # the executor's threads, shared among the versions; 0: not known
        loader: Loader = load_runner,  # test seam: a loader that fails or blocks on demand
        read_devices: Callable[[], list[DeviceMemory] | None] = read_nvml,  # devices' memory (NVML)
    ) -> None:
        self.repository = repository
        self.providers = providers
        self.metrics = metrics or ServiceMetrics()
        self.drain_timeout_s = drain_timeout_s
        self.board = StatusBoard()
        # The request path: what serves now (requests resolve and lease there, not here).
        self.table = ServedTable(self.board.unavailable, self.board.set_default)
        # Loads, file reads and releases run on one thread: loads of a 2-core machine gain nothing
        # from running side by side, and one thread keeps freed memory in one malloc arena.
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-io")
        # The runs on executor threads of every served version, so that shutdown can stop them.
        self.runs = ActiveRuns(max_run_s, RunCapacity(run_threads))
        self.loader = VersionLoader(
            self.table,
            self.board,
            providers,
            self.metrics,
            self._io,
            self.runs,
            drain_timeout_s,
            loader,
            read_devices,
        )
        self.reconciler = RepositoryReconciler(
            repository, self.table, self.board, self.loader, self.metrics, self._io
        )
        self.loaded_all = False  # True once the start-up load of the whole repository has finished

    # -- requests --------------------------------------------------------------------------

    def resolve(self, name: str, version: str = "") -> ServedVersion:
        """The served version a request runs on: the pinned one, or the newest served."""
        return self.table.resolve(name, version)

    # -- state -----------------------------------------------------------------------------

    def statuses(self) -> list[ModelStatus]:
        return self.board.statuses()

    def status(self, name: str) -> ModelStatus:
        return self.board.status(name)

    def served(self, name: str) -> ServedModel | None:
        return self.table.get(name)

    def knows(self, name: str) -> bool:
        """True while `name` is a model of the repository (served or not)."""
        return self.board.knows(name)

    def subscribe(self) -> Watcher:
        """A watcher that receives every model event from now on, until unsubscribed."""
        return self.board.subscribe()

    def unsubscribe(self, watcher: Watcher) -> None:
        self.board.unsubscribe(watcher)

    def watch(self) -> AbstractContextManager[Watcher]:
        return self.board.watch()

    def on_load(self, hook: LoadHook) -> None:
        """Call `hook` with every version that loads from now on, before it serves a request."""
        self.loader.on_load(hook)

    def add_platform(self, platform: str, load: PlatformLoad) -> None:
        """Load the versions of models of `platform` (config.yaml's platform, e.g. ensemble) with
        `load` (the layer that runs them; the runtime knows none)."""
        self.loader.add_platform(platform, load)

    @property
    def retiring(self) -> int:
        """Versions out of the table whose release has not finished yet."""
        return self.loader.retiring

    @property
    def lock_count(self) -> int:
        """Names with a lock now (those being loaded, reconciled or unloaded)."""
        return self.reconciler.lock_count

    # -- control ---------------------------------------------------------------------------

    async def load_all(self) -> None:
        """Load every model of the repository; a model that fails does not stop the others."""
        await self.reconciler.reconcile_all()
        self.loaded_all = True

    async def load_listed(self, names: Sequence[str]) -> None:
        """Explicit mode's start, as Triton's `--load-model`: only the models named load (`*`:
        every one); the repository's others are known, unloaded, until LoadModel loads them."""
        if "*" in names:
            await self.load_all()
            return
        await self.reconciler.hold_all_but(set(names))
        for name in dict.fromkeys(names):  # in the order given, once each
            try:
                await self.reconciler.load(name)
            except ModelNotFound:
                log.error("--load-model %s: no model of that name in the repository", echo(name))
        self.loaded_all = True

    async def reconcile_all(self) -> None:
        """Bring every model in line with disk: new models load, removed ones unload."""
        await self.reconciler.reconcile_all()

    async def reconcile(self, name: str) -> ModelStatus | None:
        """Serve what is on disk for `name` (unless an operator unloaded it)."""
        return await self.reconciler.reconcile(name)

    async def load(self, name: str, override: LoadOverride | None = None) -> ModelStatus:
        """Explicit load (LoadModel, RepositoryModelLoad): serve what is on disk now, or with
        `override` what the request brings; a later load without one goes back to the repository."""
        return await self.reconciler.load(name, override)

    async def unload(self, name: str) -> ModelStatus:
        return await self.reconciler.unload(name)

    async def close(self) -> None:
        """Drain and release every served version (on shutdown, after the server stopped)."""
        for name in self.table.names():
            await self.reconciler.unload(name)
        await self.loader.wait_retired()
        await self.reconciler.drop_uploads()
        self._io.shutdown(wait=True)
