"""Our InferenceService against the real service on loopback, compared with direct ORT runs."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest

from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.inference.v1 import tensor_pb2
from modelyard.service.server import build_service
from modelyard.service.settings import Settings
from modelyard.tensors import to_array, to_tensor


def direct(repository: Path, model: str, version: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(
        str(repository / model / version / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    return session.run(None, feeds)  # type: ignore[no-any-return]


def request(model: str, version: str = "", **inputs: np.ndarray) -> pb.InferRequest:
    return pb.InferRequest(
        model_name=model, model_version=version, inputs=[to_tensor(n, a) for n, a in inputs.items()]
    )


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> pb_grpc.InferenceServiceStub:
    return pb_grpc.InferenceServiceStub(channel)


async def test_infer_matches_direct_onnxruntime(stub, repository: Path) -> None:
    x = np.random.default_rng(0).standard_normal((5, 64), dtype=np.float32)
    response = await stub.Infer(request("classifier", INPUT0=x))
    (want,) = direct(repository, "classifier", "1", {"INPUT0": x})
    assert response.model_name == "classifier" and response.model_version == "1"
    assert [t.name for t in response.outputs] == ["OUTPUT0"]
    got = to_array(response.outputs[0])
    assert got.dtype == np.float32 and got.shape == (5, 8)
    np.testing.assert_array_equal(got, want)


async def test_version_pinning_and_newest_by_default(stub) -> None:
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    for version, scale in (("1", 2.0), ("v2", 3.0), ("", 3.0)):
        response = await stub.Infer(request("scaler", version, INPUT0=x))
        assert response.model_version == ("1" if scale == 2.0 else "2")
        np.testing.assert_array_equal(to_array(response.outputs[0]), x * np.float32(scale))


async def test_mixed_dtypes_and_output_selection(stub) -> None:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 4), dtype=np.float32)
    b = rng.integers(-5, 5, (3, 4), dtype=np.int64)
    req = request("mixed", a=a, b=b)
    req.output_names.append("argmax")
    req.request_id = "req-7"
    response = await stub.Infer(req)
    assert response.request_id == "req-7"
    assert [t.name for t in response.outputs] == ["argmax"]
    assert response.outputs[0].datatype == tensor_pb2.DATA_TYPE_INT64
    np.testing.assert_array_equal(to_array(response.outputs[0]), np.argmax(a, 1))
    both = await stub.Infer(request("mixed", a=a, b=b))
    by_name = {t.name: to_array(t) for t in both.outputs}
    np.testing.assert_array_equal(by_name["sum"], a + b.astype(np.float32))


@pytest.mark.parametrize(
    ("model", "version", "inputs", "code", "words"),
    [
        ("nope", "", {"INPUT0": np.zeros((1, 64), np.float32)}, grpc.StatusCode.NOT_FOUND, ["'nope'"]),
        (
            "scaler",
            "9",
            {"INPUT0": np.zeros((1, 16), np.float32)},
            grpc.StatusCode.NOT_FOUND,
            ["version 9", "[1, 2]"],
        ),
        (
            "scaler",
            "latest",
            {"INPUT0": np.zeros((1, 16), np.float32)},
            grpc.StatusCode.INVALID_ARGUMENT,
            ["latest"],
        ),
        (
            "classifier",
            "",
            {"WRONG": np.zeros((1, 64), np.float32)},
            grpc.StatusCode.INVALID_ARGUMENT,
            ["'WRONG'"],
        ),
        ("classifier", "", {}, grpc.StatusCode.INVALID_ARGUMENT, ["missing input 'INPUT0'"]),
        (
            "classifier",
            "",
            {"INPUT0": np.zeros((1, 64), np.int32)},
            grpc.StatusCode.INVALID_ARGUMENT,
            ["'INPUT0'", "FP32", "INT32"],
        ),
        (
            "classifier",
            "",
            {"INPUT0": np.zeros((2, 63), np.float32)},
            grpc.StatusCode.INVALID_ARGUMENT,
            ["'INPUT0'", "[-1, 64]", "[2, 63]"],
        ),
        (
            "classifier",
            "",
            {"INPUT0": np.zeros((33, 64), np.float32)},
            grpc.StatusCode.INVALID_ARGUMENT,
            ["batch size 33", "max_batch_size 32"],
        ),
        (
            "classifier",
            "",
            {"INPUT0": np.zeros((64,), np.float32)},
            grpc.StatusCode.INVALID_ARGUMENT,
            ["[-1, 64]", "[64]"],
        ),
        (
            "mixed",
            "",
            {"a": np.zeros((2, 4), np.float32), "b": np.zeros((3, 4), np.int64)},
            grpc.StatusCode.INVALID_ARGUMENT,
            ["batch size"],
        ),
    ],
)
async def test_bad_requests_get_specific_errors(stub, model, version, inputs, code, words) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Infer(request(model, version, **inputs))
    assert caught.value.code() == code, caught.value.details()
    for word in words:
        assert word in caught.value.details()
    # Nothing else is disturbed: the next good request succeeds.
    ok = await stub.Infer(request("scaler", INPUT0=np.ones((1, 16), np.float32)))
    assert ok.model_version == "2"


async def test_malformed_tensors(stub) -> None:
    cases = [
        (
            tensor_pb2.Tensor(
                name="INPUT0", datatype=tensor_pb2.DATA_TYPE_FP32, shape=[1, 16], raw_data=b"\0" * 63
            ),
            ["'INPUT0'", "64 bytes", "63"],
        ),
        (tensor_pb2.Tensor(name="INPUT0", shape=[1, 16], raw_data=b"\0" * 64), ["datatype"]),
        (tensor_pb2.Tensor(name="INPUT0", datatype=tensor_pb2.DATA_TYPE_FP32, shape=[-1, 16]), ["negative"]),
    ]
    for tensor, words in cases:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Infer(pb.InferRequest(model_name="scaler", inputs=[tensor]))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert all(w in caught.value.details() for w in words), caught.value.details()
    twice = pb.InferRequest(
        model_name="scaler", inputs=[to_tensor("INPUT0", np.ones((1, 16), np.float32))] * 2
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Infer(twice)
    assert "twice" in caught.value.details()
    unknown_output = request("scaler", INPUT0=np.ones((1, 16), np.float32))
    unknown_output.output_names.append("NOPE")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Infer(unknown_output)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'NOPE'" in caught.value.details()


async def test_oversized_message_is_resource_exhausted(repository: Path) -> None:
    settings = Settings(
        repository=repository, listen="127.0.0.1:0", metrics_listen="", max_message_bytes=1 << 20
    )
    service = build_service(settings)
    await service.start()
    try:
        async with grpc.aio.insecure_channel(
            service.address, options=[("grpc.max_send_message_length", 64 << 20)]
        ) as chan:
            stub = pb_grpc.InferenceServiceStub(chan)
            big = request("scaler", INPUT0=np.zeros((32768, 16), np.float32))  # 2 MiB
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Infer(big)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            ok = await stub.Infer(request("scaler", INPUT0=np.ones((1, 16), np.float32)))
            assert ok.model_version == "2"
    finally:
        await service.stop(grace_s=1.0)


async def test_infer_stream_chunks_rows_on_one_version(stub, repository: Path) -> None:
    x = np.random.default_rng(2).standard_normal((10, 64), dtype=np.float32)
    req = pb.InferStreamRequest(
        model_name="classifier", inputs=[to_tensor("INPUT0", x)], chunk_size=4, request_id="s"
    )
    responses = [r async for r in stub.InferStream(req)]
    assert [r.row_offset for r in responses] == [0, 4, 8]
    assert [r.chunk_index for r in responses] == [0, 1, 2]
    assert [r.last for r in responses] == [False, False, True]
    assert {r.model_version for r in responses} == {"1"} and {r.request_id for r in responses} == {"s"}
    rows = np.concatenate([to_array(r.outputs[0]) for r in responses])
    (want,) = direct(repository, "classifier", "1", {"INPUT0": x})
    np.testing.assert_allclose(rows, want, rtol=1e-6, atol=1e-7)


async def test_infer_stream_bad_input_is_one_error(stub) -> None:
    req = pb.InferStreamRequest(
        model_name="classifier", inputs=[to_tensor("INPUT0", np.zeros((2, 5), np.float32))]
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stub.InferStream(req):
            pytest.fail("no response expected")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_generate_on_a_model_that_is_not_a_decoder_is_failed_precondition(stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stub.Generate(pb.GenerateRequest(model_name="classifier", prompt="hi")):
            pass
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not a decoder" in caught.value.details()


async def test_concurrent_requests_each_get_their_own_answer(stub) -> None:
    import asyncio

    async def one(i: int) -> None:
        x = np.full((1, 16), i, np.float32)
        response = await stub.Infer(request("scaler", "1", INPUT0=x))
        np.testing.assert_array_equal(to_array(response.outputs[0]), x * 2)

    await asyncio.gather(*(one(i) for i in range(64)))
