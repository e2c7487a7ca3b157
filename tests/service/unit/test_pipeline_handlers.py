"""The request pipeline's helper (service/api/pipeline.py): the handlers it builds from a servicer
and its descriptor are the ones the generated add_*Servicer_to_server functions build, and the
wrappers apply in the order listed, the last one outermost."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Mapping
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from modelyard.inference.v1 import (
    inference_service_pb2,
    inference_service_pb2_grpc,
    model_service_pb2,
    model_service_pb2_grpc,
)
from modelyard.kserve.v2 import grpc_service_pb2, grpc_service_pb2_grpc
from modelyard.process.request_metadata import invocation_metadata
from modelyard.service.api.pipeline import (
    Handler,
    ServiceHandlers,
    register,
    service_of,
    wrapped,
)

GENERATED: list[tuple[ServiceDescriptor, Callable[[Any, Any], None], type]] = [
    (
        inference_service_pb2.DESCRIPTOR.services_by_name["InferenceService"],
        inference_service_pb2_grpc.add_InferenceServiceServicer_to_server,
        inference_service_pb2_grpc.InferenceServiceServicer,
    ),
    (
        model_service_pb2.DESCRIPTOR.services_by_name["ModelService"],
        model_service_pb2_grpc.add_ModelServiceServicer_to_server,
        model_service_pb2_grpc.ModelServiceServicer,
    ),
    (
        grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"],
        grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server,
        grpc_service_pb2_grpc.GRPCInferenceServiceServicer,
    ),
    (
        health_pb2.DESCRIPTOR.services_by_name["Health"],
        health_pb2_grpc.add_HealthServicer_to_server,
        health.HealthServicer,
    ),
    (
        reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server,
        reflection_pb2_grpc.ServerReflectionServicer,
    ),
]


class _Recorder:
    """What the generated functions register (this test's only use of them)."""

    def __init__(self) -> None:
        self.registered: dict[str, Mapping[str, Handler]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, Handler]) -> None:
        self.registered[service] = handlers


@pytest.mark.parametrize("descriptor, add, servicer_class", GENERATED, ids=lambda v: getattr(v, "name", ""))
def test_handlers_are_those_of_the_generated_code(
    descriptor: ServiceDescriptor, add: Callable[[Any, Any], None], servicer_class: type
) -> None:
    servicer = servicer_class()
    recorder = _Recorder()
    add(servicer, recorder)
    service = service_of(descriptor, servicer)
    assert recorder.registered.keys() == {service.name}
    generated = recorder.registered[service.name]
    assert generated.keys() == service.handlers.keys()
    for name, handler in service.handlers.items():
        assert handler == generated[name], name  # kind, behaviour and serializers alike


def test_wrappers_apply_in_order_the_last_outermost() -> None:
    async def behaviour(request: Any, context: Any) -> Any:
        return request

    service = ServiceHandlers("pkg.S", {"M": grpc.unary_unary_rpc_method_handler(behaviour)})
    seen: list[tuple[str, str]] = []

    def tag(label: str) -> Callable[[str, Handler], Handler]:
        def wrap(method: str, handler: Handler) -> Handler:
            seen.append((label, method))
            inner: Any = handler  # a namedtuple (grpc's stubs do not say so)
            replaced: Handler = inner._replace(unary_unary=(label, inner.unary_unary))
            return replaced

        return wrap

    handlers = wrapped(service, [tag("inner"), tag("outer")])
    assert seen == [("inner", "/pkg.S/M"), ("outer", "/pkg.S/M")]
    outermost: Any = handlers["M"].unary_unary
    assert outermost == ("outer", ("inner", behaviour))


class _Server:
    """What `register` registers: the generic handlers and the registered methods."""

    def __init__(self) -> None:
        self.generic: list[Any] = []
        self.registered: dict[str, Mapping[str, Handler]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, Handler]) -> None:
        self.registered[service] = handlers

    def lookup(self, method: str) -> Handler | None:
        """As grpc.aio's server finds a method: registered first, then each generic handler."""
        service, name = method[1:].split("/")
        if name in self.registered.get(service, {}):
            return self.registered[service][name]
        details: Any = type("Details", (), {"method": method, "invocation_metadata": ()})()
        for generic in self.generic:
            found: Handler | None = generic.service(details)
            if found is not None:
                return found
        return None


def test_no_method_is_a_registered_method_and_every_method_is_found() -> None:
    # grpc.aio waits on one pending request per registered method at every call: none is one;
    # every method of every service is found through the one generic handler.
    services = [service_of(descriptor, servicer_class()) for descriptor, _, servicer_class in GENERATED]
    server = _Server()
    register(server, services, [])  # type: ignore[arg-type]  # a recorder, not a server
    assert server.registered == {}
    assert len(server.generic) == 1
    for service in services:
        for name, handler in service.handlers.items():
            assert server.lookup(f"/{service.name}/{name}") == handler, name
    assert server.lookup("/inference.GRPCInferenceService/NoSuchMethod") is None
    assert server.lookup("/no.Such/ModelInfer") is None


async def test_each_call_reads_its_own_request_metadata_from_its_lookup() -> None:
    # Every call waits until all have been looked up before it reads its metadata: each must
    # still read its own (the lookup's copy is per call, not the last lookup's).
    calls = 8
    arrived: list[str] = []
    everyone = asyncio.Event()

    async def behaviour(request: bytes, context: Any) -> bytes:
        arrived.append("")
        if len(arrived) == calls:
            everyone.set()
        await everyone.wait()
        return str(dict(invocation_metadata(context))["x-request-id"]).encode()

    service = ServiceHandlers("pkg.S", {"M": grpc.unary_unary_rpc_method_handler(behaviour)})
    server = grpc.aio.server()
    register(server, [service], [])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            method = channel.unary_unary("/pkg.S/M", None, None)
            answers = await asyncio.wait_for(
                asyncio.gather(*(method(b"", metadata=[("x-request-id", f"r{i}")]) for i in range(calls))), 30
            )
    finally:
        await server.stop(None)
    assert answers == [f"r{i}".encode() for i in range(calls)]


class _NoMetadata:
    def invocation_metadata(self) -> Any:
        return None


def test_a_handler_called_without_a_lookup_reads_the_context_metadata() -> None:
    # A handler that no lookup ran before (a test or a benchmark calling it directly), here in a
    # context of its own: the context's metadata (None from grpc where a call has none).
    assert contextvars.Context().run(invocation_metadata, _NoMetadata()) == ()
