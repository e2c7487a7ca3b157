"""The worker's side: its place among the workers (from the supervisor's environment), model
control and reads fanned out through the supervisor, its scrape on its unix socket, and its
whole-service health following the supervisor's."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest

from modelyard.common import headers
from modelyard.common import health as health_names
from modelyard.service.api.errors import Context, abort
from modelyard.service.api.names import check_model
from modelyard.service.api.pipeline import Handler, Wrapper
from modelyard.service.errors import InvalidInput
from modelyard.service.workers import protocol
from modelyard.service.workers.merge import FANNED

log = logging.getLogger(__name__)

SetHealth = Callable[[str, "health_pb2.HealthCheckResponse.ServingStatus.ValueType"], Awaitable[None]]

# Reconnect quickly to a unix socket that is not there yet, or again.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 500),
]


@dataclass(frozen=True)
class WorkerRole:
    index: int
    folder: protocol.ControlFolder
    count: int = 1  # workers in all
    parent: int | None = None  # the supervisor's pid (it may be 1: PID 1 in a container)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> WorkerRole | None:
        environ = os.environ if environ is None else environ
        if protocol.ENV_CONTROL not in environ:
            return None
        return cls(
            int(environ[protocol.ENV_INDEX]),
            protocol.ControlFolder(Path(environ[protocol.ENV_CONTROL])),
            int(environ.get(protocol.ENV_COUNT, "1")),
            int(environ[protocol.ENV_PARENT]) if protocol.ENV_PARENT in environ else None,
        )


# Answered by the supervisor's merged watch, not by the worker's own servicer.
WATCH_MODELS = "/modelyard.inference.v1.ModelService/WatchModels"


def fan_out(link: WorkerLink) -> Wrapper:
    """The pipeline's fan-out (service/api/pipeline.py): the methods in merge.FANNED are answered
    by every worker through the supervisor, WatchModels by the supervisor's merged watch; the
    rest keep their own handler."""

    def wrap(method: str, handler: Handler) -> Handler:
        if method == WATCH_MODELS:
            return link.watch_handler()
        if method in FANNED:
            return link.fanned_handler(method)
        return handler

    return wrap


def _identity(data: bytes) -> bytes:
    return data


def metrics_handler(registry: CollectorRegistry) -> grpc.GenericRpcHandler[Any, Any]:
    """The worker's scrape, read by the supervisor (which serves the sum of all workers)."""

    async def scrape(request: bytes, context: Context) -> bytes:
        return generate_latest(registry)

    service, method = protocol.METRICS.strip("/").split("/")
    return grpc.method_handlers_generic_handler(
        service, {method: grpc.unary_unary_rpc_method_handler(scrape)}
    )


class WorkerLink:
    """This worker's channel to the supervisor."""

    def __init__(self, role: WorkerRole) -> None:
        self.role = role
        self._channel: grpc.aio.Channel | None = None
        self._following: asyncio.Task[None] | None = None
        self.service_serving = False  # the whole service (every worker) serving, as last heard

    @property
    def channel(self) -> grpc.aio.Channel:
        if self._channel is None:  # made on the event loop that serves
            self._channel = grpc.aio.insecure_channel(self.role.folder.coordinator, options=CHANNEL_OPTIONS)
        return self._channel

    def fanned_handler(self, method: str) -> Handler:
        fanned = FANNED[method]
        broadcast = None

        async def forward(request: bytes, context: Context) -> bytes:
            nonlocal broadcast
            if broadcast is None:
                broadcast = self.channel.unary_unary(protocol.BROADCAST, None, None)
            metadata = [(protocol.METHOD_KEY, method)]
            if fanned.changes:
                model = getattr(fanned.request.FromString(request), fanned.changes)
                try:  # before the name travels as metadata (which a NUL or 1 MB name breaks)
                    check_model(model, name_field=fanned.changes)
                except InvalidInput as exc:
                    await abort(context, exc, method, model)
                metadata.append((protocol.CHANGE_KEY, model))
            try:
                answers = await broadcast(request, metadata=metadata, timeout=context.time_remaining())
            except grpc.aio.AioRpcError as exc:
                reason = protocol.error_reason(exc)
                if reason:
                    context.set_trailing_metadata(reason)
                await context.abort(exc.code(), exc.details() or "")
            return fanned.merge(request, protocol.unpack(answers))

        return grpc.unary_unary_rpc_method_handler(
            forward, request_deserializer=_identity, response_serializer=_identity
        )

    def watch_handler(self) -> Handler:
        """WatchModels answered by the supervisor's merged watch (the same from every worker)."""

        async def forward(request: bytes, context: Context) -> AsyncIterator[bytes]:
            stream = self.channel.unary_stream(protocol.WATCH, None, None)(request)
            try:
                # The initial state's size, passed on before its events (the sidecar waits for
                # the whole of it; docs/api.md): the merged watch sends it in its metadata.
                count = dict(await stream.initial_metadata() or ()).get(headers.INITIAL_STATE_COUNT)
                if count is not None:
                    await context.send_initial_metadata(((headers.INITIAL_STATE_COUNT, count),))
                async for event in stream:
                    yield event
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "")

        return grpc.unary_stream_rpc_method_handler(
            forward, request_deserializer=_identity, response_serializer=_identity
        )

    async def wait_admitted(self) -> None:
        """Until the supervisor lets this worker take traffic (it replayed model control to it)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        request = health_pb2.HealthCheckRequest(service=protocol.admitted(self.role.index))
        async for reply in stub.Watch(request, wait_for_ready=True):
            if reply.status == health_names.SERVING:
                return
        raise RuntimeError("the supervisor ended the admission watch")

    def follow(self, set_health: SetHealth) -> None:
        """Report the whole service's health (every worker serving) as this worker's own."""
        self._following = asyncio.get_running_loop().create_task(self._follow(set_health))

    async def _follow(self, set_health: SetHealth) -> None:
        stub = health_pb2_grpc.HealthStub(self.channel)
        request = health_pb2.HealthCheckRequest(service=health_names.SERVER)
        while True:
            try:
                async for reply in stub.Watch(request, wait_for_ready=True):
                    self.service_serving = reply.status == health_names.SERVING
                    await set_health(
                        health_names.SERVER,
                        health_names.SERVING if self.service_serving else health_names.NOT_SERVING,
                    )
            except grpc.aio.AioRpcError:
                pass
            self.service_serving = False
            await set_health(health_names.SERVER, health_names.NOT_SERVING)  # the supervisor is unreachable
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        if self._following is not None:
            self._following.cancel()
            await asyncio.gather(self._following, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close(None)
