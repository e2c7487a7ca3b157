"""modelyard.flat.v1.Inference/Infer: the FlatBuffers Infer over the same data plane as the
protobuf APIs (versions, checks, errors with their reason, x-served-version)."""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np
import pytest

from modelyard import flat
from modelyard.common import headers

X = np.arange(32, dtype=np.float32).reshape(2, 16)


def infer(channel: grpc.aio.Channel, request: bytes) -> grpc.aio.UnaryUnaryCall[bytes, bytes]:
    return channel.unary_unary(flat.METHOD, None, None)(request)


async def test_flat_infer_answers_like_infer(channel: grpc.aio.Channel) -> None:
    call = infer(channel, flat.encode_request("scaler", {"INPUT0": X}))
    response = flat.decode_response(await call)
    assert (response.model_name, response.model_version) == ("scaler", "2")
    np.testing.assert_array_equal(response.tensors["OUTPUT0"], X * 3)
    assert dict(await call.trailing_metadata())[headers.SERVED_VERSION] == "2"
    pinned = flat.decode_response(await infer(channel, flat.encode_request("scaler", {"INPUT0": X}, "1")))
    np.testing.assert_array_equal(pinned.tensors["OUTPUT0"], X * 2)


@pytest.mark.parametrize(
    ("request_bytes", "code", "words"),
    [
        (b"\x01\x02\x03", grpc.StatusCode.INVALID_ARGUMENT, "not a valid modelyard.flat.v1"),
        (flat.encode_request("scaler", {"INPUT0": X[:, :8]}), grpc.StatusCode.INVALID_ARGUMENT, "INPUT0"),
        (flat.encode_request("nope", {"INPUT0": X}), grpc.StatusCode.NOT_FOUND, "nope"),
    ],
)
async def test_bad_flat_requests_get_a_clear_error(
    channel: grpc.aio.Channel, request_bytes: bytes, code: grpc.StatusCode, words: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await infer(channel, request_bytes)
    assert failed.value.code() == code
    assert words in (failed.value.details() or "")
    trailing: Any = failed.value.trailing_metadata() or ()
    assert dict(trailing)[headers.ERROR_REASON]
    # The service serves on.
    flat.decode_response(await infer(channel, flat.encode_request("scaler", {"INPUT0": X})))
