"""grpc.health.v1 for every process: the service names (the server as a whole, and one per
model), the statuses, and what the processes use of grpcio-health-checking's asyncio servicer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

SERVER = ""  # the whole server: SERVING once it serves, NOT_SERVING while starting or stopping
MODEL_PREFIX = "models/"

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def model_service_name(model: str) -> str:
    """The health service name that reports one model's readiness (SERVING while a version serves)."""
    return MODEL_PREFIX + model


class HealthServicer(Protocol):
    """What the processes use of grpcio-health-checking's asyncio servicer (its stubs omit it)."""

    async def set(
        self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType
    ) -> None: ...

    async def enter_graceful_shutdown(self) -> None: ...


def new_servicer() -> HealthServicer:
    servicer: Any = health.aio.HealthServicer()  # type: ignore[attr-defined]
    return servicer  # type: ignore[no-any-return]


class _GenericOnly:
    """Takes what a generated add_*Servicer_to_server function adds, keeping its generic handler."""

    def __init__(self) -> None:
        self.handlers: Sequence[Any] = ()

    def add_generic_rpc_handlers(self, handlers: Sequence[Any]) -> None:
        self.handlers = tuple(handlers)

    def add_registered_method_handlers(self, service: str, handlers: object) -> None:
        pass  # the point: none (see generic_handlers)


def generic_handlers(servicer: HealthServicer) -> Sequence[grpc.GenericRpcHandler[Any, Any]]:
    """Check and Watch for server.add_generic_rpc_handlers, and not also as grpc.aio registered
    methods, as the generated add_HealthServicer_to_server makes them: grpc.aio's server keeps one
    pending request per registered method and waits on all of them each time calls come in, so
    every registered method adds work to every other call, proxied calls included (the figure is
    in docs/benchmarks.md, "Costs the code is shaped by")."""
    collected = _GenericOnly()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, collected)
    return collected.handlers
