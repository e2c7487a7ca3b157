"""A unary inference call leases its version from DataPlane.open to its answer and lets go of it
whatever the answer (the unary servicers release it in their own `finally`, no `with`): a version
with no request in it has nothing in flight, so that it can retire."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from models import demo_models
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kgrpc
from modelyard.service.config import Settings
from modelyard.service.server import Service, build_service
from modelyard.tensors import to_tensor


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[Service]:
    demo_models.write_model(tmp_path, "m", 1, demo_models.scaled_identity(4, 2.0), {"max_batch_size": 8})
    live = build_service(Settings(repository=tmp_path, listen="127.0.0.1:0", metrics_listen=""))
    await live.start()
    try:
        yield live
    finally:
        await live.stop(grace_s=1)


def _kserve(features: int, extra: bool = False) -> kpb.ModelInferRequest:
    request = kpb.ModelInferRequest(model_name="m")
    for name in ("INPUT0", "EXTRA")[: 2 if extra else 1]:
        request.inputs.add(name=name, datatype="FP32", shape=[1, features])
        request.raw_input_contents.append(np.ones((1, features), np.float32).tobytes())
    return request


async def test_unary_calls_let_go_of_their_version_whether_they_answer_or_fail(service: Service) -> None:
    served = service.manager.resolve("m")
    async with grpc.aio.insecure_channel(service.address) as channel:
        kserve, ours = kgrpc.GRPCInferenceServiceStub(channel), pb_grpc.InferenceServiceStub(channel)
        await kserve.ModelInfer(_kserve(4))
        await ours.Infer(
            pb.InferRequest(model_name="m", inputs=[to_tensor("INPUT0", np.ones((1, 4), np.float32))])
        )
        for refused in (_kserve(3), _kserve(4, extra=True)):  # refused after the version was leased
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await kserve.ModelInfer(refused)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            wrong = to_tensor("INPUT0", np.ones((1, 3), np.float32))
            await ours.Infer(pb.InferRequest(model_name="m", inputs=[wrong]))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert served.stats.success_count == 2 and served.stats.fail_count >= 2
    assert served.in_flight == 0
