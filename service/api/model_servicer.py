"""modelyard.inference.v1.ModelService: list, describe, load, unload and watch models."""

from __future__ import annotations

from collections.abc import AsyncIterator

from google.protobuf.timestamp_pb2 import Timestamp

from modelyard.common import headers
from modelyard.inference.v1 import model_service_pb2 as pb
from modelyard.inference.v1 import model_service_pb2_grpc as pb_grpc
from modelyard.service.api.convert import to_specs
from modelyard.service.api.errors import Context, serving
from modelyard.service.api.model_control import ModelControl
from modelyard.service.api.names import check_model, check_names
from modelyard.service.errors import ModelUnavailable
from modelyard.service.generation.model import DecoderModel
from modelyard.service.metrics import ServiceMetrics
from modelyard.service.runtime.manager import ModelManager
from modelyard.service.runtime.status import ModelEvent, ModelStatus, VersionState, WatchOverflow

PLATFORM = "onnxruntime_onnx"


def state_value(state: VersionState) -> pb.ModelState.ValueType:
    return pb.ModelState.Value(f"MODEL_STATE_{state.value}")


def timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def describe(status: ModelStatus) -> pb.Model:
    model = pb.Model(
        name=status.name, max_batch_size=status.max_batch_size, platform=PLATFORM, reason=status.reason
    )
    for version in status.versions.values():
        entry = model.versions.add(
            version=str(version.version),
            state=state_value(version.state),
            reason=version.reason,
            updated_at=timestamp(version.updated_at),
            execution_provider=version.provider,
        )
        if isinstance(version.kind, DecoderModel):
            entry.generation.CopyFrom(generation(version.kind))
        if version.signature is not None:
            entry.inputs.extend(to_specs(version.signature.inputs))
            entry.outputs.extend(to_specs(version.signature.outputs))
            if version.version == status.default_version:
                model.inputs.extend(entry.inputs)
                model.outputs.extend(entry.outputs)
                if entry.HasField("generation"):
                    model.generation.CopyFrom(entry.generation)
    if status.default_version is not None:
        model.default_version = str(status.default_version)
    return model


def generation(decoder: DecoderModel) -> pb.Generation:
    """What a decoder version generates with, as its export states it."""
    return pb.Generation(
        context_length=decoder.context_length,
        context_source=decoder.context_source,
        eos_token_ids=sorted(decoder.codec.eos_ids) if decoder.codec else [],
        chat_template=decoder.chat is not None,
        max_tokens=decoder.settings.max_tokens,
    )


class ModelServicer(pb_grpc.ModelServiceServicer):
    def __init__(self, manager: ModelManager, metrics: ServiceMetrics) -> None:
        self._manager = manager
        self._control = ModelControl(manager)  # it brings no files: no upload space
        self._metrics = metrics

    async def ListModels(self, request: pb.ListModelsRequest, context: Context) -> pb.ListModelsResponse:
        async with serving(context, self._metrics, "ListModels", ""):
            return pb.ListModelsResponse(models=[describe(s) for s in self._manager.statuses()])

    async def GetModel(self, request: pb.GetModelRequest, context: Context) -> pb.GetModelResponse:
        async with serving(context, self._metrics, "GetModel", request.name):
            check_model(request.name, name_field="name")
            return pb.GetModelResponse(model=describe(self._manager.status(request.name)))

    async def LoadModel(self, request: pb.LoadModelRequest, context: Context) -> pb.LoadModelResponse:
        async with serving(context, self._metrics, "LoadModel", request.name):
            return pb.LoadModelResponse(model=describe(await self._control.load(request.name, "name")))

    async def UnloadModel(self, request: pb.UnloadModelRequest, context: Context) -> pb.UnloadModelResponse:
        async with serving(context, self._metrics, "UnloadModel", request.name):
            return pb.UnloadModelResponse(model=describe(await self._control.unload(request.name, "name")))

    async def WatchModels(
        self, request: pb.WatchModelsRequest, context: Context
    ) -> AsyncIterator[pb.WatchModelsResponse]:
        wanted = set(request.names)
        async with serving(context, self._metrics, "WatchModels", ""):
            check_names(request.names, "names")
            with self._manager.watch() as watcher:  # subscribe before the snapshot: no change is missed
                if request.send_initial_state:
                    snapshot = [
                        _change(ModelEvent(status.name, v.version, v.state, v.reason, v.updated_at))
                        for status in self._manager.statuses()
                        if not wanted or status.name in wanted
                        for v in status.versions.values()
                    ]
                    # How many events the initial state is, before them: a watcher (the sidecar)
                    # knows when it has the whole of it, an empty repository (0) included, which
                    # sends no event at all.
                    await context.send_initial_metadata(((headers.INITIAL_STATE_COUNT, str(len(snapshot))),))
                    for initial in snapshot:
                        yield initial
                while True:
                    try:
                        event = await watcher.get()
                    except WatchOverflow as exc:
                        raise ModelUnavailable(str(exc)) from None
                    if wanted and event.model not in wanted:
                        continue
                    yield _change(event)


def _change(event: ModelEvent) -> pb.WatchModelsResponse:
    return pb.WatchModelsResponse(
        model_name=event.model,
        version=str(event.version),
        state=state_value(event.state),
        reason=event.reason,
        time=timestamp(event.time),
    )
