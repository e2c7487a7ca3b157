"""modelyard.inference.v1.InferenceService: thin, converts and delegates to the data plane."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import aclosing

import grpc
import numpy as np

from modelyard.common import headers
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.inference.v1 import tensor_pb2
from modelyard.service.api.errors import Context, deadline_passed, end_stalled, serving
from modelyard.service.api.generation_convert import headers_early, to_generate_params, to_generate_response
from modelyard.service.api.metadata import call_fields
from modelyard.service.api.scheduling import scheduling
from modelyard.service.api.tensor_headers import our_headers, our_plain
from modelyard.service.dataplane import DataPlane, TensorReader
from modelyard.service.generation.plane import GenerationPlane
from modelyard.service.metrics import ServiceMetrics
from modelyard.tensors import datatype_value, to_arrays, to_tensors, to_wire

_SHADOW = headers.DYE_SHADOW
# After a write fails in gRPC's core, the most its word that the client cancelled may take.
CANCEL_WAIT_S = 5.0


async def write(context: Context, message: pb.GenerateResponse) -> None:
    """One message of the stream. A client that cancels while this write waits on flow control (it
    stopped reading: a paused sequence) fails the write before gRPC has marked the call cancelled,
    and gRPC would log that as an ERROR with a traceback. The cancellation follows at once: wait
    for it, so the call ends as the cancel it is (CANCELLED, no error logged). A write failure
    that no cancel follows is raised (an INTERNAL answer, logged)."""
    try:
        await context.write(message)
    except grpc.aio.InternalError:  # ExecuteBatchError: the write batch failed in core
        await asyncio.sleep(CANCEL_WAIT_S)  # cancelled meanwhile, by gRPC
        raise


def _response(
    model: str, version: str, outputs: Mapping[str, np.ndarray], request_id: str
) -> pb.InferResponse:
    """An Infer answer, each output added in place (to_tensors' Tensors would be built apart and
    then copied into the message: a second copy of every output)."""
    # Fields set one by one: cheaper than the constructor's keywords (and no empty id set).
    response = pb.InferResponse()
    response.model_name, response.model_version = model, version
    if request_id:
        response.request_id = request_id
    add = response.outputs.add
    for name, array in outputs.items():
        datatype, raw = to_wire(array)
        add(name=name, datatype=datatype_value(datatype), shape=array.shape, raw_data=raw)
    return response


# Our API's tensors, for the data plane (Call.take_inputs): a plain request's fixed-size
# datatypes decode from their checked headers; InferStream's decode as any other's.
OUR_TENSORS = TensorReader(our_headers, to_arrays, our_plain)
STREAMED_TENSORS: TensorReader[Iterable[tensor_pb2.Tensor]] = TensorReader(our_headers, to_arrays)


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    def __init__(self, dataplane: DataPlane, generation: GenerationPlane, metrics: ServiceMetrics) -> None:
        self._dataplane = dataplane
        self._generation = generation
        self._metrics = metrics

    async def Infer(self, request: pb.InferRequest, context: Context) -> pb.InferResponse:
        # Each field read once: each read of a protobuf field makes a new object.
        model, tensors, output_names = request.model_name, request.inputs, request.output_names
        # serving() by hand (as KServe's ModelInfer): no coroutine of its own on success.
        call = serving(context, self._metrics, "Infer", model)
        try:
            version, request_id, priority, dye = call_fields(
                context, model, request.model_version, request.request_id, request.priority
            )
            with self._dataplane.open(model, version, dye) as held:  # the request's lease
                inputs = await held.take_inputs(len(tensors), len(output_names), tensors, OUR_TENSORS)
                result = await held.infer(
                    inputs, output_names, scheduling(context, priority, request.timeout_us, dye == _SHADOW)
                )
            version = str(result.version)
            if dye:  # a proxy's call: it judges the version by its run's own timing
                call.answered_run(version, held.queue_ns, held.run_ns)
            else:
                call.answered(version)
            response = _response(result.model, version, result.outputs, request_id)
        except BaseException as exc:
            await call.failed(exc)
            raise
        call.done()
        return response

    async def InferStream(
        self, request: pb.InferStreamRequest, context: Context
    ) -> AsyncIterator[pb.InferStreamResponse]:
        async with serving(context, self._metrics, "InferStream", request.model_name) as call:
            version, request_id, priority, _ = call_fields(
                context, request.model_name, request.model_version, request.request_id, request.priority
            )
            # The whole stream holds the one version it resolved; a cancelled stream lets go of
            # it at once (the `with` and aclosing end with the handler, not at garbage collection).
            with self._dataplane.open(request.model_name, version) as held:
                tensors = request.inputs
                # Decoded in the executor when large (a stream's batch often is).
                inputs = await held.take_inputs(
                    len(tensors), len(request.output_names), tensors, STREAMED_TENSORS
                )
                chunks = held.infer_chunks(
                    inputs,
                    request.output_names,
                    request.chunk_size,
                    scheduling(context, priority, request.timeout_us),
                )
                async with aclosing(chunks):
                    index = 0
                    async for result in chunks:
                        if not index:  # every chunk comes from the same version
                            await call.stream_answered(str(result.version))
                        yield pb.InferStreamResponse(
                            model_name=result.model,
                            model_version=call.version,
                            outputs=to_tensors(result.outputs),
                            request_id=request_id,
                            chunk_index=index,
                            row_offset=result.row_offset,
                            last=result.last,
                        )
                        index += 1

    # The reader/writer form (a coroutine that writes, not a generator that yields): a write that
    # fails because the client has gone fails here, where it can be told from a fault (gone_client).
    async def Generate(  # type: ignore[override]
        self, request: pb.GenerateRequest, context: Context
    ) -> None:
        async with serving(context, self._metrics, "Generate", request.model_name) as call:
            version, request_id, priority, _ = call_fields(
                context, request.model_name, request.model_version, request.request_id, request.priority
            )
            # x-served-version goes out once the request is accepted, overlapping its prefill (its
            # batch off the first token's path); a canary attempt's waits for its first token.
            accepted = (lambda served: call.stream_answered(str(served))) if headers_early(context) else None
            events = self._generation.generate(
                request.model_name,
                version,
                to_generate_params(request),
                scheduling(context, priority, request.timeout_us),
                deadline_passed=lambda: deadline_passed(context),
                on_stalled=lambda error: end_stalled(context, error),
                accepted=accepted,
            )
            # aclosing: a cancelled stream leaves its batch and releases its lease at once.
            async with aclosing(events):
                async for event in events:
                    if not call.version:  # held for the first token; every event is from its version
                        await call.stream_answered(str(event.version))
                    await write(context, to_generate_response(event, request_id))
