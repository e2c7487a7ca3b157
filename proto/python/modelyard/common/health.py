"""grpc.health.v1 for every process: the service names (the server as a whole, and one per
model), the statuses, and what the processes use of grpcio-health-checking's asyncio servicer."""

from __future__ import annotations

from typing import Any, Protocol

from grpc_health.v1 import health, health_pb2

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
