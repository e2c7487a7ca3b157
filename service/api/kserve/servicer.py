"""inference.GRPCInferenceService: the KServe V2 / Open Inference Protocol with Triton's model
repository, configuration and statistics extensions, over the same data plane as our own API.

Each RPC checks the request's names, converts, and delegates: inference to the data plane
(tensors.py; classification in service/answers.py), the repository extension to the model control ModelService
shares (repository.py), Triton's ModelConfig to triton_config.py, statistics to statistics.py,
shared memory to shared_memory.py, log and trace settings to log_trace_settings.py."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing
from functools import partial
from typing import Literal, overload

import numpy as np

from modelyard.common.headers import DYE_SHADOW
from modelyard.common.names import is_valid_name
from modelyard.common.reasons import ErrorReason
from modelyard.kserve.v2 import grpc_service_pb2 as pb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as pb_grpc
from modelyard.service import __version__
from modelyard.service.api.errors import Context, abort, in_band_message, serving
from modelyard.service.api.kserve import (
    decoupled_decoder,
    log_trace_settings,
    repository,
    shared_memory,
    statistics,
)
from modelyard.service.api.kserve.decoupled import Responses
from modelyard.service.api.kserve.decoupled_decoder import DecoderResponses, text_decoder
from modelyard.service.api.kserve.log_trace_settings import LogSettings, TraceSettings
from modelyard.service.api.kserve.sequences import sequence_step
from modelyard.service.api.kserve.tensors import (
    NO_OPTIONS,
    decode_inputs,
    encode_outputs,
    output_options,
    parameter_value,
    requested_outputs,
)
from modelyard.service.api.kserve.triton_config import triton_config
from modelyard.service.api.metadata import call_fields
from modelyard.service.api.model_control import ModelControl
from modelyard.service.api.names import check_model, quoted
from modelyard.service.api.scheduling import kserve_priority, kserve_scheduling
from modelyard.service.api.tensor_headers import KServeSource, kserve_headers, kserve_plain
from modelyard.service.dataplane import Call, DataPlane, InferResult, TensorReader
from modelyard.service.errors import InvalidInput, ServiceError
from modelyard.service.generation.plane import GenerationPlane
from modelyard.service.intake import TensorHeader
from modelyard.service.metrics import ServiceMetrics
from modelyard.service.repository.uploads import UploadSpace
from modelyard.service.runtime.manager import ModelManager
from modelyard.service.runtime.served import ServedVersion
from modelyard.service.runtime.signature import TensorSpec
from modelyard.service.sequences.batcher import SequenceDirectory
from modelyard.service.sequences.step import Step
from modelyard.service.shm.registry import Regions, SharedMemoryRegistry
from modelyard.tensors import TensorError

# Triton's streaming parameters: the request asks, each response says whether it is the last.
ENABLE_FINAL_RESPONSE = "triton_enable_empty_final_response"
FINAL_RESPONSE = "triton_final_response"
EXTENSIONS = [
    "classification",
    "sequence",
    "model_repository",
    "schedule_policy",
    "model_configuration",
    "system_shared_memory",
    "statistics",
    "trace",
    "logging",
]


class KServeServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self,
        manager: ModelManager,
        dataplane: DataPlane,
        metrics: ServiceMetrics,
        shm: SharedMemoryRegistry | None = None,
        whole_service_ready: Callable[[], bool] | None = None,  # with workers: every worker serving
        uploads: UploadSpace | None = None,  # where a load's files go; None: no limit
        # Who a call's caller is, for the shared-memory regions it owns (Authorizer.identity).
        identify: Callable[[Context], str] = lambda context: "",
        server_name: str = "modelyard",  # ServerMetadata.name (--server-name; Triton's is "triton")
        # Where each live sequence lives (the batching layer's), for steps that name no version.
        sequences: SequenceDirectory | None = None,
        # Generate's path, for the decoder models' text on ModelStreamInfer (decoupled_decoder.py).
        generation: GenerationPlane | None = None,
    ) -> None:
        self._generation = generation
        self._identify = identify
        self._server_name = server_name
        self._sequences = sequences if sequences is not None else SequenceDirectory()
        self._manager = manager
        self._control = ModelControl(manager, uploads)
        self._whole_service_ready = whole_service_ready
        self._shm = shm if shm is not None else SharedMemoryRegistry()
        self._dataplane = dataplane
        self._metrics = metrics
        self._logs = LogSettings()
        self._traces = TraceSettings()
        # How the data plane reads a request's tensors (Call.take_inputs), made once.
        self._tensors = TensorReader(_headers_of, self._decode, kserve_plain)

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Context) -> pb.ServerReadyResponse:
        whole = self._whole_service_ready is None or self._whole_service_ready()
        return pb.ServerReadyResponse(ready=self._manager.loaded_all and whole)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Context) -> pb.ModelReadyResponse:
        try:
            check_model(request.name, request.version, name_field="name", version_field="version")
        except InvalidInput as exc:  # a name no model can have is not "not ready": it is refused
            await abort(context, exc, "ModelReady")
        try:
            self._manager.resolve(request.name, request.version)
        except ServiceError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: Context
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name=self._server_name, version=__version__, extensions=EXTENSIONS)

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: Context
    ) -> pb.ModelMetadataResponse:
        async with serving(context, self._metrics, "ModelMetadata", request.name) as call:
            check_model(request.name, request.version, name_field="name", version_field="version")
            served = self._manager.resolve(request.name, request.version)
            # The versions listed are read with the one that answers, with no await between: a
            # swap between them could list versions that leave that one out.
            if request.version:  # Triton: the requested version only
                versions = [str(served.version)]
            else:
                model = self._manager.served(request.name)
                versions = [str(v) for v in sorted(model.versions)] if model else []
            call.answered(str(served.version))
            signature = served.runner.signature
            # A decoder model shows the text tensors it answers on a stream (decoupled_decoder.py).
            inputs, outputs = decoupled_decoder.tensors(served) or (signature.inputs, signature.outputs)
            return pb.ModelMetadataResponse(
                name=request.name,
                versions=versions,
                platform=served.config.platform,  # onnxruntime_onnx, or ensemble
                inputs=[_tensor_metadata(t) for t in inputs],
                outputs=[_tensor_metadata(t) for t in outputs],
            )

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Context) -> pb.ModelInferResponse:
        model = request.model_name  # each read of a protobuf field makes a new object: read once
        # serving() by hand: the success path runs no coroutine of its own (two per call as a
        # context manager); an error awaits failed(), which answers it.
        call = serving(context, self._metrics, "ModelInfer", model)
        try:
            response, held = await self._infer(request, context, model)
            if held.dye:  # a proxy's call: it judges the version by its run's own timing
                call.answered_run(response.model_version, held.queue_ns, held.run_ns)
            else:
                call.answered(response.model_version)
        except BaseException as exc:
            await call.failed(exc)
            raise
        call.done()
        return response

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: Context
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        # Triton's streaming contract: each request gets one response on the stream, and a failed
        # request answers in-band with error_message instead of ending the stream; its reason
        # rides in infer_response.parameters["error_reason"] (Triton clients read error_message
        # first and ignore the rest). One stream may serve several models and versions: its
        # x-served-version (initial metadata, sent once) is the version of the first response,
        # absent when that response is an error; each response's model_version says the rest.
        first = True
        async for request in request_iterator:
            async with serving(context, self._metrics, "ModelStreamInfer", request.model_name) as call:
                try:
                    final_flag = _empty_final_response(request)
                    response, _ = await self._infer(request, context, request.model_name, decoupled=True)
                except (ServiceError, TensorError) as exc:
                    first = False
                    yield _in_band_error(request, exc, call.in_band(exc))
                    continue
                if isinstance(response, Responses | DecoderResponses):
                    # A decoupled version: 0..N responses, then (when asked) the empty final one.
                    try:
                        # aclosing: a client gone mid-way ends the request's work at once.
                        async with aclosing(
                            response.stream(final_flag, call, first, _in_band_failure)
                        ) as answers:
                            async for answer in answers:
                                first = False
                                yield answer
                    finally:
                        response.release()  # if the stream never started (the client left)
                    continue
                if first:
                    first = False
                    await call.stream_answered(response.model_version)
                else:
                    call.version = response.model_version
                if final_flag:
                    # One response per request: it is also the final one, so no empty response
                    # follows (Triton sends one only when the final flag comes apart from data).
                    response.parameters[FINAL_RESPONSE].bool_param = True
                yield pb.ModelStreamInferResponse(infer_response=response)

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Context) -> pb.ModelConfigResponse:
        async with serving(context, self._metrics, "ModelConfig", request.name) as call:
            check_model(request.name, request.version, name_field="name", version_field="version")
            served = self._manager.resolve(request.name, request.version)
            call.answered(str(served.version))
            config = triton_config(served)
            if text_decoder(served) is not None:
                decoupled_decoder.describe(config)
            return pb.ModelConfigResponse(config=config)

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: Context
    ) -> pb.ModelStatisticsResponse:
        async with serving(context, self._metrics, "ModelStatistics", request.name):
            # No name: every model's statistics.
            check_model(
                request.name, request.version, name_field="name", version_field="version", optional=True
            )
            return statistics.model_statistics(self._manager, request)

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: Context
    ) -> pb.RepositoryIndexResponse:
        return repository.index(self._manager, request)

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Context
    ) -> pb.RepositoryModelLoadResponse:
        async with serving(context, self._metrics, "RepositoryModelLoad", request.model_name):
            return await repository.load(self._control, request)

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Context
    ) -> pb.RepositoryModelUnloadResponse:
        async with serving(context, self._metrics, "RepositoryModelUnload", request.model_name):
            return await repository.unload(self._control, request)

    async def SystemSharedMemoryStatus(
        self, request: pb.SystemSharedMemoryStatusRequest, context: Context
    ) -> pb.SystemSharedMemoryStatusResponse:
        async with serving(context, self._metrics, "SystemSharedMemoryStatus", ""):
            return shared_memory.system_status(self._shm, request, self._identify(context))

    async def SystemSharedMemoryRegister(
        self, request: pb.SystemSharedMemoryRegisterRequest, context: Context
    ) -> pb.SystemSharedMemoryRegisterResponse:
        async with serving(context, self._metrics, "SystemSharedMemoryRegister", ""):
            return await shared_memory.system_register(self._shm, request, self._identify(context))

    async def SystemSharedMemoryUnregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest, context: Context
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        async with serving(context, self._metrics, "SystemSharedMemoryUnregister", ""):
            return shared_memory.system_unregister(self._shm, request, self._identify(context))

    async def CudaSharedMemoryStatus(
        self, request: pb.CudaSharedMemoryStatusRequest, context: Context
    ) -> pb.CudaSharedMemoryStatusResponse:
        async with serving(context, self._metrics, "CudaSharedMemoryStatus", ""):
            return shared_memory.cuda_status(request)

    async def CudaSharedMemoryRegister(
        self, request: pb.CudaSharedMemoryRegisterRequest, context: Context
    ) -> pb.CudaSharedMemoryRegisterResponse:
        async with serving(context, self._metrics, "CudaSharedMemoryRegister", ""):
            return shared_memory.cuda_register(request)

    async def CudaSharedMemoryUnregister(
        self, request: pb.CudaSharedMemoryUnregisterRequest, context: Context
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        async with serving(context, self._metrics, "CudaSharedMemoryUnregister", ""):
            return shared_memory.cuda_unregister(request)

    async def LogSettings(self, request: pb.LogSettingsRequest, context: Context) -> pb.LogSettingsResponse:
        async with serving(context, self._metrics, "LogSettings", ""):
            return log_trace_settings.answer_log_settings(self._logs, request)

    async def TraceSetting(
        self, request: pb.TraceSettingRequest, context: Context
    ) -> pb.TraceSettingResponse:
        async with serving(context, self._metrics, "TraceSetting", request.model_name):
            check_model(request.model_name, optional=True)  # no name: the global settings
            if request.model_name:
                self._manager.status(request.model_name)  # NOT_FOUND for a model it does not know
            return log_trace_settings.answer_trace_setting(self._traces, request)

    def _live_version(self, model: str, version: str, step: Step) -> ServedVersion | None:
        """The version a step's live sequence lives on, unless it is a START or names another."""
        if step.start:
            return None
        live = self._sequences.version_of(model, step.sequence_id)
        if live is None or version not in ("", live.version_name, f"v{live.version_name}"):
            return None
        return live

    @overload
    async def _infer(
        self, request: pb.ModelInferRequest, context: Context, model: str, decoupled: Literal[False] = False
    ) -> tuple[pb.ModelInferResponse, Call]: ...

    @overload
    async def _infer(
        self, request: pb.ModelInferRequest, context: Context, model: str, decoupled: Literal[True]
    ) -> tuple[pb.ModelInferResponse | Responses | DecoderResponses, Call]: ...

    async def _infer(
        self, request: pb.ModelInferRequest, context: Context, model: str, decoupled: bool = False
    ) -> tuple[pb.ModelInferResponse | Responses | DecoderResponses, Call]:
        """The answer, and the call that ran it (its run's queue and run time). `model`: the
        request's model_name (read once: each read of a field is a new object). On a stream
        (`decoupled`), a decoupled version's request answers decoupled.Responses instead, which
        holds the version's lease until its last response (DecoderResponses for a decoder model's
        text, which Generate's path answers)."""
        parameters = request.parameters
        if parameters:
            priority, step = kserve_priority(parameters), sequence_step(parameters)
        else:  # most requests
            priority, step = 0, None
        version, request_id, priority, dye = call_fields(
            context, model, request.model_version, request.id, priority
        )
        # One version for the whole request: its limits check the tensors, its priority levels
        # and label files apply, and it runs. A sequence's step goes where its sequence lives
        # (a reload meanwhile leaves a live sequence on its version until it ends).
        if step is not None and (live := self._live_version(model, version, step)) is not None:
            held = self._dataplane.hold(live, dye)
        else:
            held = self._dataplane.open(model, version, dye)
        with held:  # the request's lease, released when the block ends (dataplane.Call)
            if text_decoder(held.served) is not None:  # Triton's LLM tensors: decoupled_decoder.py
                text = DecoderResponses.open(
                    self._generation,
                    held,
                    request,
                    context,
                    request_id,
                    priority,
                    self._regions(context),
                    decoupled,
                )
                return text, held
            # Each container read once (each read of a protobuf field makes a new object).
            tensors, outputs = request.inputs, request.outputs
            source = (tensors, request.raw_input_contents, request, context)
            inputs = await held.take_inputs(len(tensors), len(outputs), source, self._tensors)
            if outputs:
                names, options = requested_outputs(outputs), output_options(outputs)
            else:  # every output, asked nothing (most requests): no call to say so
                names, options = [], NO_OPTIONS
            scheduling = kserve_scheduling(context, parameters, priority, dye == DYE_SHADOW)
            if scheduling.priority:  # (most requests ask none)
                scheduling = held.levelled(scheduling)
            if decoupled and (responses := held.responses(inputs, names, scheduling, bool(options.in_shm))):
                own, results = responses
                answered = partial(_answered, request_id, options.classify, own)
                return Responses(own, results, answered, request), held
            if step is not None:
                result = await held.infer_step(inputs, names, scheduling, step)
            else:
                result = await held.infer(inputs, names, scheduling)
        # Fields set one by one: cheaper than the constructor's keywords (and no empty id set).
        response = pb.ModelInferResponse()
        response.model_name, response.model_version = result.model, str(result.version)
        if request_id:
            response.id = request_id
        if options is NO_OPTIONS:
            encode_outputs(response, result.outputs)
        else:
            regions = partial(self._regions, context)
            answers = await held.answer(result.outputs, options.classify, options.in_shm, regions)
            encode_outputs(response, answers, options.in_shm)
        return response, held

    def _regions(self, context: Context) -> Regions:
        """The caller's shared memory regions (its identity asked only if a region is named)."""
        return self._shm.of(partial(self._identify, context))

    def _decode(self, source: KServeSource) -> dict[str, np.ndarray]:
        """A request's tensors that are not plain (BYTES, typed contents, shared memory)."""
        _, _, request, context = source
        return decode_inputs(request, self._regions(context))


