"""The one supervisor of worker processes that the service's and the sidecar's drive
(service/workers/supervisor.py, sidecar/workers/supervisor.py): it holds the gRPC port (bound with
SO_REUSEPORT, not listening: a taken port fails loudly and only our workers share it), starts N
workers (`python -m MODULE`, the settings as their environment), restarts one that dies (with
Backoff, logged and counted), keeps a dead worker's counters for the summed scrape, and on stop
has every worker drain (SIGTERM: its own graceful shutdown), killing one that outlives the grace
period and a margin.

What joining and leaving mean is each process's own (`join`, `leave`): the service admits a worker
once its repository is loaded and follows its model state; the sidecar replays the admin changes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Generic, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import Metric

from modelyard.process import children
from modelyard.process.lifecycle import bound
from modelyard.process.metrics_sum import carry
from modelyard.process.settings import split_address
from modelyard.process.workers import Backoff, env_text, reserve_port


class WorkerFailed(RuntimeError):
    """A worker exited before it ever served: the process could not start."""


@dataclass
class WorkerSlot:
    index: int
    proc: asyncio.subprocess.Process | None = None
    serving: bool = False  # joined: taking calls
    ever_served: bool = False
    restarts: int = 0
    # Its process's latest scrape (read and written under Workers.scraped), and which process
    # that was: a scrape begun before the process was replaced is not kept.
    last_scrape: str | None = None
    generation: int = 0


S = TypeVar("S", bound=WorkerSlot)
S_contra = TypeVar("S_contra", bound=WorkerSlot, contravariant=True)


@dataclass(frozen=True)
class WorkerKind:
    """What the supervised process is: how it is started and named."""

    module: str  # started as `python -m MODULE`
    env_prefix: str  # its settings' variables (modelyard.process.settings)
    name: str  # as a start-up failure names a worker: "worker", "sidecar worker"
    stop_margin_s: float  # past the grace period, before a worker that did not stop is killed
    restarts: tuple[str, str]  # the name and help of the counter of restarts, by worker
    serving: tuple[str, str]  # the gauge of workers serving


class Supervising(Protocol[S_contra]):
    """What a process's supervisor does itself."""

    async def worker_joins(self, slot: S_contra) -> None:
        """While the worker lives (cancelled when it exits): admit it once it can serve."""

    async def worker_left(self, slot: S_contra) -> None:
        """After it exited (serving no more, its scrape folded into the totals)."""

    def worker_environment(self, index: int) -> Mapping[str, str]:
        """The process's own variables, beside the settings'."""


