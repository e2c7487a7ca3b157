"""The repository reconciler: what is on disk (or in an upload) against what is served.

For each model it reads the folder, config.yaml and the version policy, keeps the versions whose
files and config did not change, has the loader load the new or changed ones, and publishes them
together in one swap of the served table; versions that left retire. It owns the per-name locks,
the explicit loads' overrides (uploads), the models an operator unloaded, and the versions that
failed as they are on disk now.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType

from modelyard.common.names import echo, name_problem
from modelyard.service.errors import UNKNOWN_MODEL, ModelLoadError, ModelNotFound
from modelyard.service.metrics import ServiceMetrics
from modelyard.service.repository.files import scrub
from modelyard.service.repository.model_config import ModelConfig, load_config
from modelyard.service.repository.scanner import fingerprint, scan_model, scan_repository
from modelyard.service.repository.uploads import Upload
from modelyard.service.repository.warmup_config import warmup_files
from modelyard.service.runtime.loader import VersionLoader
from modelyard.service.runtime.served import ServedModel, ServedVersion
from modelyard.service.runtime.signature import Signature
from modelyard.service.runtime.status import ModelStatus, StatusBoard, VersionState, VersionStatus
from modelyard.service.runtime.table import ServedTable

log = logging.getLogger(__name__)

# Why a model of the repository does not serve in explicit mode before any load asked for it.
NOT_LOADED = "not loaded: the service runs in explicit mode (--load-model, or a load request, loads it)"


@dataclass(frozen=True)
class LoadOverride:
    """What an explicit load brings instead of the repository's (Triton's load parameters): a
    config that replaces config.yaml, and optionally the model's files in a private folder. It
    holds until the model's next explicit load."""

    config: ModelConfig
    upload: Upload | None = None


