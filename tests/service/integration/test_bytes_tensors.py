"""BYTES tensors through our API, byte for byte: direct runs, dynamic batching and streamed chunks;
bytes that are not UTF-8 reach a model that takes them (service/runtime/strings.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from models.demo_models import write_model
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.service.server import build_service
from modelyard.service.settings import Settings
from modelyard.tensors import to_array, to_tensor
from tests.strings_model import byte_lookup, string_identity

# Empty strings, embedded NULs, multi-byte UTF-8, a NUL alone.
ROWS = [[b"hello", b"", b"a\x00b"], ["é€".encode(), b"\x00", b"\t \n"]]


def objects(rows: list[list[bytes]]) -> np.ndarray:
    array = np.empty((len(rows), len(rows[0])), dtype=object)
    for i, row in enumerate(rows):
        array[i, :] = row
    return array


@pytest.fixture
async def stub(tmp_path: Path) -> AsyncIterator[Any]:
    root = tmp_path / "models"
    write_model(root, "text", 1, string_identity(), {"max_batch_size": 8})
    write_model(
        root,
        "text_batched",
        1,
        string_identity(),
        {"max_batch_size": 8, "dynamic_batching": {"max_queue_delay_us": 1000}},
    )
    keys = [b"\xff\xfe", "é".encode(), b"\x89PNG\r\n"]
    write_model(root, "lookup", 1, byte_lookup(keys), {"max_batch_size": 8})
    write_model(
        root,
        "lookup_batched",
        1,
        byte_lookup(keys),
        {"max_batch_size": 8, "dynamic_batching": {"max_queue_delay_us": 1000}},
    )
    service = build_service(Settings(repository=root, listen="127.0.0.1:0", metrics_listen="127.0.0.1:0"))
    await service.start()
    try:
        async with grpc.aio.insecure_channel(service.address) as channel:
            yield pb_grpc.InferenceServiceStub(channel)
    finally:
        await service.stop(grace_s=1.0)


@pytest.mark.parametrize("model", ["text", "text_batched"])
async def test_infer_returns_bytes_intact(stub: Any, model: str) -> None:
    response = await stub.Infer(pb.InferRequest(model_name=model, inputs=[to_tensor("TEXT", objects(ROWS))]))
    echo = to_array(response.outputs[0])
    assert echo.shape == (2, 3)
    assert echo.tolist() == ROWS


async def test_stream_chunks_return_bytes_intact(stub: Any) -> None:
    request = pb.InferStreamRequest(
        model_name="text_batched", inputs=[to_tensor("TEXT", objects(ROWS))], chunk_size=1
    )
    rows = [to_array(r.outputs[0]).tolist() async for r in stub.InferStream(request)]
    assert rows == [[ROWS[0]], [ROWS[1]]]


@pytest.mark.parametrize("model", ["lookup", "lookup_batched"])
async def test_bytes_that_are_not_utf8_reach_the_model(stub: Any, model: str) -> None:
    rows = objects([[b"\x89PNG\r\n", b"\xff\xfe", b"\xff"], ["é".encode(), b"", b"\xfe\xff"]])
    response = await stub.Infer(pb.InferRequest(model_name=model, inputs=[to_tensor("TEXT", rows)]))
    assert to_array(response.outputs[0]).tolist() == [[2, 0, -1], [1, -1, -1]]


@pytest.mark.parametrize("model", ["text", "text_batched"])
async def test_non_utf8_that_reaches_a_string_output_is_unsupported(stub: Any, model: str) -> None:
    bad = objects([[b"ok", b"\xff\xfe", b""]])
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Infer(pb.InferRequest(model_name=model, inputs=[to_tensor("TEXT", bad)]))
    # ONNX Runtime's Python binding returns string outputs as UTF-8 only: a limit of this server
    # with these values (UNIMPLEMENTED, unsupported), not a fault of the model.
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "not UTF-8" in (caught.value.details() or "")
    metadata: Any = caught.value.trailing_metadata() or ()
    assert dict(metadata)["x-error-reason"] == "unsupported"
    # The model still answers.
    ok = await stub.Infer(pb.InferRequest(model_name=model, inputs=[to_tensor("TEXT", objects(ROWS))]))
    assert to_array(ok.outputs[0]).tolist() == ROWS


async def test_non_utf8_beside_a_nul_is_refused_naming_the_tensor(stub: Any) -> None:
    bad = objects([[b"ok", b"\xff\xfe", b"a\x00b"]])
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Infer(pb.InferRequest(model_name="lookup", inputs=[to_tensor("TEXT", bad)]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'TEXT': BYTES element 1 is not UTF-8 and element 2 holds a NUL" in (
        caught.value.details() or ""
    )


async def test_a_batch_of_binary_and_nul_requests_answers_each(stub: Any) -> None:
    # Together they cannot reach ONNX Runtime (bytes that are not UTF-8 beside a NUL), each alone
    # can: a batch of them is run request by request, and each gets its own answer.
    binary = objects([[b"\xff\xfe", b"\x89PNG\r\n"]])
    nul = objects([["é".encode(), b"a\x00b"]])

    async def call(rows: np.ndarray) -> Any:
        request = pb.InferRequest(model_name="lookup_batched", inputs=[to_tensor("TEXT", rows)])
        return to_array((await stub.Infer(request)).outputs[0]).tolist()

    for _ in range(5):
        answers = await asyncio.gather(call(binary), call(nul), call(binary), call(nul))
        assert list(answers) == [[[0, 2]], [[1, -1]]] * 2
