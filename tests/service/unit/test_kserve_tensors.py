"""KServe V2 tensor conversions: round trips for every datatype, BYTES encoding, bad input."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest

from modelyard.kserve.v2.grpc_service_pb2 import (
    InferParameter,
    InferTensorContents,
    ModelInferRequest,
    ModelInferResponse,
)
from modelyard.service.api.kserve.tensors import (
    decode_inputs,
    encode_outputs,
    parameter_value,
    requested_outputs,
)
from modelyard.service.errors import InvalidInput, Unsupported
from modelyard.tensors import NUMPY_BY_NAME, TensorError

NUMERIC = [name for name in NUMPY_BY_NAME if name != "BYTES"]
TYPED_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}
WORDS = np.array([b"", b"hello", "h\u00e9llo".encode(), b"\x00\xff", b"x" * 300, b"last"], dtype=object)


def sample(datatype: str, shape: tuple[int, ...] = (2, 3)) -> np.ndarray:
    dtype = NUMPY_BY_NAME[datatype]
    rng = np.random.default_rng(7)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype.str)
        values = rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
        values.flat[0], values.flat[-1] = info.min, info.max  # the extremes survive too
        return values
    return rng.standard_normal(size=shape).astype(dtype)


def length_prefixed(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def raw_request(*tensors: tuple[str, str, list[int], bytes]) -> ModelInferRequest:
    request = ModelInferRequest(model_name="m")
    for name, datatype, shape, data in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        request.raw_input_contents.append(data)
    return request


def typed_request(name: str, datatype: str, shape: list[int], **contents: Any) -> ModelInferRequest:
    request = ModelInferRequest(model_name="m")
    request.inputs.add(name=name, datatype=datatype, shape=shape, contents=InferTensorContents(**contents))
    return request


def rejects(request: ModelInferRequest, *fragments: str) -> str:
    with pytest.raises((InvalidInput, TensorError)) as caught:  # TensorError: BYTES decoding
        decode_inputs(request)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# Round trips ------------------------------------------------------------------------------------


@pytest.mark.parametrize("datatype", NUMERIC)
def test_raw_input_round_trip_is_a_zero_copy_view(datatype: str) -> None:
    array = sample(datatype)
    decoded = decode_inputs(raw_request(("x", datatype, [2, 3], array.tobytes())))["x"]
    assert decoded.dtype == NUMPY_BY_NAME[datatype] and decoded.shape == (2, 3)
    np.testing.assert_array_equal(decoded, array)
    assert not decoded.flags.owndata and not decoded.flags.writeable  # a view of the request bytes


@pytest.mark.parametrize("datatype", list(TYPED_FIELD))
def test_typed_contents_round_trip(datatype: str) -> None:
    array = sample(datatype)
    request = typed_request("x", datatype, [2, 3], **{TYPED_FIELD[datatype]: array.ravel().tolist()})
    decoded = decode_inputs(request)["x"]
    assert decoded.dtype == NUMPY_BY_NAME[datatype] and decoded.shape == (2, 3)
    np.testing.assert_array_equal(decoded, array)


def test_bytes_raw_round_trip() -> None:
    decoded = decode_inputs(raw_request(("s", "BYTES", [2, 3], length_prefixed(list(WORDS)))))["s"]
    assert decoded.dtype == object and decoded.shape == (2, 3)
    assert decoded.ravel().tolist() == list(WORDS)
    assert all(type(item) is bytes for item in decoded.ravel())


def test_bytes_typed_round_trip() -> None:
    decoded = decode_inputs(typed_request("s", "BYTES", [3, 2], bytes_contents=list(WORDS)))["s"]
    assert decoded.shape == (3, 2) and decoded.ravel().tolist() == list(WORDS)


def test_scalar_and_empty_tensors() -> None:
    request = raw_request(
        ("scalar", "FP32", [], np.float32(2.5).tobytes()),
        ("empty", "INT64", [0, 4], b""),
        ("no_strings", "BYTES", [0], b""),
    )
    decoded = decode_inputs(request)
    assert decoded["scalar"].shape == () and decoded["scalar"] == np.float32(2.5)
    assert decoded["empty"].shape == (0, 4) and decoded["no_strings"].shape == (0,)
    assert decode_inputs(typed_request("h", "FP16", [0]))["h"].shape == (0,)


def test_several_inputs_keep_their_names_and_order() -> None:
    a, b = sample("FP32"), sample("INT8", (4,))
    decoded = decode_inputs(raw_request(("a", "FP32", [2, 3], a.tobytes()), ("b", "INT8", [4], b.tobytes())))
    assert list(decoded) == ["a", "b"]
    np.testing.assert_array_equal(decoded["a"], a)
    np.testing.assert_array_equal(decoded["b"], b)


@pytest.mark.parametrize("datatype", [*NUMERIC, "BYTES"])
def test_encode_outputs_then_decode_as_input(datatype: str) -> None:
    array = WORDS.reshape(2, 3) if datatype == "BYTES" else sample(datatype)
    response = ModelInferResponse(model_name="m")
    encode_outputs(response, {"y": array})
    (output,) = response.outputs
    assert (output.name, output.datatype, list(output.shape)) == ("y", datatype, [2, 3])
    assert len(response.raw_output_contents) == 1 and not output.HasField("contents")
    echoed = raw_request(("y", output.datatype, list(output.shape), response.raw_output_contents[0]))
    np.testing.assert_array_equal(decode_inputs(echoed)["y"], array)


def test_encode_outputs_raw_layout() -> None:
    response = ModelInferResponse()
    big_endian = np.arange(6, dtype=">i4").reshape(2, 3)
    transposed = np.arange(6, dtype=np.float64).reshape(2, 3).T  # not C-contiguous
    words = np.array([["a", "\u00e9"]])  # a str array is BYTES, UTF-8 encoded
    encode_outputs(response, {"be": big_endian, "t": transposed, "w": words})
    assert [o.name for o in response.outputs] == ["be", "t", "w"]
    assert [o.datatype for o in response.outputs] == ["INT32", "FP64", "BYTES"]
    assert response.raw_output_contents[0] == np.arange(6, dtype="<i4").tobytes()
    assert response.raw_output_contents[1] == np.ascontiguousarray(transposed).tobytes()
    assert list(response.outputs[1].shape) == [3, 2]
    assert response.raw_output_contents[2] == length_prefixed([b"a", "\u00e9".encode()])


def test_encode_outputs_appends_after_existing_outputs() -> None:
    response = ModelInferResponse()
    encode_outputs(response, {"a": np.zeros(2, np.float32)})
    encode_outputs(response, {"b": np.ones(3, np.int64)})
    assert [o.name for o in response.outputs] == ["a", "b"]
    assert len(response.raw_output_contents) == 2


def test_encode_outputs_rejects_a_dtype_without_kserve_name() -> None:
    with pytest.raises(Unsupported, match="'z'"):
        encode_outputs(ModelInferResponse(), {"z": np.zeros(2, np.complex64)})


def test_bytes_encoding_matches_tritonclient() -> None:
    utils = pytest.importorskip("tritonclient.utils")  # pool-safe: it registers no protobuf types
    array = WORDS.reshape(2, 3)
    response = ModelInferResponse()
    encode_outputs(response, {"s": array})
    assert response.raw_output_contents[0] == utils.serialize_byte_tensor(array).item()
    theirs = utils.deserialize_bytes_tensor(response.raw_output_contents[0])
    assert theirs.tolist() == list(WORDS)
    # tritonclient has no numpy bfloat16 (it sends FP32 arrays truncated to BF16): not compared.
    for datatype in (d for d in NUMERIC if d != "BF16"):
        assert utils.np_to_triton_dtype(NUMPY_BY_NAME[datatype]) == datatype


# Parameters and requested outputs -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("parameter", "value"),
    [
        (InferParameter(bool_param=True), True),
        (InferParameter(int64_param=-(2**40)), -(2**40)),
        (InferParameter(string_param="hi"), "hi"),
        (InferParameter(double_param=0.25), 0.25),
        (InferParameter(uint64_param=2**63), 2**63),
        (InferParameter(), None),
    ],
)
def test_parameter_value(parameter: InferParameter, value: object) -> None:
    result = parameter_value(parameter)
    assert result == value and type(result) is type(value)


def test_requested_outputs() -> None:
    request = ModelInferRequest()
    assert requested_outputs(request.outputs) == []
    request.outputs.add(name="b")
    request.outputs.add(name="a")
    assert requested_outputs(request.outputs) == ["b", "a"]
    request.outputs.add(name="b")
    with pytest.raises(InvalidInput, match="'b' is requested more than once"):
        requested_outputs(request.outputs)


# Bad input --------------------------------------------------------------------------------------


def test_unknown_datatype() -> None:
    rejects(raw_request(("img", "FLOAT32", [1], b"\0" * 4)), "'img'", "unknown datatype 'FLOAT32'")
    rejects(typed_request("img", "", [1], fp32_contents=[1.0]), "'img'", "unknown datatype ''")


def test_negative_dimension() -> None:
    rejects(raw_request(("img", "FP32", [2, -1], b"")), "'img'", "negative dimension")
    rejects(typed_request("img", "FP32", [-2], fp32_contents=[]), "'img'", "negative dimension")


def test_raw_byte_count_mismatch_names_tensor_and_both_sizes() -> None:
    rejects(raw_request(("img", "FP32", [2, 3], b"\0" * 20)), "'img'", "needs 24 bytes", "got 20")
    rejects(raw_request(("img", "INT64", [1], b"\0" * 9)), "'img'", "needs 8 bytes", "got 9")


def test_raw_contents_must_cover_every_input() -> None:
    request = raw_request(("a", "FP32", [1], b"\0" * 4))
    request.inputs.add(name="b", datatype="FP32", shape=[1])
    rejects(request, "input 'b' has no raw_input_contents entry", "2 inputs but 1 raw")
    extra = raw_request(("a", "FP32", [1], b"\0" * 4))
    extra.raw_input_contents.append(b"\0" * 4)
    rejects(extra, "2 raw_input_contents entries but only 1 inputs")


def test_raw_and_typed_contents_cannot_mix() -> None:
    request = raw_request(("a", "FP32", [1], b"\0" * 4))
    request.inputs[0].contents.fp32_contents.append(1.0)
    # Triton's words (its clients match them), before any count check.
    rejects(
        request, "contents field must not be specified when using raw_input_contents for 'a' for model 'm'"
    )
    both = raw_request(("a", "FP32", [1], b"\0" * 4))
    both.inputs.add(name="b", datatype="FP32", shape=[1], contents=InferTensorContents(fp32_contents=[1.0]))
    rejects(both, "contents field must not be specified when using raw_input_contents for 'b'")


def test_duplicate_input_names() -> None:
    rejects(
        raw_request(("a", "FP32", [1], b"\0" * 4), ("a", "FP32", [1], b"\0" * 4)), "'a'", "more than once"
    )


def test_missing_input_name() -> None:
    rejects(raw_request(("", "FP32", [1], b"\0" * 4)), "input #0 has no name")


def test_typed_element_count_mismatch() -> None:
    rejects(
        typed_request("ids", "INT64", [2, 2], int64_contents=[1, 2, 3]), "'ids'", "needs 4 elements", "got 3"
    )
    rejects(typed_request("ids", "INT64", [2]), "'ids'", "needs 2 elements", "got 0")


def test_typed_contents_in_the_wrong_field() -> None:
    rejects(
        typed_request("ids", "INT64", [1], fp32_contents=[1.0]), "'ids'", "int64_contents", "fp32_contents"
    )


def test_fp16_only_travels_raw() -> None:
    rejects(typed_request("h", "FP16", [1], fp32_contents=[1.0]), "'h'", "raw_input_contents")


def test_narrow_integer_out_of_range() -> None:
    rejects(typed_request("q", "INT8", [2], int_contents=[1, 300]), "'q'", "outside the range of INT8")
    rejects(typed_request("q", "UINT16", [1], uint_contents=[70000]), "'q'", "outside the range of UINT16")


def test_broken_bytes_encoding() -> None:
    good = length_prefixed([b"ab", b"cd"])
    rejects(raw_request(("s", "BYTES", [2], good[:-1])), "'s'")  # last element cut short
    rejects(raw_request(("s", "BYTES", [2], good[:3])), "'s'")  # length prefix cut short
    rejects(raw_request(("s", "BYTES", [2], good + b"\0")), "'s'", "trailing")
    rejects(raw_request(("s", "BYTES", [3], good)), "'s'", "needs 3 BYTES elements")
    rejects(typed_request("s", "BYTES", [3], bytes_contents=[b"a"]), "'s'", "needs 3 elements", "got 1")
