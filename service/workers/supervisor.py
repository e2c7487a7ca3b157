"""The parent of the worker processes: it holds the port (so that a taken port fails loudly and
only our workers share it), starts N workers, restarts one that dies (with backoff, logged and
counted), fans model control out to every worker (and replays it to a worker that joins later),
joins their health, serves one /metrics that sums them, and drains them all on SIGTERM.

It imports no model runtime: it speaks to the workers over gRPC on unix sockets."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import Metric

from modelyard.common import health as health_names
from modelyard.inference.v1 import model_service_pb2 as model_pb
from modelyard.process import children
from modelyard.process.lifecycle import bound
from modelyard.process.metrics_http import MetricsServer
from modelyard.process.metrics_sum import per_worker
from modelyard.process.settings import split_address
from modelyard.process.tls import TlsFiles
from modelyard.process.workers import Backoff, env_text, reserve_port
from modelyard.service.config import ENV_PREFIX, Settings
from modelyard.service.workers import protocol
from modelyard.service.workers.member import CHANNEL_OPTIONS
from modelyard.service.workers.metrics_sum import carry, parse, sum_families
from modelyard.service.workers.watch import MergedWatch

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 5.0


class WorkerFailed(RuntimeError):
    """A worker exited before it ever served: the service could not start."""


@dataclass
class Slot:
    index: int
    proc: asyncio.subprocess.Process | None = None
    channel: grpc.aio.Channel | None = None
    admitted: bool = False
    ever_admitted: bool = False
    scrape_channel: grpc.Channel | None = None  # sync: scrapes run on the HTTP thread
    restarts: int = 0
    watching: asyncio.Task[None] | None = None  # its WatchModels, followed for the merged watch
    # Its process's latest scrape (read and written under Supervisor._scraped), and which
    # process that was: a scrape begun before the process was replaced is not kept.
    last_scrape: str | None = None
    generation: int = 0


@dataclass
class Supervisor:
    settings: Settings
    count: int
    folder: protocol.ControlFolder = field(init=False)
    port: int = 0
    _slots: list[Slot] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _reserved: socket.socket | None = None
    _coordinator: grpc.aio.Server | None = None
    _health: Any = None
    _metrics_server: MetricsServer | None = None
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)
    _all_admitted: asyncio.Event = field(default_factory=asyncio.Event)
    _failed: asyncio.Future[None] | None = None
    # Model control applied to every worker, last call per model, replayed to a worker that joins.
    _changes: dict[str, tuple[str, bytes]] = field(default_factory=dict)
    _control: asyncio.Lock = field(default_factory=asyncio.Lock)
    _watch: MergedWatch = field(default_factory=MergedWatch)
    # Counters of workers that died (metrics_sum.carry), added to every scrape. `_scraped` guards
    # them and each slot's last scrape (the event loop folds, the HTTP thread scrapes);
    # `_scraping` lets one scrape run at a time, so that a later scrape never keeps older values.
    _carried: list[Metric] = field(default_factory=list)
    _scraped: threading.Lock = field(default_factory=threading.Lock)
    _scraping: threading.Lock = field(default_factory=threading.Lock)

    @property
    def address(self) -> str:
        host = split_address(self.settings.listen)[0]
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    async def start(self) -> None:
        self.folder = protocol.ControlFolder(Path(tempfile.mkdtemp(prefix="modelyard-workers-")))
        listen = self.settings.listen
        self._reserved = bound(ENV_PREFIX, "listen", listen, lambda: reserve_port(listen))
        self.port = self._reserved.getsockname()[1]
        self._failed = asyncio.get_running_loop().create_future()
        self._health = health_names.new_servicer()
        await self._health.set(health_names.SERVER, health_names.NOT_SERVING)
        self._coordinator = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._coordinator)
        service, method = protocol.BROADCAST.strip("/").split("/")
        _, watch = protocol.WATCH.strip("/").split("/")
        handlers = {
            method: grpc.unary_unary_rpc_method_handler(self._broadcast),
            watch: grpc.unary_stream_rpc_method_handler(
                self._watch_models,
                request_deserializer=model_pb.WatchModelsRequest.FromString,
                response_serializer=model_pb.WatchModelsResponse.SerializeToString,
            ),
        }
        self._coordinator.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        self._coordinator.add_insecure_port(self.folder.coordinator)
        await self._coordinator.start()
        registry = CollectorRegistry()
        self.restarts = Counter(
            "modelyard_worker_restarts",
            "Worker processes restarted after they died.",
            ["worker"],
            registry=registry,
        )
        self.serving = Gauge(
            "modelyard_workers_serving", "Worker processes taking traffic.", registry=registry
        )
        registry.register(_Scrapes(self))
        if self.settings.metrics_listen:
            tls = TlsFiles.from_settings(
                self.settings.tls_cert, self.settings.tls_key, self.settings.tls_client_ca
            )
            address = self.settings.metrics_listen
            self._metrics_server = bound(
                ENV_PREFIX,
                "metrics_listen",
                address,
                lambda: MetricsServer(registry, *split_address(address), tls=tls),
            )
        self._slots = [Slot(i) for i in range(self.count)]
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._supervise(slot)) for slot in self._slots]
        ready = loop.create_task(self._all_admitted.wait())
        started: list[asyncio.Future[Any]] = [ready, self._failed]
        await asyncio.wait(started, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        if self._failed.done():
            self._failed.result()
        models = await self._ready_models()
        log.info(
            "serving gRPC on %s%s; models ready: %s; workers: %d",
            self.address,
            f", metrics on http://{self.metrics_address}/metrics" if self._metrics_server else "",
            ", ".join(models) or "none",
            self.count,
        )

    @property
    def metrics_address(self) -> str:
        assert self._metrics_server is not None
        return f"{split_address(self.settings.metrics_listen)[0]}:{self._metrics_server.port}"

    async def stop(self) -> None:
        """Every worker drains (SIGTERM: its own graceful shutdown); one that outlives the grace
        period and a margin is killed."""
        self._stopping.set()
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        for slot in self._slots:
            if slot.proc is not None:
                children.send(slot.proc, signal.SIGTERM)
        if self._tasks:
            _, late = await asyncio.wait(self._tasks, timeout=self.settings.grace_s + 15)
            for slot in self._slots:
                if late and slot.proc is not None and children.send(slot.proc, signal.SIGKILL):
                    log.error("worker %d did not stop in time: killed", slot.index)
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._coordinator is not None:
            await self._coordinator.stop(0)
        if self._metrics_server is not None:
            self._metrics_server.stop()
        if self._reserved is not None:
            self._reserved.close()
        with contextlib.suppress(AttributeError):
            shutil.rmtree(self.folder.path, ignore_errors=True)

    # -- workers ---------------------------------------------------------------------------

    async def _supervise(self, slot: Slot) -> None:
        loop = asyncio.get_running_loop()
        backoff = Backoff()
        while not self._stopping.is_set():
            started = loop.time()
            slot.proc = await children.create(
                [sys.executable, "-m", "modelyard.service"], env=self._environment(slot.index)
            )
            log.info("worker %d started (pid %d)", slot.index, slot.proc.pid)
            joining = loop.create_task(self._join(slot))
            code = await slot.proc.wait()
            joining.cancel()
            await asyncio.gather(joining, return_exceptions=True)
            await self._leave(slot)
            if self._stopping.is_set():
                log.info("worker %d stopped (exit code %d)", slot.index, code)
                return
            if not slot.ever_admitted and self._failed is not None and not self._all_admitted.is_set():
                if not self._failed.done():
                    self._failed.set_exception(
                        WorkerFailed(f"worker {slot.index} exited with code {code} before it served")
                    )
                return
            delay = backoff.next(loop.time() - started)
            slot.restarts += 1
            self.restarts.labels(str(slot.index)).inc()
            log.warning(
                "worker %d (pid %d) exited with code %d; restarting it in %.1f s (restart %d)",
                slot.index,
                slot.proc.pid,
                code,
                delay,
                slot.restarts,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)

    def _environment(self, index: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
        for item in fields(Settings):
            env[ENV_PREFIX + item.name.upper()] = env_text(getattr(self.settings, item.name))
        env[ENV_PREFIX + "WORKERS"] = "1"
        env[ENV_PREFIX + "LISTEN"] = self.address
        env[ENV_PREFIX + "METRICS_LISTEN"] = ""  # the supervisor serves the sum
        env[protocol.ENV_CONTROL] = str(self.folder.path)
        env[protocol.ENV_INDEX] = str(index)
        env[protocol.ENV_COUNT] = str(self.count)
        env[protocol.ENV_PARENT] = str(os.getpid())
        return env

    async def _join(self, slot: Slot) -> None:
        """Once the worker has loaded its repository: replay model control to it, then admit it
        (it opens the shared port then). Follow its readiness from then on."""
        slot.channel = grpc.aio.insecure_channel(self.folder.worker(slot.index), options=CHANNEL_OPTIONS)
        stub = health_pb2_grpc.HealthStub(slot.channel)
        request = health_pb2.HealthCheckRequest(service=protocol.LOCAL)
        async for reply in stub.Watch(request, wait_for_ready=True):
            if reply.status == health_names.SERVING and not slot.admitted:
                async with self._control:
                    await self._replay(slot)
                    slot.watching = await self._watch.join(slot.index, slot.channel)
                    slot.admitted = slot.ever_admitted = True
                await self._health.set(protocol.admitted(slot.index), health_names.SERVING)
                log.info("worker %d admitted", slot.index)
            elif reply.status != health_names.SERVING and slot.admitted:
                slot.admitted = False
            await self._update_health()

    async def _leave(self, slot: Slot) -> None:
        slot.admitted = False
        if slot.watching is not None:
            slot.watching.cancel()
            await asyncio.gather(slot.watching, return_exceptions=True)
            slot.watching = None
        self._watch.leave(slot.index)
        with self._scraped:  # its counters live on in the sum; its gauges are gone
            if slot.last_scrape is not None:
                self._carried = carry(self._carried, slot.last_scrape)
            slot.last_scrape = None
            slot.generation += 1
        await self._health.set(protocol.admitted(slot.index), health_names.NOT_SERVING)
        await self._update_health()
        if slot.channel is not None:
            await slot.channel.close(None)
            slot.channel = None
        if slot.scrape_channel is not None:
            slot.scrape_channel.close()
            slot.scrape_channel = None

    async def _update_health(self) -> None:
        admitted = sum(slot.admitted for slot in self._slots)
        self.serving.set(admitted)
        if admitted == self.count:
            self._all_admitted.set()
        if not self._stopping.is_set():
            await self._health.set(
                health_names.SERVER,
                health_names.SERVING if admitted == self.count else health_names.NOT_SERVING,
            )

    async def _replay(self, slot: Slot) -> None:
        assert slot.channel is not None
        for model, (method, request) in self._changes.items():
            try:
                await slot.channel.unary_unary(method, None, None)(request)
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "worker %d: replaying %s for %s failed: %s", slot.index, method, model, exc.details()
                )

    # -- fan-out ---------------------------------------------------------------------------

    async def _broadcast(self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        metadata = {key: str(value) for key, value in context.invocation_metadata() or ()}
        method = metadata[protocol.METHOD_KEY]
        model = metadata.get(protocol.CHANGE_KEY)
        if model is None:
            return protocol.pack(await self._call_all(method, request, context))
        async with self._control:  # one change at a time, and none while a worker joins
            answers = await self._call_all(method, request, context)
            self._changes.pop(model, None)
            if not method.endswith("Unload") and not method.endswith("UnloadModel"):
                self._changes[model] = (method, request)
            elif await asyncio.get_running_loop().run_in_executor(
                None, (self.settings.repository / model).is_dir
            ):
                # A joining worker must hold it unloaded too. A model that only an upload
                # brought is gone with its unload: nothing to replay, and no entry per name.
                self._changes[model] = (method, request)
        return protocol.pack(answers)

    async def _call_all(
        self, method: str, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> list[bytes]:
        targets = [slot for slot in self._slots if slot.admitted and slot.channel is not None]
        if not targets:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is serving")
        timeout = context.time_remaining()
        results = await asyncio.gather(
            *(slot.channel.unary_unary(method, None, None)(request, timeout=timeout) for slot in targets),  # type: ignore[union-attr]
            return_exceptions=True,
        )
        answers: list[bytes] = []
        for slot, result in zip(targets, results, strict=True):
            if isinstance(result, grpc.aio.AioRpcError):
                reason = protocol.error_reason(result)
                await context.abort(
                    result.code(), f"worker {slot.index}: {result.details()}", trailing_metadata=reason
                )
            if isinstance(result, BaseException):
                raise result
            answers.append(result)
        return answers

    async def _watch_models(
        self, request: model_pb.WatchModelsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[model_pb.WatchModelsResponse]:
        try:
            async for event in self._watch.stream(request):
                yield event
        except OverflowError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def _ready_models(self) -> list[str]:
        slot = self._slots[0]
        if slot.channel is None:
            return []
        answer = await slot.channel.unary_unary(
            "/modelyard.inference.v1.ModelService/ListModels", None, None
        )(model_pb.ListModelsRequest().SerializeToString())
        models = model_pb.ListModelsResponse.FromString(answer).models
        return [m.name for m in models if m.default_version]

    # -- metrics ---------------------------------------------------------------------------

    def scrapes(self) -> tuple[list[Metric], list[tuple[int, str]]]:
        """The carried-over totals and each worker's latest scrape (on the HTTP thread). A worker
        that does not answer this time counts with its last scrape rather than vanishing."""
        with self._scraping:
            fresh: dict[int, tuple[int, str]] = {}
            for slot in list(self._slots):
                if not slot.admitted:
                    continue
                generation = slot.generation
                if slot.scrape_channel is None:
                    slot.scrape_channel = grpc.insecure_channel(self.folder.worker(slot.index))
                try:
                    text = slot.scrape_channel.unary_unary(protocol.METRICS, None, None)(
                        b"", timeout=SCRAPE_TIMEOUT_S
                    )
                except grpc.RpcError as exc:
                    log.warning("worker %d did not give its metrics: %s", slot.index, exc)
                    continue
                fresh[slot.index] = (generation, text.decode())
            with self._scraped:
                for slot in self._slots:
                    if slot.index in fresh and fresh[slot.index][0] == slot.generation:
                        slot.last_scrape = fresh[slot.index][1]
                texts = [(s.index, s.last_scrape) for s in self._slots if s.last_scrape is not None]
                return self._carried, texts


class _Scrapes:
    """The workers' series, summed, and each worker's request count (to see the spread)."""

    def __init__(self, supervisor: Supervisor) -> None:
        self._supervisor = supervisor

    def collect(self) -> Iterator[Metric]:
        carried, texts = self._supervisor.scrapes()
        yield from sum_families([carried, *(parse(text) for _, text in texts)])
        yield per_worker(
            "modelyard_worker_requests",
            "Requests answered by each worker process since it started.",
            texts,
            "modelyard_requests",
        )
