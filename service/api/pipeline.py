"""The request pipeline: what every call passes before its servicer, as one ordered list of plain
wrappers applied to each method once, at registration.

A `Wrapper` takes a method's full name ("/package.Service/Method") and its handler (grpc's
RpcMethodHandler: call kind, serializers, behaviour) and returns the handler to register: the
same one where it does not apply, or one whose behaviour does its work around the one it wraps
(it may also change how gRPC hands over the request: without a deserializer, or as a
request stream). `register` applies the list in order, each wrapper to what the one before
returned, so the last one listed is the outermost: its behaviour is the one gRPC calls.

The handlers are built here from a servicer and its service's descriptor, as the generated
add_*Servicer_to_server functions build them. Every method is served through a generic handler;
only the few hot ones named in `register`'s `fast` are also registered methods. grpc.aio's server
keeps one pending request per registered method (and one for all the rest), and waits on all of
them with asyncio.wait each time calls come in, whose Python visits every one of them: each
registered method cost every call of every method ~5.7k instructions (33 of them: 170k, a fifth
of a tiny model's whole request). A method served only generically costs its own calls one
generic lookup more (a Python call per service before its own).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass

# grpc's type stubs describe the sync API: a handler's behaviours and types are Any here.
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
Wrapper = Callable[[str, Handler], Handler]

# The four call kinds, by (request streaming, response streaming).
_HANDLER_OF_KIND = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


@dataclass(frozen=True)
class ServiceHandlers:
    """One gRPC service's method handlers, by method name, before the pipeline."""

    name: str  # the full service name: "package.Service"
    handlers: Mapping[str, Handler]


def service_of(descriptor: ServiceDescriptor, servicer: object) -> ServiceHandlers:
    """The handlers of `servicer`'s methods (the generated servicer class's where it has none:
    they answer UNIMPLEMENTED), each of its kind, parsing and serializing its message types."""
    handlers: dict[str, Handler] = {}
    for method in descriptor.methods:
        make: Any = _HANDLER_OF_KIND[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=GetMessageClass(method.input_type).FromString,
            response_serializer=GetMessageClass(method.output_type).SerializeToString,
        )
    return ServiceHandlers(descriptor.full_name, handlers)


def wrapped(service: ServiceHandlers, wrappers: Sequence[Wrapper]) -> dict[str, Handler]:
    """Each of the service's handlers with the wrappers applied in order (the last outermost)."""
    handlers = {}
    for name, handler in service.handlers.items():
        method = f"/{service.name}/{name}"
        for wrap in wrappers:
            handler = wrap(method, handler)
        handlers[name] = handler
    return handlers


def register(
    server: grpc.aio.Server,
    services: Iterable[ServiceHandlers],
    wrappers: Sequence[Wrapper],
    fast: Collection[str] = (),
) -> None:
    """Register every method of `services` on `server`, through `wrappers` (see `wrapped`): each
    in a generic handler, and those named in `fast` (full names, "/package.Service/Method") as
    registered methods too, grpc.aio's direct lookup (see the module's docstring: few)."""
    for service in services:
        handlers = wrapped(service, wrappers)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.name, handlers),))
        registered = {name: h for name, h in handlers.items() if f"/{service.name}/{name}" in fast}
        if registered:
            # grpc.aio.Server has it (the generated code calls it); the type stubs lag behind.
            server.add_registered_method_handlers(service.name, registered)  # type: ignore[attr-defined]