class Workers(Generic[S]):
    """N slots, each running its worker, restarted until `stop`; `supervisor` says what joining
    and leaving mean. The restarts and serving series are registered in `registry`."""

    def __init__(
        self,
        kind: WorkerKind,
        settings: Any,  # the process's Settings (a dataclass)
        count: int,
        registry: CollectorRegistry,
        slot: Callable[[int], S],
        supervisor: Supervising[S],
        log: logging.Logger,
    ) -> None:
        self.kind = kind
        self.settings = settings
        self.count = count
        self.slots = [slot(i) for i in range(count)]
        self.port = 0
        self.stopping = asyncio.Event()
        self.all_serving = asyncio.Event()
        self._supervisor, self._log = supervisor, log
        self._restarts = Counter(*kind.restarts, ["worker"], registry=registry)
        self._serving = Gauge(*kind.serving, registry=registry)
        self._reserved: socket.socket | None = None
        self._failed: asyncio.Future[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._joining: dict[int, asyncio.Task[None]] = {}
        # Counters of workers that died (metrics_sum.carry), added to every scrape. `scraped`
        # guards them and each slot's last scrape (the event loop folds, a scrape may run on
        # another thread).
        self.carried: list[Metric] = []
        self.scraped = threading.Lock()

    @property
    def address(self) -> str:
        host = split_address(self.settings.listen)[0]
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def reserve(self) -> None:
        """Hold the gRPC port (a BindError names the listen setting)."""
        listen = self.settings.listen
        self._reserved = bound(self.kind.env_prefix, "listen", listen, lambda: reserve_port(listen))
        self.port = self._reserved.getsockname()[1]

    async def start(self) -> None:
        """Start every worker; return once all serve, raise WorkerFailed if one exits first."""
        loop = asyncio.get_running_loop()
        self._failed = loop.create_future()
        self._tasks = [loop.create_task(self._supervise(slot)) for slot in self.slots]
        ready = loop.create_task(self.all_serving.wait())
        started: list[asyncio.Future[Any]] = [ready, self._failed]
        await asyncio.wait(started, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        if self._failed.done():
            self._failed.result()

    async def stop(self) -> None:
        """Every worker drains (SIGTERM); one that outlives the grace period and the margin is
        killed."""
        self.stopping.set()
        # What the supervisor holds open on a worker (its health and model-state streams) would
        # keep the worker's gRPC server waiting out the grace.
        for joining in self._joining.values():
            joining.cancel()
        for slot in self.slots:
            if slot.proc is not None:
                children.send(slot.proc, signal.SIGTERM)
        if self._tasks:
            _, late = await asyncio.wait(self._tasks, timeout=self.settings.grace_s + self.kind.stop_margin_s)
            for slot in self.slots:
                if late and slot.proc is not None and children.send(slot.proc, signal.SIGKILL):
                    self._log.error("worker %d did not stop in time: killed", slot.index)
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def release(self) -> None:
        """Let go of the gRPC port (once the workers are gone)."""
        if self._reserved is not None:
            self._reserved.close()

    def serves(self, slot: S) -> None:
        slot.serving = slot.ever_served = True

    def update(self) -> int:
        """The number of workers serving, also as the gauge; all_serving once all do."""
        serving = sum(slot.serving for slot in self.slots)
        self._serving.set(serving)
        if serving == self.count:
            self.all_serving.set()
        return serving

    def serving_slots(self) -> list[S]:
        return [slot for slot in self.slots if slot.serving]

    async def _supervise(self, slot: S) -> None:
        loop = asyncio.get_running_loop()
        backoff = Backoff()
        while not self.stopping.is_set():
            started = loop.time()
            slot.proc = await children.create(
                [sys.executable, "-m", self.kind.module], env=self.environment(slot.index)
            )
            self._log.info("worker %d started (pid %d)", slot.index, slot.proc.pid)
            joining = self._joining[slot.index] = loop.create_task(self._supervisor.worker_joins(slot))
            code = await slot.proc.wait()
            joining.cancel()
            await asyncio.gather(joining, return_exceptions=True)
            slot.serving = False
            self._fold(slot)
            await self._supervisor.worker_left(slot)
            if self.stopping.is_set():
                self._log.info("worker %d stopped (exit code %d)", slot.index, code)
                return
            if not slot.ever_served and not self.all_serving.is_set():
                if self._failed is not None and not self._failed.done():
                    message = f"{self.kind.name} {slot.index} exited with code {code} before it served"
                    self._failed.set_exception(WorkerFailed(message))
                return
            delay = backoff.next(loop.time() - started)
            slot.restarts += 1
            self._restarts.labels(str(slot.index)).inc()
            self._log.warning(
                "worker %d (pid %d) exited with code %d; restarting it in %.1f s (restart %d)",
                slot.index,
                slot.proc.pid,
                code,
                delay,
                slot.restarts,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), delay)

    def _fold(self, slot: S) -> None:
        with self.scraped:  # its counters live on in the sum; its gauges are gone
            if slot.last_scrape is not None:
                self.carried = carry(self.carried, slot.last_scrape)
            slot.last_scrape = None
            slot.generation += 1

    def environment(self, index: int) -> dict[str, str]:
        """Worker `index`'s environment: this one's, the settings as variables (one worker each,
        on the shared port), and the process's own."""
        prefix = self.kind.env_prefix
        env = {k: v for k, v in os.environ.items() if not k.startswith(prefix)}
        for item in fields(self.settings):
            env[prefix + item.name.upper()] = env_text(getattr(self.settings, item.name))
        env[prefix + "WORKERS"] = "1"
        env[prefix + "LISTEN"] = self.address
        env.update(self._supervisor.worker_environment(index))
        return env
