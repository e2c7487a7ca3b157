"""A request that passed the model's declared checks and then failed inside its graph has its own
reason, `model_rejected` (issue 34), told apart from one that failed those checks
(`invalid_argument`), on our Infer, KServe's ModelInfer and the KServe stream.

A real service in this process, real ONNX Runtime sessions: model `m` whose version 1 adds 1 and
whose version 2 has a plausible canary bug, a Reshape of its [batch, 4] input to the constant
[1, 4]: it serves batch 1 (as its warm-up ran) and fails at batch 2.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from models.demo_models import BATCH_DIM, make_model, write_model
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kgrpc
from modelyard.service.server import Service
from modelyard.tensors import to_array, to_tensor
from tests.support import serving

FEATURES = 4


def _graph(nodes: list[onnx.NodeProto], initializers: list[TensorProto], name: str) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, [BATCH_DIM, FEATURES])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, [BATCH_DIM, FEATURES])],
        initializers,
    )
    return make_model(graph, name)


def adds_one() -> onnx.ModelProto:
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    return _graph([helper.make_node("Add", ["INPUT0", "one"], ["OUTPUT0"])], [one], "adds_one")


def reshape_bug() -> onnx.ModelProto:
    """Adds 1 too, but through a Reshape to the constant [1, 4]: right at batch 1 only."""
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [1, FEATURES])
    nodes = [
        helper.make_node("Reshape", ["INPUT0", "shape"], ["row"]),
        helper.make_node("Add", ["row", "one"], ["OUTPUT0"]),
    ]
    return _graph(nodes, [one, shape], "reshape_bug")


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[Service]:
    root = tmp_path / "models"
    # ONNX Runtime reads the bug's output as [1, 4]: a schema of its own beside version 1's.
    config = {"version_policy": {"all": {}}, "reload": {"allow_schema_change": True}}
    write_model(root, "m", 1, adds_one(), config)
    write_model(root, "m", 2, reshape_bug(), config)
    async with serving(root) as running:
        yield running


@pytest.fixture
async def channel(service: Service) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(service.address) as channel:
        yield channel


def _reason(error: grpc.aio.AioRpcError) -> str:
    metadata: Any = error.trailing_metadata() or ()
    return next((str(value) for key, value in metadata if key == "x-error-reason"), "")


def ours(version: str, rows: int, features: int = FEATURES) -> pb.InferRequest:
    x = np.ones((rows, features), np.float32)
    return pb.InferRequest(model_name="m", model_version=version, inputs=[to_tensor("INPUT0", x)])


def kserve(version: str, rows: int, features: int = FEATURES) -> kpb.ModelInferRequest:
    x = np.ones((rows, features), np.float32)
    request = kpb.ModelInferRequest(model_name="m", model_version=version, id=f"{version}-{rows}")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    return request


async def test_a_graph_that_refuses_a_conforming_request_is_model_rejected_on_our_api(
    channel: grpc.aio.Channel,
) -> None:
    stub: Any = pb_grpc.InferenceServiceStub(channel)
    served = await stub.Infer(ours("1", 2), timeout=10)
    assert to_array(served.outputs[0]).tolist() == [[2.0] * FEATURES] * 2
    assert to_array((await stub.Infer(ours("2", 1), timeout=10)).outputs[0]).tolist() == [[2.0] * 4]

    with pytest.raises(grpc.aio.AioRpcError) as rejected:
        await stub.Infer(ours("2", 2), timeout=10)
    assert rejected.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert _reason(rejected.value) == "model_rejected"
    details = rejected.value.details() or ""
    assert "reshape" in details.lower() and "version 2" in details
    assert "/" not in details and "::" not in details  # no ONNX Runtime source paths or C++ names

    # What fails the declared checks keeps invalid_argument, on either version.
    for version in ("1", "2"):
        with pytest.raises(grpc.aio.AioRpcError) as invalid:
            await stub.Infer(ours(version, 2, features=3), timeout=10)
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert _reason(invalid.value) == "invalid_argument"
    # And the version that refused still serves what it can.
    assert to_array((await stub.Infer(ours("2", 1), timeout=10)).outputs[0]).tolist() == [[2.0] * 4]


async def test_the_same_on_kserve_model_infer(channel: grpc.aio.Channel) -> None:
    stub: Any = kgrpc.GRPCInferenceServiceStub(channel)
    assert (await stub.ModelInfer(kserve("1", 2), timeout=10)).model_version == "1"
    assert (await stub.ModelInfer(kserve("2", 1), timeout=10)).model_version == "2"
    with pytest.raises(grpc.aio.AioRpcError) as rejected:
        await stub.ModelInfer(kserve("2", 2), timeout=10)
    assert rejected.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert _reason(rejected.value) == "model_rejected"
    with pytest.raises(grpc.aio.AioRpcError) as invalid:
        await stub.ModelInfer(kserve("2", 2, features=3), timeout=10)
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _reason(invalid.value) == "invalid_argument"


async def test_the_kserve_stream_answers_each_in_band_with_its_reason(channel: grpc.aio.Channel) -> None:
    stub: Any = kgrpc.GRPCInferenceServiceStub(channel)
    requests = [kserve("2", 2), kserve("2", 2, features=3), kserve("2", 1), kserve("1", 2)]
    answers = [answer async for answer in stub.ModelStreamInfer(iter(requests), timeout=30)]
    assert len(answers) == 4  # each request its answer; the stream goes on past the errors
    rejected, invalid, served, stable = answers
    assert rejected.infer_response.parameters["error_reason"].string_param == "model_rejected"
    assert "reshape" in rejected.error_message.lower()
    assert rejected.infer_response.id == "2-2"
    assert invalid.infer_response.parameters["error_reason"].string_param == "invalid_argument"
    assert not served.error_message and served.infer_response.model_version == "2"
    assert not stable.error_message and stable.infer_response.model_version == "1"
