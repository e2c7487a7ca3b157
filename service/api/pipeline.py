"""The request pipeline: what every call passes before its servicer, as one ordered list of plain
wrappers applied to each method once, at registration.

A `Wrapper` takes a method's full name ("/package.Service/Method") and its handler (grpc's
RpcMethodHandler: call kind, serializers, behaviour) and returns the handler to register: the
same one where it does not apply, or one whose behaviour does its work around the one it wraps
(it may also change how gRPC hands over the request: without a deserializer, or as a
request stream). `register` applies the list in order, each wrapper to what the one before
returned, so the last one listed is the outermost: its behaviour is the one gRPC calls.

The handlers are built here from a servicer and its service's descriptor, as the generated
add_*Servicer_to_server functions build them, and found by one generic handler per `register`
(a dict by full method name). None is a grpc.aio registered method, as the generated functions
would make every method: grpc.aio's server keeps one pending request per registered method (and
one for all the rest) and waits on all of them with asyncio.wait each time calls come in, whose
Python visits every one of them: with every method of the services registered so, each call
would pay for all of them, a large share of a tiny model's whole request; the generic lookup is
one Python call and a dict lookup.

The lookup also keeps the call's request metadata (modelyard.process.request_metadata): gRPC builds
it for the lookup, and context.invocation_metadata() would build it again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass

from modelyard.process import request_metadata

# grpc's type stubs describe the sync API: a handler's behaviours and types are Any here.
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
Wrapper = Callable[[str, Handler], Handler]

if TYPE_CHECKING:
    _Generic = grpc.GenericRpcHandler[Any, Any]
else:  # not subscriptable at run time
    _Generic = grpc.GenericRpcHandler


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


class _Methods(_Generic):
    """The handlers of several services by full method name ("/package.Service/Method")."""

    def __init__(self, handlers: Mapping[str, Handler]) -> None:
        self._handlers = dict(handlers)

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        request_metadata.keep(handler_call_details.invocation_metadata)
        return self._handlers.get(handler_call_details.method)


def register(
    server: grpc.aio.Server, services: Iterable[ServiceHandlers], wrappers: Sequence[Wrapper]
) -> None:
    """Register every method of `services` on `server`, through `wrappers` (see `wrapped`), in
    one generic handler (no registered methods: see the module's docstring)."""
    handlers = {}
    for service in services:
        for name, handler in wrapped(service, wrappers).items():
            handlers[f"/{service.name}/{name}"] = handler
    server.add_generic_rpc_handlers((_Methods(handlers),))
