"""Error hygiene: undecodable request bytes and shapes whose element count overflows are client
errors (INVALID_ARGUMENT) on every method of both APIs, logged in one rate-limited line, and the
server keeps serving."""

from __future__ import annotations

import logging
from typing import Any

import grpc
import numpy as np
import pytest

from modelyard.common.surfaces import is_management_method
from modelyard.inference.v1 import inference_service_pb2 as ipb
from modelyard.inference.v1 import inference_service_pb2_grpc as ipb_grpc
from modelyard.inference.v1 import tensor_pb2
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kpb_grpc
from modelyard.service.server import Service
from modelyard.tensors import to_tensor

# Field 1, length-delimited, with a length far past the end: no message type parses it.
GARBAGE = b"\x0a\xff\xff\xff\xff\x0f\x01\x02"

UNARY = [
    "/modelyard.inference.v1.InferenceService/Infer",
    "/modelyard.inference.v1.ModelService/GetModel",
    "/modelyard.inference.v1.ModelService/UnloadModel",
    "/inference.GRPCInferenceService/ModelInfer",
    "/inference.GRPCInferenceService/RepositoryModelUnload",
    "/grpc.health.v1.Health/Check",
]
SERVER_STREAMING = ["/modelyard.inference.v1.InferenceService/Generate"]
BIDI = ["/inference.GRPCInferenceService/ModelStreamInfer"]


async def test_undecodable_requests_are_invalid_argument_in_one_log_line(
    service: Service, channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    codes = {}
    for method in UNARY:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await channel.unary_unary(method, None, None)(GARBAGE)
        codes[method] = (caught.value.code(), caught.value.details())
    for method in SERVER_STREAMING:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in channel.unary_stream(method, None, None)(GARBAGE):
                pass
        codes[method] = (caught.value.code(), caught.value.details())
    for method in BIDI:
        call = channel.stream_stream(method, None, None)()  # type: ignore[call-arg]
        await call.write(GARBAGE)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in call:
                pass
        codes[method] = (caught.value.code(), caught.value.details())
    for method, (code, details) in codes.items():
        if is_management_method(method):  # off by default: refused before its bytes are read
            assert code == grpc.StatusCode.PERMISSION_DENIED, (method, code, details)
            continue
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, code, details)
        assert "not a valid message" in details
    refused = [r for r in caplog.records if "undecodable" in r.getMessage()]
    assert refused and all(r.exc_info is None and "\n" not in r.getMessage() for r in refused)
    assert not any(r.exc_info for r in caplog.records), "no traceback for a client's bytes"
    # The server still serves.
    infer = ipb_grpc.InferenceServiceStub(channel)
    x = to_tensor("INPUT0", np.ones((1, 16), np.float32))
    reply = await infer.Infer(ipb.InferRequest(model_name="scaler", inputs=[x]))
    assert reply.model_version == "2"


async def test_undecodable_flood_logs_a_bounded_number_of_lines(
    service: Service, channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    call = channel.unary_unary("/modelyard.inference.v1.InferenceService/Infer", None, None)
    for _ in range(50):
        with pytest.raises(grpc.aio.AioRpcError):
            await call(GARBAGE)
    lines = [r for r in caplog.records if "undecodable" in r.getMessage()]
    assert 1 <= len(lines) <= 10


OVERFLOWING = [[2**62, 4], [2**40, 2**40, 0], [2**31, 2**31, 2**31], [2**62, 0]]


@pytest.mark.parametrize("shape", OVERFLOWING)
@pytest.mark.parametrize("datatype", ["FP32", "BYTES"])
async def test_overflowing_shapes_are_invalid_argument_on_both_apis(
    channel: grpc.aio.Channel, shape: list[int], datatype: str
) -> None:
    ours = ipb_grpc.InferenceServiceStub(channel)
    kserve = kpb_grpc.GRPCInferenceServiceStub(channel)
    value = tensor_pb2.DATA_TYPE_FP32 if datatype == "FP32" else tensor_pb2.DATA_TYPE_BYTES
    tensor = tensor_pb2.Tensor(name="INPUT0", datatype=value, shape=shape, raw_data=b"")
    requests: list[Any] = [
        ours.Infer(ipb.InferRequest(model_name="scaler", inputs=[tensor])),
        kserve.ModelInfer(  # raw contents
            kpb.ModelInferRequest(
                model_name="scaler",
                inputs=[
                    kpb.ModelInferRequest.InferInputTensor(name="INPUT0", datatype=datatype, shape=shape)
                ],
                raw_input_contents=[b""],
            )
        ),
        kserve.ModelInfer(  # typed contents
            kpb.ModelInferRequest(
                model_name="scaler",
                inputs=[
                    kpb.ModelInferRequest.InferInputTensor(
                        name="INPUT0",
                        datatype=datatype,
                        shape=shape,
                        contents=kpb.InferTensorContents(),
                    )
                ],
            )
        ),
    ]
    # Empty data: an element count that overflows to 0 (or a shape numpy cannot make) would
    # otherwise pass the length checks and fail later, as INTERNAL.
    for request in requests:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await request
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()


async def test_stream_infer_answers_an_overflowing_shape_in_band_and_goes_on(
    channel: grpc.aio.Channel,
) -> None:
    kserve = kpb_grpc.GRPCInferenceServiceStub(channel)
    tensor = kpb.ModelInferRequest.InferInputTensor

    def request(shape: list[int], data: bytes) -> kpb.ModelInferRequest:
        return kpb.ModelInferRequest(
            model_name="scaler",
            inputs=[tensor(name="INPUT0", datatype="FP32", shape=shape)],
            raw_input_contents=[data],
        )

    call: Any = kserve.ModelStreamInfer(iter([request([2**62, 0], b""), request([1, 16], bytes(64))]))
    answers = [r async for r in call]
    assert "more elements than any tensor may" in answers[0].error_message
    assert answers[1].infer_response.model_version == "2" and not answers[1].error_message