def _headers_of(source: KServeSource) -> list[TensorHeader]:
    return kserve_headers(source[2])


def _answered(
    request_id: str, classify: Mapping[str, int], held: Call, result: InferResult
) -> pb.ModelInferResponse:
    """One response of a decoupled request (its outputs inline: no shared memory)."""
    response = pb.ModelInferResponse()
    response.model_name, response.model_version = result.model, str(result.version)
    if request_id:
        response.id = request_id
    # A decoupled response's outputs are classified as one flat list each (not row by row).
    encode_outputs(
        response, held.classified(result.outputs, classify, by_row=False) if classify else result.outputs
    )
    return response


# The in-band error's parameter that carries its x-error-reason value on a KServe stream.
ERROR_REASON_PARAMETER = "error_reason"


def _in_band_error(
    request: pb.ModelInferRequest, exc: Exception, reason: ErrorReason
) -> pb.ModelStreamInferResponse:
    # The request's name only when it is one (an answer never carries an unbounded echo).
    name = request.model_name if is_valid_name(request.model_name) else ""
    failed = pb.ModelInferResponse(model_name=name, id=request.id)
    failed.parameters[ERROR_REASON_PARAMETER].string_param = reason.value
    message = in_band_message(exc, "ModelStreamInfer", request.model_name)
    return pb.ModelStreamInferResponse(error_message=message, infer_response=failed)


def _in_band_failure(
    request: pb.ModelInferRequest, exc: Exception, call: serving
) -> pb.ModelStreamInferResponse:
    return _in_band_error(request, exc, call.in_band(exc))


def _empty_final_response(request: pb.ModelInferRequest) -> bool:
    """Whether the client asked for Triton's final-response flag on a stream."""
    if ENABLE_FINAL_RESPONSE not in request.parameters:
        return False
    value = parameter_value(request.parameters[ENABLE_FINAL_RESPONSE])
    if not isinstance(value, bool):
        raise InvalidInput(f"request parameter {ENABLE_FINAL_RESPONSE!r} must be a bool, got {quoted(value)}")
    return value


def _tensor_metadata(spec: TensorSpec) -> pb.ModelMetadataResponse.TensorMetadata:
    return pb.ModelMetadataResponse.TensorMetadata(name=spec.name, datatype=spec.datatype, shape=spec.shape)
