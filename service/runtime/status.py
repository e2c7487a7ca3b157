"""What the manager reports about models: version states, their changes as events, and the
watchers that receive those events."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Mapping
from dataclasses import dataclass

from service.runtime.signature import Signature

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
