"""The parent of the service's worker processes. The worker supervisor (modelyard.process.supervisor)
holds the port, starts N workers, restarts one that dies and drains them all on SIGTERM; here: a
worker is admitted once its repository is loaded (model control replayed to it first), model
control fans out to every worker (and is kept to replay), their health and model state are joined,
and one /metrics sums them.

It imports no model runtime: it speaks to the workers over gRPC on unix sockets."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from modelyard.common import headers
from modelyard.common import health as health_names
from modelyard.inference.v1 import model_service_pb2 as model_pb
from modelyard.process.lifecycle import bound
from modelyard.process.metrics_http import MetricsServer
from modelyard.process.metrics_sum import per_worker
from modelyard.process.settings import split_address
from modelyard.process.supervisor import WorkerFailed, WorkerKind, Workers, WorkerSlot
from modelyard.process.tls import TlsFiles
from modelyard.service.settings import ENV_PREFIX, Settings
from modelyard.service.workers import protocol
from modelyard.service.workers.member import CHANNEL_OPTIONS
from modelyard.service.workers.metrics_sum import parse, sum_families
from modelyard.service.workers.watch import MergedWatch

__all__ = ["Supervisor", "WorkerFailed"]

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 5.0
KIND = WorkerKind(
    "modelyard.service",
    ENV_PREFIX,
    "worker",
    stop_margin_s=15,
    restarts=("modelyard_worker_restarts", "Worker processes restarted after they died."),
    serving=("modelyard_workers_serving", "Worker processes taking traffic."),
)


@dataclass
class Slot(WorkerSlot):  # serving: admitted (its repository loaded, model control replayed)
    channel: grpc.aio.Channel | None = None
    scrape_channel: grpc.Channel | None = None  # sync: scrapes run on the HTTP thread
    watching: asyncio.Task[None] | None = None  # its WatchModels, followed for the merged watch


@dataclass
class Supervisor:
    settings: Settings
    count: int
    folder: protocol.ControlFolder = field(init=False)
    _workers: Workers[Slot] = field(init=False)
    _coordinator: grpc.aio.Server | None = None
    _health: Any = None
    _metrics_server: MetricsServer | None = None
    # Model control applied to every worker, last call per model, replayed to a worker that joins.
    _changes: dict[str, tuple[str, bytes]] = field(default_factory=dict)
    _control: asyncio.Lock = field(default_factory=asyncio.Lock)
    _watch: MergedWatch = field(default_factory=MergedWatch)
    # One scrape at a time, so that a later scrape never keeps older values.
    _scraping: threading.Lock = field(default_factory=threading.Lock)
    _registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self._workers = Workers(KIND, self.settings, self.count, self._registry, Slot, self, log)

    @property
    def _slots(self) -> list[Slot]:
        return self._workers.slots

    async def start(self) -> None:
        self.folder = protocol.ControlFolder(Path(tempfile.mkdtemp(prefix="modelyard-workers-")))
        self._workers.reserve()
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
        registry = self._registry
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
        await self._workers.start()
        models = await self._ready_models()
        log.info(
            "serving gRPC on %s%s; models ready: %s; workers: %d",
            self._workers.address,
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
        self._workers.stopping.set()
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        for slot in self._slots:  # its model-state stream would hold the worker's drain open
            if slot.watching is not None:
                slot.watching.cancel()
        await self._workers.stop()
        if self._coordinator is not None:
            await self._coordinator.stop(0)
        if self._metrics_server is not None:
            self._metrics_server.stop()
        self._workers.release()
        with contextlib.suppress(AttributeError):
            shutil.rmtree(self.folder.path, ignore_errors=True)

    # -- workers ---------------------------------------------------------------------------

    def worker_environment(self, index: int) -> dict[str, str]:
        return {
            ENV_PREFIX + "METRICS_LISTEN": "",  # the supervisor serves the sum
            protocol.ENV_CONTROL: str(self.folder.path),
            protocol.ENV_INDEX: str(index),
            protocol.ENV_COUNT: str(self.count),
            protocol.ENV_PARENT: str(os.getpid()),
        }

    async def worker_joins(self, slot: Slot) -> None:
        """Once the worker has loaded its repository: replay model control to it, then admit it
        (it opens the shared port then). Follow its readiness from then on."""
        slot.channel = grpc.aio.insecure_channel(self.folder.worker(slot.index), options=CHANNEL_OPTIONS)
        stub = health_pb2_grpc.HealthStub(slot.channel)
        request = health_pb2.HealthCheckRequest(service=protocol.LOCAL)
        async for reply in stub.Watch(request, wait_for_ready=True):
            if reply.status == health_names.SERVING and not slot.serving:
                async with self._control:
                    await self._replay(slot)
                    slot.watching = await self._watch.join(slot.index, slot.channel)
                    self._workers.serves(slot)
                await self._health.set(protocol.admitted(slot.index), health_names.SERVING)
                log.info("worker %d admitted", slot.index)
            elif reply.status != health_names.SERVING and slot.serving:
                slot.serving = False
            await self._update_health()

    async def worker_left(self, slot: Slot) -> None:
        """After its process exited (its scrape is folded into the totals already)."""
        if slot.watching is not None:
            slot.watching.cancel()
            await asyncio.gather(slot.watching, return_exceptions=True)
            slot.watching = None
        self._watch.leave(slot.index)
        await self._health.set(protocol.admitted(slot.index), health_names.NOT_SERVING)
        await self._update_health()
        if slot.channel is not None:
            await slot.channel.close(None)
            slot.channel = None
        if slot.scrape_channel is not None:
            slot.scrape_channel.close()
            slot.scrape_channel = None

    async def _update_health(self) -> None:
        admitted = self._workers.update()
        if not self._workers.stopping.is_set():
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
        targets = [slot for slot in self._workers.serving_slots() if slot.channel is not None]
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
        async def announce(count: int) -> None:
            await context.send_initial_metadata(((headers.INITIAL_STATE_COUNT, str(count)),))

        try:
            async for event in self._watch.stream(request, announce):
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
                if not slot.serving:
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
            with self._workers.scraped:
                for slot in self._slots:
                    if slot.index in fresh and fresh[slot.index][0] == slot.generation:
                        slot.last_scrape = fresh[slot.index][1]
                texts = [(s.index, s.last_scrape) for s in self._slots if s.last_scrape is not None]
                return self._workers.carried, texts


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
