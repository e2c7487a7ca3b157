"""Fields 1 and 2 read from, and field 2 set in, real messages of both APIs without decoding."""

from __future__ import annotations

import pytest
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import tensor_pb2
from modelyard.kserve.v2 import grpc_service_pb2 as kserve

from sidecar.wire import ModelFields, WireError, read_model_fields, with_version


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
    # A version already there is replaced: the last occurrence wins.
    pinned = pb.InferRequest(model_name="scaler", model_version="1").SerializeToString()
    assert read_model_fields(with_version(pinned, "2")).version == "2"


@pytest.mark.parametrize("data", [b"\x0a\x10abc", b"\x80", b"\x0b", b"\x0a\x02\xff\xfe"])
def test_bytes_that_do_not_parse_are_refused(data: bytes) -> None:
    with pytest.raises(WireError):
        read_model_fields(data)
