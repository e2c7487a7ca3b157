"""BYTES tensors through our API, byte for byte: direct runs, dynamic batching and streamed chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from models.demo_models import write_model
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.service.config import Settings
from modelyard.service.server import build_service
from modelyard.tensors import to_array, to_tensor
from tests.strings_model import string_identity

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


@pytest.mark.parametrize("model", ["text", "text_batched"])
async def test_non_utf8_is_refused_naming_the_tensor(stub: Any, model: str) -> None:
    bad = objects([[b"ok", b"\xff\xfe", b""]])
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Infer(pb.InferRequest(model_name=model, inputs=[to_tensor("TEXT", bad)]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'TEXT'" in (caught.value.details() or "")
    assert "UTF-8" in (caught.value.details() or "")
    # The model still answers.
    ok = await stub.Infer(pb.InferRequest(model_name=model, inputs=[to_tensor("TEXT", objects(ROWS))]))
    assert to_array(ok.outputs[0]).tolist() == ROWS
