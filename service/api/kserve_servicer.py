"""inference.GRPCInferenceService: the KServe V2 / Open Inference Protocol with Triton's model
repository, configuration and statistics extensions, over the same data plane as our own API."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial

import grpc
from modelyard.kserve.v2 import grpc_service_pb2 as pb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as pb_grpc
from modelyard.kserve.v2 import model_config_pb2 as config_pb
from modelyard.tensors import TensorError

from service import __version__
from service.api.errors import Context, code_for, internal_error, serving
from service.api.kserve_tensors import decode_inputs, encode_outputs, requested_outputs
from service.api.scheduling import kserve_scheduling
from service.api.tensor_headers import kserve_headers
from service.dataplane import DataPlane
from service.errors import ModelLoadError, ServiceError, Unsupported
from service.metrics import ServiceMetrics
from service.repository.config import ModelConfig
from service.runtime.manager import ModelManager
from service.runtime.served import ServedVersion
from service.runtime.signature import TensorSpec
from service.runtime.status import VersionState
from service.scheduling.queue import QueuePolicy

PLATFORM = "onnxruntime_onnx"
EXTENSIONS = ["model_repository", "model_configuration", "statistics"]
# Triton reports a model's state with these words in its repository index.
_INDEX_STATE = {
    VersionState.LOADING: "LOADING",
    VersionState.READY: "READY",
    VersionState.FAILED: "UNAVAILABLE",
    VersionState.DRAINING: "UNLOADING",
    VersionState.UNLOADED: "UNAVAILABLE",
}


class KServeServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, manager: ModelManager, dataplane: DataPlane, metrics: ServiceMetrics) -> None:
        self._manager = manager
        self._dataplane = dataplane
        self._metrics = metrics

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._manager.loaded_all)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Context) -> pb.ModelReadyResponse:
        try:
            self._manager.resolve(request.name, request.version)
        except ServiceError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: Context
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="modelyard", version=__version__, extensions=EXTENSIONS)

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: Context
    ) -> pb.ModelMetadataResponse:
        async with serving(context, self._metrics, "ModelMetadata", request.name):
            served = self._manager.resolve(request.name, request.version)
            model = self._manager.served(request.name)
            signature = served.runner.signature
            return pb.ModelMetadataResponse(
                name=request.name,
                versions=[str(v) for v in sorted(model.versions)] if model else [],
                platform=PLATFORM,
                inputs=[_tensor_metadata(t) for t in signature.inputs],
                outputs=[_tensor_metadata(t) for t in signature.outputs],
            )

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Context) -> pb.ModelInferResponse:
        async with serving(context, self._metrics, "ModelInfer", request.model_name) as call:
            response = await self._infer(request, context)
            call.version = response.model_version
            return response

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: Context
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        # Triton's streaming contract: each request gets one response on the stream, and a failed
        # request answers in-band with error_message instead of ending the stream.
        async for request in request_iterator:
            async with serving(context, self._metrics, "ModelStreamInfer", request.model_name) as call:
                try:
                    response = await self._infer(request, context)
                except (ServiceError, TensorError) as exc:
                    message = str(exc)
                    if code_for(exc) == grpc.StatusCode.INTERNAL:  # ours: logged under an error id
                        message = internal_error("ModelStreamInfer", request.model_name, message)
                    yield pb.ModelStreamInferResponse(error_message=message)
                    continue
                call.version = response.model_version
                yield pb.ModelStreamInferResponse(infer_response=response)

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Context) -> pb.ModelConfigResponse:
        async with serving(context, self._metrics, "ModelConfig", request.name):
            served = self._manager.resolve(request.name, request.version)
            return pb.ModelConfigResponse(config=_triton_config(served))

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: Context
    ) -> pb.ModelStatisticsResponse:
        async with serving(context, self._metrics, "ModelStatistics", request.name):
            if request.name:
                chosen = [self._manager.resolve(request.name, request.version)]
                if not request.version:  # Triton: no version means every served version
                    model = self._manager.served(request.name)
                    chosen = list(model.versions.values()) if model else chosen
            else:
                chosen = [
                    v
                    for s in self._manager.statuses()
                    if (m := self._manager.served(s.name))
                    for v in m.versions.values()
                ]
            return pb.ModelStatisticsResponse(model_stats=[_statistics(v) for v in chosen])

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: Context
    ) -> pb.RepositoryIndexResponse:
        response = pb.RepositoryIndexResponse()
        for status in self._manager.statuses():
            if not status.versions and not request.ready:
                response.models.add(name=status.name, state="UNAVAILABLE", reason=status.reason)
            for version in status.versions.values():
                if request.ready and version.state != VersionState.READY:
                    continue
                response.models.add(
                    name=status.name,
                    version=str(version.version),
                    state=_INDEX_STATE[version.state],
                    reason=version.reason,
                )
        return response

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Context
    ) -> pb.RepositoryModelLoadResponse:
        async with serving(context, self._metrics, "RepositoryModelLoad", request.model_name):
            overrides = sorted(k for k in request.parameters if k == "config" or k.startswith("file:"))
            if overrides:
                # Triton loads a config (and files) sent with the call; this server serves the
                # repository as it is on disk, so it refuses rather than ignore them silently.
                raise Unsupported(
                    f"RepositoryModelLoad parameters {', '.join(overrides)} are not supported: models are "
                    "loaded as the repository holds them (edit config.yaml there)"
                )
            status = await self._manager.load(request.model_name)
            if status.default_version is None:
                reasons = [status.reason] + [v.reason for v in status.versions.values() if v.reason]
                raise ModelLoadError(
                    f"failed to load {request.model_name!r}: {'; '.join(r for r in reasons if r)}"
                )
            return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Context
    ) -> pb.RepositoryModelUnloadResponse:
        async with serving(context, self._metrics, "RepositoryModelUnload", request.model_name):
            await self._manager.unload(request.model_name)
            return pb.RepositoryModelUnloadResponse()

    async def _infer(self, request: pb.ModelInferRequest, context: Context) -> pb.ModelInferResponse:
        # Decoded only once the tensors' headers fit the model (service/intake.py).
        headers = kserve_headers(request)
        inputs = await self._dataplane.decode(
            request.model_name, request.model_version, headers, partial(decode_inputs, request)
        )
        result = await self._dataplane.infer(
            request.model_name,
            request.model_version,
            inputs,
            requested_outputs(request),
            kserve_scheduling(context, request.parameters),
        )
        response = pb.ModelInferResponse(
            model_name=result.model, model_version=str(result.version), id=request.id
        )
        encode_outputs(response, result.outputs)
        return response


def _tensor_metadata(spec: TensorSpec) -> pb.ModelMetadataResponse.TensorMetadata:
    return pb.ModelMetadataResponse.TensorMetadata(name=spec.name, datatype=spec.datatype, shape=spec.shape)


def _triton_type(datatype: str) -> config_pb.DataType.ValueType:
    return config_pb.DataType.Value("TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}")


def _triton_config(served: ServedVersion) -> config_pb.ModelConfig:
    signature = served.runner.signature
    config: ModelConfig = served.config
    # Triton's dims leave out the batch dimension when the model batches.
    skip = 1 if signature.max_batch_size else 0
    triton = config_pb.ModelConfig(
        name=served.model,
        platform=PLATFORM,
        backend="onnxruntime",
        max_batch_size=signature.max_batch_size,
        input=[
            config_pb.ModelInput(name=t.name, data_type=_triton_type(t.datatype), dims=t.shape[skip:])
            for t in signature.inputs
        ],
        output=[
            config_pb.ModelOutput(name=t.name, data_type=_triton_type(t.datatype), dims=t.shape[skip:])
            for t in signature.outputs
        ],
        instance_group=[
            config_pb.ModelInstanceGroup(
                kind=config_pb.ModelInstanceGroup.KIND_GPU
                if "CUDA" in served.runner.provider
                else config_pb.ModelInstanceGroup.KIND_CPU,
                count=1,
            )
        ],
    )
    policy = config.version_policy
    if policy.kind == "latest":
        triton.version_policy.latest.num_versions = policy.latest
    elif policy.kind == "specific":
        triton.version_policy.specific.versions.extend(policy.versions)
    else:
        triton.version_policy.all.SetInParent()
    if config.dynamic_batching is not None:
        batching = config.dynamic_batching
        admission = batching.admission
        triton.dynamic_batching.max_queue_delay_microseconds = batching.max_queue_delay_us
        triton.dynamic_batching.preferred_batch_size.extend(batching.preferred_batch_sizes)
        triton.dynamic_batching.priority_levels = admission.priority_levels
        triton.dynamic_batching.default_priority_level = admission.default_priority_level
        triton.dynamic_batching.default_queue_policy.CopyFrom(_queue_policy(admission.default_queue_policy))
        for level, level_policy in admission.priority_queue_policy:
            triton.dynamic_batching.priority_queue_policy[level].CopyFrom(_queue_policy(level_policy))
    return triton


def _queue_policy(policy: QueuePolicy) -> config_pb.ModelQueuePolicy:
    return config_pb.ModelQueuePolicy(
        timeout_action=config_pb.ModelQueuePolicy.REJECT,
        default_timeout_microseconds=policy.default_timeout_us,
        allow_timeout_override=policy.allow_timeout_override,
        max_queue_size=policy.max_queue_size,
    )


def _statistics(served: ServedVersion) -> pb.ModelStatistics:
    stats = served.stats
    return pb.ModelStatistics(
        name=served.model,
        version=str(served.version),
        last_inference=stats.last_inference_ms,
        inference_count=stats.inference_count,
        execution_count=stats.execution_count,
        inference_stats=pb.InferStatistics(
            success=pb.StatisticDuration(count=stats.success_count, ns=stats.success_ns),
            fail=pb.StatisticDuration(count=stats.fail_count, ns=stats.fail_ns),
            # perf_analyzer finds the version it measured by the queue count that grew.
            queue=pb.StatisticDuration(count=stats.queue_count, ns=stats.queue_ns),
            # Tensor conversion is not timed apart: it is inside the queue time (input) and the
            # request total (output). The counts must match compute_infer's for perf_analyzer.
            compute_input=pb.StatisticDuration(count=stats.execution_count),
            compute_infer=pb.StatisticDuration(count=stats.execution_count, ns=stats.compute_ns),
            compute_output=pb.StatisticDuration(count=stats.execution_count),
        ),
    )
