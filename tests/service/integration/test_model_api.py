"""ModelService, health, reflection and metrics against the real service on loopback."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from models import demo_models
from modelyard.common import headers
from modelyard.common.health import model_service_name
from modelyard.inference.v1 import inference_service_pb2 as ipb
from modelyard.inference.v1 import inference_service_pb2_grpc as ipb_grpc
from modelyard.inference.v1 import model_service_pb2 as pb
from modelyard.inference.v1 import model_service_pb2_grpc as pb_grpc
from modelyard.inference.v1 import tensor_pb2
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from modelyard.tensors import to_tensor
from tests.support import eventually

READY = pb.MODEL_STATE_READY


@pytest.fixture
def models(channel: grpc.aio.Channel) -> pb_grpc.ModelServiceStub:
    return pb_grpc.ModelServiceStub(channel)


async def test_list_and_describe(models) -> None:
    listing = await models.ListModels(pb.ListModelsRequest())
    assert [m.name for m in listing.models] == ["classifier", "mixed", "scaler"]
    scaler = (await models.GetModel(pb.GetModelRequest(name="scaler"))).model
    assert (
        scaler.default_version == "2"
        and scaler.max_batch_size == 64
        and scaler.platform == "onnxruntime_onnx"
    )
    assert [(v.version, v.state) for v in scaler.versions] == [("1", READY), ("2", READY)]
    assert all(v.execution_provider == "CPUExecutionProvider" for v in scaler.versions)
    classifier = (await models.GetModel(pb.GetModelRequest(name="classifier"))).model
    (spec,) = classifier.inputs
    assert (spec.name, spec.datatype, list(spec.shape)) == ("INPUT0", tensor_pb2.DATA_TYPE_FP32, [-1, 64])
    assert [list(o.shape) for o in classifier.outputs] == [[-1, 8]]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await models.GetModel(pb.GetModelRequest(name="nope"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.service_settings(management_open=True)
async def test_unload_then_load_is_watched(models, channel) -> None:
    infer = ipb_grpc.InferenceServiceStub(channel)
    x = ipb.InferRequest(model_name="scaler", inputs=[to_tensor("INPUT0", np.ones((1, 16), np.float32))])
    events: list[tuple[str, str, int]] = []
    stream = models.WatchModels(pb.WatchModelsRequest(names=["scaler"], send_initial_state=True))
    # The initial state (both versions READY) says the watch is subscribed: nothing after escapes it.
    initial = {((await stream.read()).version) for _ in range(2)}
    assert initial == {"1", "2"}

    async def watch() -> None:
        while (change := await stream.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
            events.append((change.model_name, change.version, change.state))

    watcher = asyncio.ensure_future(watch())
    unloaded = (await models.UnloadModel(pb.UnloadModelRequest(name="scaler"))).model
    assert {v.state for v in unloaded.versions} == {pb.MODEL_STATE_UNLOADED} and not unloaded.default_version
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await infer.Infer(x)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    loaded = (await models.LoadModel(pb.LoadModelRequest(name="scaler"))).model
    assert loaded.default_version == "2"
    assert (await infer.Infer(x)).model_version == "2"
    await eventually(lambda: len(events) == 8, "both versions' four events")
    watcher.cancel()
    stream.cancel()
    states = [(v, s) for _, v, s in events]
    for version in ("1", "2"):
        mine = [s for v, s in states if v == version]
        assert mine == [pb.MODEL_STATE_DRAINING, pb.MODEL_STATE_UNLOADED, pb.MODEL_STATE_LOADING, READY]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await models.LoadModel(pb.LoadModelRequest(name="nope"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_watch_initial_state(models) -> None:
    stream = models.WatchModels(pb.WatchModelsRequest(send_initial_state=True))
    seen = set()
    async for change in stream:
        seen.add((change.model_name, change.version, change.state))
        if len(seen) == 4:
            break
    stream.cancel()
    assert seen == {
        ("classifier", "1", READY),
        ("mixed", "1", READY),
        ("scaler", "1", READY),
        ("scaler", "2", READY),
    }


async def test_watch_says_how_many_events_the_initial_state_is(models, tmp_path: Path) -> None:
    """x-initial-state-count, in the initial metadata before the initial state: its events (the
    selected ones), 0 for an empty repository (which sends none)."""
    stream = models.WatchModels(pb.WatchModelsRequest(send_initial_state=True))
    assert dict(await stream.initial_metadata())[headers.INITIAL_STATE_COUNT] == "4"
    stream.cancel()
    stream = models.WatchModels(pb.WatchModelsRequest(names=["scaler"], send_initial_state=True))
    assert dict(await stream.initial_metadata())[headers.INITIAL_STATE_COUNT] == "2"
    assert {(await stream.read()).version for _ in range(2)} == {"1", "2"}
    stream.cancel()
    (tmp_path / "empty").mkdir()
    service = build_service(Settings(repository=tmp_path / "empty", listen="127.0.0.1:0", metrics_listen=""))
    await service.start()
    try:
        async with grpc.aio.insecure_channel(service.address) as chan:
            empty = pb_grpc.ModelServiceStub(chan).WatchModels(pb.WatchModelsRequest(send_initial_state=True))
            assert dict(await empty.initial_metadata())[headers.INITIAL_STATE_COUNT] == "0"
            empty.cancel()
    finally:
        await service.stop(grace_s=1.0)


async def test_health_overall_and_per_model(service: Service, channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    check = await health.Check(health_pb2.HealthCheckRequest(service=""))
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    # Per-model health follows model events: watch it change.
    watch = health.Watch(health_pb2.HealthCheckRequest(service=model_service_name("classifier")))
    statuses = []
    while (reply := await watch.read()).status != health_pb2.HealthCheckResponse.SERVING:
        statuses.append(reply.status)
    await service.manager.unload("classifier")
    while (reply := await watch.read()).status != health_pb2.HealthCheckResponse.NOT_SERVING:
        statuses.append(reply.status)
    watch.cancel()
    assert all(s == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN for s in statuses)


async def test_reflection_lists_services(channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)

    async def requests():
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    async for response in stub.ServerReflectionInfo(requests()):
        names = {s.name for s in response.list_services_response.service}
        break
    assert {
        "modelyard.inference.v1.InferenceService",
        "modelyard.inference.v1.ModelService",
        "inference.GRPCInferenceService",
        "grpc.health.v1.Health",
    } <= names


async def test_metrics_count_requests_by_model_version_method_code(service: Service, channel) -> None:
    infer = ipb_grpc.InferenceServiceStub(channel)
    good = ipb.InferRequest(
        model_name="scaler", model_version="1", inputs=[to_tensor("INPUT0", np.ones((1, 16), np.float32))]
    )
    for _ in range(3):
        await infer.Infer(good)
    with pytest.raises(grpc.aio.AioRpcError):
        await infer.Infer(ipb.InferRequest(model_name="scaler", inputs=[]))
    with pytest.raises(grpc.aio.AioRpcError):
        await infer.Infer(ipb.InferRequest(model_name="made-up-name"))
    body = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://{service.metrics_address}/metrics", timeout=5).read().decode()
    )
    assert 'modelyard_requests_total{code="OK",method="Infer",model="scaler",version="1"} 3.0' in body
    # A failed request counts with the version that was resolved for it (no pin: the newest, 2).
    assert (
        'modelyard_requests_total{code="INVALID_ARGUMENT",method="Infer",model="scaler",version="2"} 1.0'
        in body
    )
    # A made-up model name does not become a label of its own.
    assert 'code="NOT_FOUND",method="Infer",model="_unknown"' in body and "made-up-name" not in body
    assert (
        'modelyard_request_duration_seconds_count{code="OK",method="Infer",model="scaler",version="1"} 3.0'
        in body
    )
    assert 'modelyard_model_versions_ready{model="scaler"} 2.0' in body


async def test_a_broken_model_fails_alone(tmp_path: Path) -> None:
    root = tmp_path / "models"
    demo_models.write_model(root, "good", 1, demo_models.scaled_identity(4, 2.0), {"max_batch_size": 8})
    (root / "corrupt" / "1").mkdir(parents=True)
    (root / "corrupt" / "1" / "model.onnx").write_bytes(b"this is not an onnx model")
    demo_models.write_model(root, "badconfig", 1, demo_models.scaled_identity(4, 2.0))
    (root / "badconfig" / "config.yaml").write_text("max_batch_size: 8\nmax_batchsize: 9\n")
    demo_models.write_model(
        root,
        "mismatch",
        1,
        demo_models.scaled_identity(4, 2.0),
        {"max_batch_size": 8, "inputs": [{"name": "INPUT0", "datatype": "INT64", "shape": [-1, 4]}]},
    )
    (root / "empty").mkdir()
    service = build_service(Settings(repository=root, listen="127.0.0.1:0", metrics_listen=""))
    await service.start()
    try:
        statuses = {s.name: s for s in service.manager.statuses()}
        assert statuses["good"].default_version == 1
        assert "onnxruntime cannot load it" in statuses["corrupt"].versions[1].reason
        assert "max_batchsize" in statuses["badconfig"].reason
        assert (
            "INT64" in statuses["mismatch"].versions[1].reason
            and "FP32" in statuses["mismatch"].versions[1].reason
        )
        assert "no version folder" in statuses["empty"].reason
        async with grpc.aio.insecure_channel(service.address) as chan:
            infer = ipb_grpc.InferenceServiceStub(chan)
            ok = await infer.Infer(
                ipb.InferRequest(model_name="good", inputs=[to_tensor("INPUT0", np.ones((1, 4), np.float32))])
            )
            assert ok.model_version == "1"
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await infer.Infer(ipb.InferRequest(model_name="corrupt"))
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "onnxruntime cannot load it" in caught.value.details()
            model = (await pb_grpc.ModelServiceStub(chan).GetModel(pb.GetModelRequest(name="corrupt"))).model
            assert (
                model.versions[0].state == pb.MODEL_STATE_FAILED
                and "corrupt/1/model.onnx" in model.versions[0].reason
            )
    finally:
        await service.stop(grace_s=1.0)


async def test_model_file_escaping_the_repository_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    demo_models.write_model(outside, "evil", 1, demo_models.scaled_identity(4, 2.0))
    root = tmp_path / "models"
    (root / "evil" / "1").mkdir(parents=True)
    (root / "evil" / "1" / "model.onnx").symlink_to(outside / "evil" / "1" / "model.onnx")
    service = build_service(Settings(repository=root, listen="127.0.0.1:0", metrics_listen=""))
    await service.start()
    try:
        status = service.manager.status("evil")
        assert status.default_version is None and "outside the model repository" in status.reason
    finally:
        await service.stop(grace_s=1.0)


async def test_external_data_escaping_the_version_folder_is_refused(tmp_path: Path) -> None:
    """A model whose initializer points outside its folder (`../../secret`) never loads."""
    from onnx import TensorProto, helper

    (tmp_path / "secret.bin").write_bytes(np.ones(4, np.float32).tobytes())
    root = tmp_path / "models"
    weight = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[4], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", "../../../secret.bin"), ("offset", "0"), ("length", "16")):
        weight.external_data.add(key=key, value=value)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "W"], ["y"])],
        "escape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [weight],
    )
    (root / "evil" / "1").mkdir(parents=True)
    # helper.make_model, not demo_models.make_model: onnx's own checker would refuse to build it.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", demo_models.OPSET)])
    model.ir_version = demo_models.IR_VERSION
    (root / "evil" / "1" / "model.onnx").write_bytes(model.SerializeToString())
    demo_models.write_model(root, "good", 1, demo_models.scaled_identity(4, 2.0))
    service = build_service(Settings(repository=root, listen="127.0.0.1:0", metrics_listen=""))
    await service.start()
    try:
        status = service.manager.status("evil")
        assert status.default_version is None
        assert "escapes model directory" in status.versions[1].reason
        assert service.manager.status("good").default_version == 1
    finally:
        await service.stop(grace_s=1.0)
