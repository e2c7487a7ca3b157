"""Large protobuf messages parsed in steps: the same message as one parse, with the loop free."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from google.protobuf.message import DecodeError

from modelyard.kserve.v2 import grpc_service_pb2 as pb
from modelyard.service.api.parsing import (
    MAX_FIELDS,
    Malformed,
    TooManyFields,
    field_slices,
    message_class,
    parse_in_steps,
)


def _request(inputs: int, width: int = 4) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m", id="i")
    request.parameters["p"].int64_param = 7
    for index in range(inputs):
        tensor = request.inputs.add(name=f"x{index}", datatype="FP32", shape=[1, width])
        tensor.contents.fp32_contents.extend([1.0] * width)
    request.raw_input_contents.append(b"\x01" * 300_000)  # one field longer than a step
    request.model_version = "2"  # a singular field after the repeated ones
    return request


def test_the_slices_cover_the_message_in_whole_fields() -> None:
    data = memoryview(_request(10_000).SerializeToString())
    slices = list(field_slices(data, chunk=32 * 1024))
    assert len(slices) > 10
    assert slices[0][0] == 0 and slices[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(slices))
    with pytest.raises(Malformed):
        list(field_slices(data[:-1]))  # the last field runs past the end
    with pytest.raises(Malformed):
        list(field_slices(memoryview(b"\x0b\x00")))  # a group


async def test_a_large_message_parses_the_same_with_the_loop_running_between_steps() -> None:
    request = _request(12_000, width=128)  # about 6 MB in 12,000 tensors
    data = request.SerializeToString()
    ticks = 0
    done = False

    async def tick() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await asyncio.sleep(0)

    ticker = asyncio.get_running_loop().create_task(tick())
    await asyncio.sleep(0)
    ticks = 0
    parsed = await parse_in_steps(pb.ModelInferRequest, data)
    done = True
    await ticker
    assert parsed == request
    assert ticks >= 20  # one parse in one call would let the loop run not once


async def test_bad_bytes_are_a_decode_error() -> None:
    data = _request(10).SerializeToString()
    with pytest.raises(Malformed):
        await parse_in_steps(pb.ModelInferRequest, data + b"\xff\xff\xff")  # a tag cut short
    with pytest.raises(DecodeError):
        await parse_in_steps(pb.ModelInferRequest, data + b"\x2a\x03\xff\xff\xff")  # inputs: not a tensor


def test_message_class_knows_protobuf_parsers_only() -> None:
    assert message_class(pb.ModelInferRequest.FromString) is pb.ModelInferRequest
    assert message_class(lambda data: data) is None
    assert message_class(None) is None


def test_a_message_of_more_fields_than_any_request_has_is_refused_after_a_bounded_walk() -> None:
    tiny = b"\xc0\x3e\x00" * 1_000_000  # a million empty fields (number 1000): 3 MB
    with pytest.raises(TooManyFields):
        list(field_slices(memoryview(tiny)))
    # The walk stops at the bound: what it read is MAX_FIELDS fields, not the million.
    walked = list(field_slices(memoryview(tiny[: 3 * MAX_FIELDS])))
    assert walked[-1][1] == 3 * MAX_FIELDS
