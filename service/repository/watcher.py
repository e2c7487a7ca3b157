"""Watch the repository and turn file changes into debounced per-model reconciles.

A model is reconciled only once its folder has been quiet for `quiet_s`: no event and no file
modified more recently. So a version copied file by file is not loaded half-written, and a burst
of events (an rsync, a `cp -r`) costs one reconcile. Events outside any model folder, such as the
`..data` symlink swap of a Kubernetes ConfigMap or volume, reconcile every model. A periodic full
reconcile catches whatever the operating system did not report (network file systems, overflowed
inotify queues).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver
from watchdog.observers.polling import PollingObserver

from modelyard.service.repository.scanner import is_model_name
from modelyard.service.scheduling.clock import MonotonicClock

log = logging.getLogger(__name__)

EVERY_MODEL = ""  # the key under which a change that concerns every model waits
# Reads (ORT opening a model, checksum hashing) raise "opened"/"closed_no_write"; only writes count.
_WRITES = {"created", "deleted", "modified", "moved", "closed"}


class RepositoryWatcher:
    def __init__(
        self,
        root: Path,
        reconcile: Callable[[str], Awaitable[object]],
        reconcile_all: Callable[[], Awaitable[None]],
        *,
        poll: bool = False,
        quiet_s: float = 0.25,
        resync_s: float = 30.0,
    ) -> None:
        self.root = root.resolve()
        self._reconcile = reconcile
        self._reconcile_all = reconcile_all
        self._poll = poll
        self.quiet_s = quiet_s
        self.resync_s = resync_s
        self._dirty: dict[str, float] = {}  # model (or EVERY_MODEL) -> time of its last event
        self._wake = asyncio.Event()
        self._observer: BaseObserver | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._clock = MonotonicClock()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        observer = PollingObserver(timeout=self.quiet_s) if self._poll else Observer()
        observer.schedule(_Handler(self, loop), str(self.root), recursive=True)
        await loop.run_in_executor(None, observer.start)  # inotify walks the tree to add watches
        self._observer = observer
        self._task = loop.create_task(self._run())
        log.info("watching %s for model changes (%s)", self.root, "polling" if self._poll else "inotify")

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._observer is not None:
            observer = self._observer
            observer.stop()
            await asyncio.get_running_loop().run_in_executor(None, observer.join, 5.0)

    def touched(self, path: str) -> None:
        """Note a change at `path` (on the event loop)."""
        self._dirty[self.model_of(path)] = self._clock.now()
        self._wake.set()

    def model_of(self, path: str) -> str:
        try:
            parts = Path(path).relative_to(self.root).parts
        except ValueError:
            return EVERY_MODEL
        return parts[0] if parts and is_model_name(parts[0]) else EVERY_MODEL

    async def _run(self) -> None:
        next_resync = self._clock.now() + self.resync_s
        while not self._stopping:
            wake_at = min([next_resync, *(t + self.quiet_s for t in self._dirty.values())])
            # A timer and an event, not asyncio.wait_for: on Python 3.11 wait_for can swallow a
            # cancel that lands as its wait ends, and stop() would then wait on this loop for ever.
            await self._clock.wait(self._wake, wake_at)
            self._wake.clear()
            now = self._clock.now()
            if now >= next_resync:
                self._dirty.setdefault(EVERY_MODEL, now - self.quiet_s)
                next_resync = now + self.resync_s
            for name in [n for n, t in self._dirty.items() if now - t >= self.quiet_s]:
                del self._dirty[name]
                await self._apply(name, now)

    async def _apply(self, name: str, now: float) -> None:
        try:
            if name == EVERY_MODEL:
                await self._reconcile_all()
            elif not await asyncio.get_running_loop().run_in_executor(None, self._settled, name):
                self._dirty.setdefault(name, now)  # still being written: look again after a quiet period
            else:
                await self._reconcile(name)
        except Exception:  # the watcher must outlive any one bad reconcile
            log.exception("reconciling %s after a repository change failed", name or "the repository")

    def _settled(self, name: str) -> bool:
        """No file under the model's folder was modified within the quiet period."""
        newest = 0.0
        for folder, dirs, files in os.walk(self.root / name):
            for entry in [folder, *(os.path.join(folder, f) for f in files + dirs)]:
                try:
                    newest = max(newest, os.lstat(entry).st_mtime)
                except FileNotFoundError:
                    continue
        return time.time() - newest >= self.quiet_s


class _Handler(FileSystemEventHandler):
    """Runs on watchdog's thread: hands write events to the watcher on the event loop."""

    def __init__(self, watcher: RepositoryWatcher, loop: asyncio.AbstractEventLoop) -> None:
        self._watcher = watcher
        self._loop = loop

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type not in _WRITES:
            return
        for path in (event.src_path, getattr(event, "dest_path", "")):
            if path:
                try:
                    self._loop.call_soon_threadsafe(self._watcher.touched, os.fsdecode(path))
                except RuntimeError:  # the loop closed under us during shutdown
                    return
