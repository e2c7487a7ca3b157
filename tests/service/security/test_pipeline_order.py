"""The request pipeline's order (service/server.py) on every call kind, with credentials required
for inference: a caller without one is refused before its message is read, whatever its size or
bytes; a caller with one gets `too_large` for an oversized message before it is parsed (however
undecodable), and INVALID_ARGUMENT for undecodable bytes; a good call is answered."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from models import demo_models
from modelyard.common.headers import ERROR_REASON
from modelyard.inference.v1 import model_service_pb2 as mpb
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.service.server import Service
from tests.support import serving

TOKEN = "pipeline-token"
BEARER = (("authorization", f"Bearer {TOKEN}"),)
LIMIT = 64 * 1024
INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
WATCH = "/modelyard.inference.v1.ModelService/WatchModels"
GARBAGE = b"\xff\xff\xff"  # a tag whose varint never ends
OVERSIZED = b"\xff" * (LIMIT + 1)  # undecodable too: the size check comes first


def _infer_request() -> bytes:
    request = kpb.ModelInferRequest(model_name="scaler")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4]).contents.fp32_contents.extend([1.0] * 4)
    return request.SerializeToString()


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[Service]:
    root = tmp_path / "models"
    demo_models.write_model(root, "scaler", 1, demo_models.scaled_identity(4, 2.0))
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    async with serving(
        root,
        max_message_bytes=LIMIT,
        auth_tokens_file=str(tokens),
        auth_inference=True,
    ) as running:
        yield running


# One call of each kind, sending `message`: the first response (or the status it ended with).
Caller = Callable[[grpc.aio.Channel, bytes, Any], Awaitable[bytes]]


async def _unary(channel: grpc.aio.Channel, message: bytes, metadata: Any) -> bytes:
    answer: bytes = await channel.unary_unary(INFER, None, None)(message, metadata=metadata, timeout=10)
    return answer


async def _unary_stream(channel: grpc.aio.Channel, message: bytes, metadata: Any) -> bytes:
    call = channel.unary_stream(WATCH, None, None)(message, metadata=metadata, timeout=10)
    async for answer in call:
        call.cancel()
        return bytes(answer)
    raise AssertionError("the watch ended without an event")


async def _stream_stream(channel: grpc.aio.Channel, message: bytes, metadata: Any) -> bytes:
    # Written with call.write: grpc.aio takes no request iterator then (the stubs want one).
    call = channel.stream_stream(STREAM_INFER, None, None)(metadata=metadata, timeout=10)  # type: ignore[call-arg]
    await call.write(message)
    async for answer in call:
        call.cancel()
        return bytes(answer)
    raise AssertionError("the stream ended without an answer")


KINDS: list[tuple[str, Caller, bytes]] = [
    ("unary_unary", _unary, _infer_request()),
    (
        "unary_stream",
        _unary_stream,
        mpb.WatchModelsRequest(names=["scaler"], send_initial_state=True).SerializeToString(),
    ),
    ("stream_stream", _stream_stream, _infer_request()),
]


async def _refusal(call: Awaitable[bytes]) -> tuple[grpc.StatusCode, str | None]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    trailers: Any = caught.value.trailing_metadata() or ()
    return caught.value.code(), dict(trailers).get(ERROR_REASON)


@pytest.mark.parametrize("kind, call, good", KINDS, ids=[kind for kind, _, _ in KINDS])
async def test_each_call_kind_passes_the_pipeline_in_order(
    service: Service, kind: str, call: Caller, good: bytes
) -> None:
    async with grpc.aio.insecure_channel(service.address) as channel:
        for message in (good, GARBAGE, OVERSIZED):  # no credential: refused before anything else
            assert await _refusal(call(channel, message, ())) == (
                grpc.StatusCode.UNAUTHENTICATED,
                "unauthenticated",
            )
        code, reason = await _refusal(call(channel, OVERSIZED, BEARER))
        assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "too_large")
        code, _ = await _refusal(call(channel, GARBAGE, BEARER))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert await call(channel, good, BEARER)  # answered
