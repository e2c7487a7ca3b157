"""BF16 through our API: DATA_TYPE_BF16 tensors in and out, and the model's signature says BF16."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest

from models.demo_models import write_model
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.inference.v1 import model_service_pb2 as mpb
from modelyard.inference.v1 import model_service_pb2_grpc as mpb_grpc
from modelyard.inference.v1 import tensor_pb2
from modelyard.service.server import build_service
from modelyard.service.settings import Settings
from modelyard.tensors import to_array, to_tensor
from tests.bf16_model import bf16_double


@pytest.fixture
async def channel(tmp_path: Path) -> AsyncIterator[grpc.aio.Channel]:
    root = tmp_path / "models"
    write_model(
        root,
        "bf16",
        1,
        bf16_double(),
        {"max_batch_size": 8, "dynamic_batching": {"max_queue_delay_us": 500}},
    )
    service = build_service(Settings(repository=root, listen="127.0.0.1:0", metrics_listen="127.0.0.1:0"))
    await service.start()
    try:
        async with grpc.aio.insecure_channel(service.address) as chan:
            yield chan
    finally:
        await service.stop(grace_s=1.0)


async def test_bf16_in_and_out(channel: grpc.aio.Channel) -> None:
    stub: Any = pb_grpc.InferenceServiceStub(channel)
    x = np.array([[1.0, -2.5, 0.1, 7.0]], dtype=ml_dtypes.bfloat16)
    response = await stub.Infer(pb.InferRequest(model_name="bf16", inputs=[to_tensor("X", x)]))
    y, y32 = (to_array(t) for t in response.outputs)
    assert response.outputs[0].datatype == tensor_pb2.DATA_TYPE_BF16
    assert y.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(y.astype(np.float32), x.astype(np.float32) * 2)
    np.testing.assert_array_equal(y32, x.astype(np.float32) * 2)
    models: Any = mpb_grpc.ModelServiceStub(channel)
    described = (await models.GetModel(mpb.GetModelRequest(name="bf16"))).model
    assert [t.datatype for t in described.inputs] == [tensor_pb2.DATA_TYPE_BF16]
