"""Health's Check and Watch are served through a generic handler only (no grpc.aio registered
method: each one costs every call of the server a pending request that asyncio.wait visits)."""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from modelyard.common import health as health_names


class _Recorder:
    def __init__(self) -> None:
        self.registered: list[str] = []

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: object) -> None:
        self.registered.append(service)


def test_the_generated_function_would_register_methods_and_ours_registers_none() -> None:
    recorder = _Recorder()
    servicer = health_names.new_servicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, recorder)
    assert recorder.registered == ["grpc.health.v1.Health"]  # what generic_handlers avoids
    found = health_names.generic_handlers(servicer)
    assert len(found) == 1
    details: Any = type(
        "Details", (), {"method": "/grpc.health.v1.Health/Check", "invocation_metadata": ()}
    )()
    assert found[0].service(details) is not None


async def test_check_and_watch_answer_through_the_generic_handler() -> None:
    servicer = health_names.new_servicer()
    await servicer.set("models/m", health_names.SERVING)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(health_names.generic_handlers(servicer))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            answer = await stub.Check(health_pb2.HealthCheckRequest(service="models/m"), timeout=10)
            assert answer.status == health_names.SERVING
            watch = stub.Watch(health_pb2.HealthCheckRequest(service="models/m"), timeout=10)
            first = await watch.read()
            assert isinstance(first, health_pb2.HealthCheckResponse) and first.status == health_names.SERVING
            watch.cancel()
    finally:
        await server.stop(None)
