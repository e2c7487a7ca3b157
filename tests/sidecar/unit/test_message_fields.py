"""Fields 1 and 2 read from, and field 2 set in, real messages of both APIs without decoding; the
walk's bound (a message of millions of tiny fields costs what its first fields cost), and properties
over arbitrary bytes and over every valid encoding (hypothesis)."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import tensor_pb2
from modelyard.kserve.v2 import grpc_service_pb2 as kserve
from modelyard.sidecar.message_fields import (
    MAX_FIELDS,
    VALUE_MAX,
    ModelFields,
    WireError,
    read_model_fields,
    with_version,
)


def test_reads_name_and_version_of_every_request_kind() -> None:
    big = tensor_pb2.Tensor(name="INPUT0", shape=[1, 3], raw_data=b"\x00" * 4096)
    messages = [
        pb.InferRequest(model_name="scaler", model_version="2", inputs=[big], priority=3),
        pb.InferStreamRequest(model_name="scaler", model_version="2", chunk_size=4),
        pb.GenerateRequest(model_name="scaler", model_version="2", temperature=0.5, seed=7, stop=["x"]),
        kserve.ModelInferRequest(model_name="scaler", model_version="2", id="r1"),
    ]
    for message in messages:
        assert read_model_fields(message.SerializeToString()) == ModelFields("scaler", "2")


def test_missing_fields_are_empty() -> None:
    assert read_model_fields(b"") == ModelFields()
    assert read_model_fields(pb.InferRequest(model_name="m").SerializeToString()) == ModelFields("m", "")


def test_with_version_sets_field_2_as_protobuf_reads_it() -> None:
    original = pb.InferRequest(model_name="scaler", request_id="r", priority=2)
    rewritten = pb.InferRequest.FromString(with_version(original.SerializeToString(), "7"))
    assert rewritten.model_version == "7"
    assert rewritten.model_name == "scaler" and rewritten.request_id == "r" and rewritten.priority == 2
    # A version already there is replaced: the last occurrence wins (protobuf's reading; the
    # proxy appends only to messages that carry no version).
    pinned = pb.InferRequest(model_name="scaler", model_version="1").SerializeToString()
    assert pb.InferRequest.FromString(with_version(pinned, "2")).model_version == "2"


@pytest.mark.parametrize("data", [b"\x0a\x10abc", b"\x80", b"\x0b", b"\x0a\x02\xff\xfe"])
def test_bytes_that_do_not_parse_are_refused(data: bytes) -> None:
    with pytest.raises(WireError):
        read_model_fields(data)


def tiny_fields(count: int) -> bytes:
    return b"\x18\x01" * count  # field 3, varint 1: two bytes each


def test_a_message_of_millions_of_tiny_fields_is_read_in_a_bounded_time() -> None:
    # 16 MB of two-byte fields: the walk stops at MAX_FIELDS, it never walks the message.
    hostile = tiny_fields(8 * 1024 * 1024)
    named = pb.InferRequest(model_name="scaler", model_version="2").SerializeToString() + hostile
    started = time.perf_counter()
    assert read_model_fields(hostile) == ModelFields(complete=False)
    assert read_model_fields(named) == ModelFields("scaler", "2")  # stops once it has both
    assert read_model_fields(b"\x0a\x01m" + hostile) == ModelFields("m", "", complete=False)
    assert time.perf_counter() - started < 0.5  # a full walk took 9-21 s
    # Fields 1/2 beyond the bound are not seen: the message is read as naming no model.
    late = tiny_fields(MAX_FIELDS) + b"\x0a\x01m"
    assert read_model_fields(late) == ModelFields(complete=False)
    assert read_model_fields(tiny_fields(MAX_FIELDS - 1) + b"\x0a\x01m").name == "m"


def test_a_long_value_is_kept_only_up_to_the_bound() -> None:
    message = pb.InferRequest(model_name="m" * 5_000_000, model_version="v" * 10_000).SerializeToString()
    fields = read_model_fields(message)
    assert fields.name == "m" * VALUE_MAX and fields.version == "v" * VALUE_MAX


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_raise_only_the_readers_error_in_bounded_time(data: bytes) -> None:
    started = time.perf_counter()
    try:
        fields = read_model_fields(data)
    except WireError:
        pass
    else:
        assert len(fields.name.encode()) <= 4 * VALUE_MAX and len(fields.version.encode()) <= 4 * VALUE_MAX
    assert time.perf_counter() - started < 0.5  # generous: the machine is shared; a walk is microseconds


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=512), st.binary(min_size=1, max_size=64))
def test_garbage_after_a_valid_prefix_never_raises_anything_else(prefix: bytes, tail: bytes) -> None:
    for data in (prefix + tail, tiny_fields(MAX_FIELDS) + tail):
        with contextlib.suppress(WireError):
            read_model_fields(data)


names = st.text(max_size=200)
tensors = st.lists(
    st.builds(tensor_pb2.Tensor, name=st.text(max_size=8), raw_data=st.binary(max_size=64)), max_size=4
)


@settings(max_examples=300, deadline=None)
@given(names, names, tensors, st.integers(0, 2**31 - 1), st.text(max_size=16))
def test_on_valid_encodings_it_finds_what_protobuf_finds(
    name: str, version: str, inputs: list[tensor_pb2.Tensor], priority: int, request_id: str
) -> None:
    messages = [
        pb.InferRequest(
            model_name=name, model_version=version, inputs=inputs, priority=priority, request_id=request_id
        ),
        pb.GenerateRequest(model_name=name, model_version=version, prompt=request_id, seed=priority),
        kserve.ModelInferRequest(model_name=name, model_version=version, id=request_id),
        kserve.ModelMetadataRequest(name=name, version=version),
    ]
    for message in messages:
        wire = message.SerializeToString()
        assert read_model_fields(wire) == ModelFields(*name_and_version(type(message).FromString(wire)))
        # The version the proxy appends is the one protobuf reads.
        assert name_and_version(type(message).FromString(with_version(wire, "7")))[1] == "7"


def name_and_version(message: Any) -> tuple[str, str]:
    if isinstance(message, kserve.ModelMetadataRequest):
        return message.name, message.version
    return message.model_name, message.model_version
