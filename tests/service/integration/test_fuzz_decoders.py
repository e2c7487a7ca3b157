"""Property-based: random tensors, shapes, datatypes and byte lengths thrown at both APIs. Every
answer is OK or a client error (never INTERNAL or UNKNOWN), and the server stays healthy."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from models import demo_models
from modelyard.inference.v1 import inference_service_pb2 as ipb
from modelyard.inference.v1 import inference_service_pb2_grpc as ipb_grpc
from modelyard.inference.v1 import tensor_pb2
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kpb_grpc
from modelyard.tensors import NUMPY_BY_NAME, datatype_value
from tests.support import ServiceProcess, start_service_process

CLIENT_ERRORS = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNIMPLEMENTED,
}
MODELS = ["classifier", "scaler", "mixed", "echo", "missing"]
NAMES = ["INPUT0", "a", "b", "text", "x", ""]
DATATYPES = [*NUMPY_BY_NAME, "FLOAT", "BF16", ""]
DIMS = [0, 1, 2, 3, 4, 16, 64, 65, 2**31, 2**62, -1]
FIELDS = {
    "BOOL": "bool_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
EXAMPLES = 150


def echo() -> Any:
    """A BYTES model: text [-1] -> the same strings."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["text"], ["same"])],
        "echo",
        [helper.make_tensor_value_info("text", TensorProto.STRING, ["n"])],
        [helper.make_tensor_value_info("same", TensorProto.STRING, ["n"])],
    )
    return demo_models.make_model(graph)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    root: Path = tmp_path_factory.mktemp("fuzz") / "models"
    demo_models.build_demo_repository(root)
    demo_models.write_model(root, "echo", 1, echo())
    process = start_service_process(root)
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def channel(server: ServiceProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.address) as chan:
        yield chan


@st.composite
def tensors(draw: st.DrawFn) -> dict[str, Any]:
    datatype = draw(st.sampled_from(DATATYPES))
    shape = draw(st.lists(st.sampled_from(DIMS), max_size=4))
    itemsize = NUMPY_BY_NAME[datatype].itemsize if datatype in NUMPY_BY_NAME and datatype != "BYTES" else 4
    fits = 0 <= math.prod(shape) * itemsize <= 4096 if all(d >= 0 for d in shape) else False
    # The right length half the time, when there is one: such requests may well be served.
    size = math.prod(shape) * itemsize if fits and draw(st.booleans()) else draw(st.integers(0, 300))
    if datatype == "BYTES" and draw(st.booleans()):
        items = draw(st.lists(st.binary(max_size=8), max_size=20))
        data = b"".join(len(i).to_bytes(4, "little") + i for i in items)
    else:
        data = draw(st.binary(min_size=size, max_size=size))
    return {
        "name": draw(st.sampled_from(NAMES)),
        "datatype": datatype,
        "shape": shape,
        "data": data,
        "typed": draw(st.booleans()),
        "count": draw(st.integers(0, 70)),
    }


requests = st.tuples(st.sampled_from(MODELS), st.lists(tensors(), min_size=0, max_size=3))


def code_of(call: Any) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=requests)
def test_our_api_answers_ok_or_a_client_error(channel: grpc.Channel, request: Any) -> None:
    model, specs = request
    inputs = []
    for spec in specs:
        value: Any = datatype_value(spec["datatype"]) if spec["datatype"] in NUMPY_BY_NAME else 99
        inputs.append(
            tensor_pb2.Tensor(name=spec["name"], datatype=value, shape=spec["shape"], raw_data=spec["data"])
        )
    stub = ipb_grpc.InferenceServiceStub(channel)
    code = code_of(lambda: stub.Infer(ipb.InferRequest(model_name=model, inputs=inputs), timeout=30))
    assert code in CLIENT_ERRORS, (code, model, specs)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=requests, raw=st.booleans())
def test_kserve_api_answers_ok_or_a_client_error(channel: grpc.Channel, request: Any, raw: bool) -> None:
    model, specs = request
    message = kpb.ModelInferRequest(model_name=model)
    for spec in specs:
        tensor = message.inputs.add(name=spec["name"], datatype=spec["datatype"], shape=spec["shape"])
        if raw:
            message.raw_input_contents.append(spec["data"])
        elif spec["typed"] and spec["datatype"] in FIELDS:
            field = FIELDS[spec["datatype"]]
            values: list[Any]
            if field == "bytes_contents":
                values = [bytes([i % 256]) for i in range(spec["count"])]
            elif field == "bool_contents":
                values = [i % 2 == 0 for i in range(spec["count"])]
            elif field.startswith("fp"):
                values = [float(i) for i in range(spec["count"])]
            else:
                values = [i * 37 % 200 for i in range(spec["count"])]
            getattr(tensor.contents, field).extend(values)
    stub = kpb_grpc.GRPCInferenceServiceStub(channel)
    code = code_of(lambda: stub.ModelInfer(message, timeout=30))
    assert code in CLIENT_ERRORS, (code, model, specs, raw)


def test_the_server_is_healthy_afterwards(server: ServiceProcess, channel: grpc.Channel) -> None:
    """Runs after the property tests (file order): still serving, still answering correctly."""
    assert server.proc.poll() is None
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    tensor = tensor_pb2.Tensor(
        name="INPUT0", datatype=tensor_pb2.DATA_TYPE_FP32, shape=[1, 16], raw_data=bytes(64)
    )
    stub = ipb_grpc.InferenceServiceStub(channel)
    reply = stub.Infer(ipb.InferRequest(model_name="scaler", inputs=[tensor]))
    assert reply.model_version == "2"
    assert not [line for line in server.log if "Traceback" in line or "error id" in line]
