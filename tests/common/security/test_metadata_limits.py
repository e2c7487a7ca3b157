"""Large metadata at the gRPC listeners (service, and a sidecar in front of one), as processes.

gRPC's defaults refuse a call whose headers pass 8 KiB at random and past 16 KiB always, as
RESOURCE_EXHAUSTED without `x-error-reason`: an 8-16 KB `x-model-version` never reached the name
rule. The listeners take up to 64 KiB (modelyard.process.grpc_server.MAX_METADATA_BYTES), so such
a header is ours to answer (INVALID_ARGUMENT `invalid_argument` naming it) every time; past 64
KiB gRPC answers, and the answer says so by having no reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from models import demo_models
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kpb_grpc
from modelyard.process.grpc_server import MAX_METADATA_BYTES
from modelyard.tensors import to_tensor
from tests.sidecar_support import SidecarProcess, start_sidecar_process
from tests.support import ServiceProcess

SIZES_KB = (8, 12, 16, 20, 48)
TRIES = 5  # each size several times: under the limit no answer is left to chance
Listener = Callable[[], str]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    demo_models.write_model(root, "scaler", 1, demo_models.scaled_identity(4, 2.0))
    return root


@pytest.fixture(params=["service", "sidecar"])
def listener(
    request: pytest.FixtureRequest, root: Path, service_process: Callable[..., ServiceProcess]
) -> Iterator[Listener]:
    sidecars: list[SidecarProcess] = []

    def start() -> str:
        upstream = service_process(root)
        if request.param == "service":
            return upstream.address
        sidecar = start_sidecar_process("--upstream", upstream.address)
        sidecars.append(sidecar)
        return sidecar.address

    yield start
    for sidecar in sidecars:
        sidecar.stop()


def _reason(error: grpc.aio.AioRpcError) -> str | None:
    trailing: Any = error.trailing_metadata() or ()  # grpc-stubs types this as one entry
    return next((str(value) for key, value in trailing if key == "x-error-reason"), None)


async def _infer(channel: grpc.aio.Channel, metadata: list[tuple[str, str]]) -> pb.InferResponse:
    stub = pb_grpc.InferenceServiceStub(channel)
    x = to_tensor("INPUT0", np.ones((1, 4), np.float32))
    return await stub.Infer(pb.InferRequest(model_name="scaler", inputs=[x]), metadata=metadata, timeout=30)


async def _model_infer(channel: grpc.aio.Channel, metadata: list[tuple[str, str]]) -> kpb.ModelInferResponse:
    stub = kpb_grpc.GRPCInferenceServiceStub(channel)
    request = kpb.ModelInferRequest(model_name="scaler")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(np.ones((1, 4), np.float32).tobytes())
    return await stub.ModelInfer(request, metadata=metadata, timeout=30)


async def test_a_large_version_header_is_answered_by_the_name_rule(listener: Listener) -> None:
    async with grpc.aio.insecure_channel(listener()) as channel:
        for kb in SIZES_KB:
            header = [("x-model-version", "1" * (kb * 1024))]
            for call in (_infer, _model_infer):
                for _ in range(TRIES):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await call(channel, header)
                    error = refused.value
                    assert (error.code(), _reason(error)) == (
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "invalid_argument",
                    ), f"{kb} KB: {error.details()}"
                    message = error.details() or ""
                    assert message.startswith("x-model-version '") and "longer than 128" in message
                    assert len(message) < 400  # the value is quoted capped
        # Not refused for what it disturbed: the same channel serves the next call.
        assert (await _infer(channel, [])).model_version == "1"


async def test_large_headers_of_no_meaning_under_the_limit_reach_the_model(listener: Listener) -> None:
    async with grpc.aio.insecure_channel(listener()) as channel:
        for kb in SIZES_KB:
            answer = await _infer(channel, [("x-client-note", "n" * (kb * 1024))])
            assert answer.model_version == "1"


async def test_past_the_limit_grpc_answers_without_a_reason(listener: Listener) -> None:
    """The layer that answers tells itself: gRPC's own refusal carries no x-error-reason."""
    async with grpc.aio.insecure_channel(listener()) as channel:
        for size in (MAX_METADATA_BYTES, 2 * MAX_METADATA_BYTES):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _infer(channel, [("x-model-version", "1" * size)])
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert _reason(refused.value) is None
            assert "metadata" in (refused.value.details() or "")
        assert (await _infer(channel, [])).model_version == "1"