class RepositoryReconciler:
    def __init__(
        self,
        repository: Path,
        table: ServedTable,
        board: StatusBoard,
        loader: VersionLoader,
        metrics: ServiceMetrics,
        io: Executor,  # the one model-io thread: scans and file reads
    ) -> None:
        self.repository = repository
        self._table = table
        self._board = board
        self._loader = loader
        self._metrics = metrics
        self._io = io
        # One lock per name while a load, reconcile or unload of it runs or waits; pruned when
        # the last one ends, so names that come and go (or are asked for and unknown) leave nothing.
        self._locks: dict[str, _NameLock] = {}
        self._skipped: set[str] = set()  # repository folders whose names break the rule, reported
        self._held: set[str] = set()  # unloaded by an operator: file changes do not reload them
        # Versions that failed as they are on disk now, so that unrelated events do not retry them.
        self._failed: dict[tuple[str, int], tuple[tuple[object, ...], ModelConfig]] = {}
        self._overrides: dict[str, LoadOverride] = {}

    async def reconcile_all(self) -> None:
        """Bring every model in line with disk: new models load, removed ones unload."""
        skipped: set[str] = set()
        names = await asyncio.get_running_loop().run_in_executor(
            self._io, scan_repository, self.repository, skipped
        )
        for folder in sorted(skipped - self._skipped):  # once per folder, not at every resync
            log.warning(
                "repository folder %s skipped: %s",
                echo(folder),
                name_problem(folder) or "not a model name",
            )
        self._skipped = skipped
        # Folders that hold version folders but no model file (ensembles, most likely) go last,
        # so that the models their steps run serve when they load.
        last = {n for n, source in names.items() if source.folders and not source.versions}
        for name in sorted(set(names) | self._board.names(), key=lambda n: (n in last, n)):
            await self.reconcile(name)

    async def hold_all_but(self, names: set[str]) -> None:
        """Explicit mode's start: the repository's models other than `names` are known and held
        unloaded (listed in the index and by GetModel, not loaded) until an explicit load."""
        found = await asyncio.get_running_loop().run_in_executor(self._io, scan_repository, self.repository)
        for name in sorted(set(found) - names):
            self._held.add(name)
            self._set_model(name, reason=NOT_LOADED)

    async def load(self, name: str, override: LoadOverride | None = None) -> ModelStatus:
        """Explicit load (LoadModel, RepositoryModelLoad): serve what is on disk now, or with
        `override` what the request brings; a later load without one goes back to the repository."""
        self._held.discard(name)
        async with self._lock(name):
            previous = self._overrides.pop(name, None)
            if override is not None:
                self._overrides[name] = override
            status = await self._reconcile(name)
            await self._remove_upload(previous)
            if status is None:
                await self._remove_upload(self._overrides.pop(name, None))
            elif status.default_version is None and override is not None and override.upload is not None:
                await self._drop_failed_upload(name)
        if status is None:
            raise ModelNotFound(UNKNOWN_MODEL.format(echo(name)))
        return status

    async def reconcile(self, name: str) -> ModelStatus | None:
        """Serve what is on disk for `name`: load new or changed versions, validate them, swap them
        in together, retire versions that left. Unchanged versions keep their sessions. A model an
        operator unloaded stays unloaded until loaded explicitly."""
        async with self._lock(name):
            if name in self._held:
                return self._board.get(name)
            return await self._reconcile(name)

    async def unload(self, name: str) -> ModelStatus:
        async with self._lock(name):
            self._board.status(name)  # NOT_FOUND for a model the service never saw
            self._held.add(name)
            old = self._table.get(name)
            self._table.swap(name, None)
            if old is not None:
                await asyncio.gather(*(self._loader.retire(v) for v in old.versions.values()))
            # An unloaded model keeps no upload: its next load brings files again or reads the
            # repository, and the bytes go back to the upload space.
            await self._remove_upload(self._overrides.pop(name, None))
            status = self._board.status(name)
            if not await self._in_repository(name):
                # Only an upload brought it, and its files are gone: nothing is left to hold or
                # to report, so a name's load and unload leave no state behind.
                self._held.discard(name)
                await self._remove(name)
            return status

    async def drop_uploads(self) -> None:
        """Delete the files of every upload still held (on shutdown, once nothing serves)."""
        for override in list(self._overrides.values()):
            await self._remove_upload(override)
        self._overrides.clear()

    # -- internals -------------------------------------------------------------------------

    async def _drop_failed_upload(self, name: str) -> None:
        """An upload of which no version serves keeps no files; and when the repository has no
        folder of that name, the model leaves no state (status, failure series) either: uploads
        of files that do not load, under ever new names, must not grow the service's state. The
        caller still answers with the failure's reasons."""
        await self._remove_upload(self._overrides.pop(name, None))
        if not await self._in_repository(name):
            await self._remove(name)

    async def _in_repository(self, name: str) -> bool:
        """Whether the repository has a folder of that name (off the loop: a file system call)."""
        return await asyncio.get_running_loop().run_in_executor(self._io, (self.repository / name).is_dir)

    async def _remove_upload(self, override: LoadOverride | None) -> None:
        """Delete an override's uploaded files, off the loop. The sessions loaded from them hold
        their own copy of the model (or an open map)."""
        if override is not None and override.upload is not None:
            await asyncio.get_running_loop().run_in_executor(self._io, override.upload.remove)

    async def _reconcile(self, name: str) -> ModelStatus | None:
        loop = asyncio.get_running_loop()
        override = self._overrides.get(name)
        root = override.upload.root if override and override.upload else self.repository
        try:
            source = await loop.run_in_executor(self._io, scan_model, root, name)
        except ModelLoadError:
            await self._remove(name)  # the folder is gone (or its name is not a model name)
            return None
        try:
            if override is not None:
                config = override.config
            else:
                config = await loop.run_in_executor(self._io, load_config, source.path, root)
        except ModelLoadError as exc:
            # A broken config.yaml changes nothing that serves; status and metrics say why.
            log.error("model %s: %s", name, exc)
            self._set_model(
                name, reason=str(exc), max_batch_size=(self._board.get(name) or _NO_STATUS).max_batch_size
            )
            self._metrics.load_failures.labels(name, exc.kind).inc()
            return self._board.status(name)
        for problem in source.problems:
            log.error("model %s: %s", name, problem)
        # An ensemble's versions are its (empty) version folders; a model's, those with a model file.
        on_disk = source.folders if config.ensemble is not None else source.versions
        selected = config.version_policy.select(list(on_disk))
        reason = "; ".join(source.problems)
        if not selected:
            reason = reason or f"no version folder with a {name}/<version>/model.onnx"
            log.error("model %s has no version to serve: %s", name, reason)
        self._set_model(name, reason=reason, max_batch_size=config.max_batch_size)
        self._forget_unselected(name, selected)

        current = dict(served.versions) if (served := self._table.get(name)) else {}
        # Label and warm-up files count as part of each version: a changed (or newly added) one
        # reloads it.
        beside = [source.path / output.label_filename for output in config.outputs if output.label_filename]
        beside += warmup_files(source.path, config.model_warmup)
        fingerprints = await loop.run_in_executor(
            None, lambda: {n: fingerprint(on_disk[n], beside) for n in selected}
        )
        kept: dict[int, ServedVersion] = {}
        loaded: dict[int, ServedVersion] = {}
        for number in selected:
            old = current.get(number)
            if old is not None and old.fingerprint == fingerprints[number] and old.config == config:
                kept[number] = old
                continue
            if self._failed.get((name, number)) == (fingerprints[number], config):
                continue  # it failed as it is now; try again when its files or the config change
            newest = max({**current, **kept, **loaded}.items(), default=(0, None))[1]
            # The schema a new version must keep: the newest served one's (taken before a
            # drain-first load may release that version).
            reference = (newest.version, newest.runner.signature) if newest else None
            version = await self._load_version(
                name, number, on_disk[number], config, fingerprints[number], reference, current
            )
            if version is not None:
                loaded[number] = version
        self._publish(name, config, selected, kept, loaded, on_disk)
        return self._board.status(name)

    async def _load_version(
        self,
        name: str,
        number: int,
        model_file: Path,
        config: ModelConfig,
        print_: tuple[object, ...],
        reference: tuple[int, Signature] | None,
        current: dict[int, ServedVersion],
    ) -> ServedVersion | None:
        """Validate and load one version; on failure record why and return None."""
        self._set_version(name, VersionStatus(number, VersionState.LOADING, time.time()))
        try:
            served = await self._loader.load(name, number, model_file, config, print_, reference, current)
        except ModelLoadError as exc:
            self._failed[(name, number)] = (print_, config)
            self._set_version(name, VersionStatus(number, VersionState.FAILED, time.time(), str(exc)))
            return None
        self._failed.pop((name, number), None)
        return served

    def _publish(
        self,
        name: str,
        config: ModelConfig,
        selected: list[int],
        kept: dict[int, ServedVersion],
        loaded: dict[int, ServedVersion],
        on_disk: Mapping[int, Path],
    ) -> None:
        old = self._table.get(name)
        current = dict(old.versions) if old else {}
        versions = {**kept, **loaded}
        for number in selected:
            if number not in versions and number in current:
                # Its reload failed: the old session keeps serving, and status says why.
                served = current[number]
                versions[number] = served
                failed = self._board.status(name).versions[number]
                reason = f"reload failed, previous load serving: {failed.reason}"
                self._set_version(name, replace(self._version_ready(served), reason=reason), notify=False)
        # A bad version never replaces a good one: while selected versions are missing, the served
        # versions they would have replaced keep serving (newest first), if still on disk.
        for number in sorted(current, reverse=True):
            if len(versions) >= len(selected):
                break
            if number not in versions and number in on_disk:
                versions[number] = current[number]
        for served in loaded.values():
            self._set_version(name, self._version_ready(served))
        self._board.end_reloading(name)
        self._table.swap(name, ServedModel(name, config, MappingProxyType(versions)) if versions else None)
        if loaded:
            self._metrics.swaps.labels(name).inc()
        for number, served in current.items():
            if versions.get(number) is not served:
                self._loader.retire_later(served, replaced=number in versions)

    def _forget_unselected(self, name: str, selected: list[int]) -> None:
        """Status lists the versions disk and policy select, and those still serving or draining;
        failures of versions no longer selected are forgotten."""
        self._board.keep_versions(name, selected)
        self._failed = {k: v for k, v in self._failed.items() if k[0] != name or k[1] in selected}

    async def _remove(self, name: str) -> None:
        """The model's folder left the repository: retire its versions and forget it."""
        if not self._board.knows(name):
            return
        old = self._table.get(name)
        self._table.swap(name, None)
        if old is not None:
            await asyncio.gather(*(self._loader.retire(v) for v in old.versions.values()))
        log.info("model %s left the repository", name)
        self._board.remove(name)
        self._metrics.forget_model(name)
        self._failed = {k: v for k, v in self._failed.items() if k[0] != name}

    def _version_ready(self, served: ServedVersion) -> VersionStatus:
        degraded, note = served.runner.degraded, served.runner.load_note
        reasons = [f"degraded: {degraded}" if degraded else "", note]
        return VersionStatus(
            served.version,
            VersionState.READY,
            time.time(),
            reason="; ".join(r for r in reasons if r),
            signature=served.runner.signature,
            provider=served.runner.provider,
            kind=served.runner.kind,
        )

    def _set_model(self, name: str, reason: str, max_batch_size: int = 0) -> None:
        self._board.set_model(name, self._scrub(name, reason), max_batch_size)

    def _set_version(self, name: str, status: VersionStatus, notify: bool = True) -> None:
        if status.reason:
            status = replace(status, reason=self._scrub(name, status.reason))
        self._board.set_version(name, status, notify)

    def _scrub(self, name: str, text: str) -> str:
        """Clients see paths relative to the repository, or to the private folder of the model's
        upload (ONNX Runtime's own messages name the absolute path of the file it opened)."""
        text = scrub(text, self.repository)
        override = self._overrides.get(name)
        if override is not None and override.upload is not None:
            text = scrub(text, override.upload.root)
        return text

    @asynccontextmanager
    async def _lock(self, name: str) -> AsyncIterator[None]:
        """Hold the name's lock; the last holder or waiter to leave removes it from the table (a
        later caller makes a new one: nobody holds the old one any more)."""
        entry = self._locks.get(name)
        if entry is None:
            entry = self._locks[name] = _NameLock()
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if not entry.users and self._locks.get(name) is entry:
                del self._locks[name]

    @property
    def lock_count(self) -> int:
        """Names with a lock now (those being loaded, reconciled or unloaded)."""
        return len(self._locks)


class _NameLock:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0  # holders and waiters


_NO_STATUS = ModelStatus("", MappingProxyType({}))
