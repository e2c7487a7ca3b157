"""Tensor conversion for our API and the schema checks every request passes."""

from __future__ import annotations

import numpy as np
import pytest

from modelyard.inference.v1 import tensor_pb2
from modelyard.service.errors import InvalidInput
from modelyard.service.runtime.signature import Signature, TensorSpec
from modelyard.tensors import TensorError, element_count, to_array, to_tensor

UNKNOWN_TYPE: tensor_pb2.DataType.ValueType = 99  # type: ignore[assignment]  # a value no client should send
DTYPES = [
    np.bool_,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.float16,
    np.float32,
    np.float64,
]


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_every_numeric_type(dtype: type) -> None:
    array: np.ndarray = (
        (np.arange(24) % 2 if dtype is np.bool_ else np.arange(24)).astype(dtype).reshape(2, 3, 4)
    )
    tensor = to_tensor("t", array)
    assert list(tensor.shape) == [2, 3, 4] and len(tensor.raw_data) == array.nbytes
    back = to_array(tensor)
    assert back.dtype == array.dtype
    np.testing.assert_array_equal(back, array)


def test_big_endian_input_goes_out_little_endian() -> None:
    array = np.arange(4, dtype=">f4")
    assert to_tensor("t", array).raw_data == np.arange(4, dtype="<f4").tobytes()


def test_bytes_round_trip() -> None:
    array = np.array([[b"a", b""], [b"hello", "\u00e9".encode()]], dtype=object)
    tensor = to_tensor("s", array)
    assert tensor.datatype == tensor_pb2.DATA_TYPE_BYTES
    np.testing.assert_array_equal(to_array(tensor), array)


def test_decoding_is_zero_copy() -> None:
    tensor = to_tensor("t", np.ones((4, 4), np.float32))
    array = to_array(tensor)
    assert not array.flags.owndata and not array.flags.writeable


@pytest.mark.parametrize(
    ("tensor", "words"),
    [
        (
            tensor_pb2.Tensor(name="x", datatype=tensor_pb2.DATA_TYPE_FP32, shape=[2], raw_data=b"\0" * 7),
            ["'x'", "8 bytes", "7"],
        ),
        (tensor_pb2.Tensor(name="x", shape=[1], raw_data=b"\0"), ["'x'", "datatype"]),
        (tensor_pb2.Tensor(name="x", datatype=UNKNOWN_TYPE, shape=[1]), ["'x'", "datatype"]),
        (tensor_pb2.Tensor(name="x", datatype=tensor_pb2.DATA_TYPE_INT8, shape=[2, -1]), ["'x'", "negative"]),
        (
            tensor_pb2.Tensor(
                name="s", datatype=tensor_pb2.DATA_TYPE_BYTES, shape=[1], raw_data=b"\5\0\0\0ab"
            ),
            ["'s'", "past the end"],
        ),
        (
            tensor_pb2.Tensor(
                name="s", datatype=tensor_pb2.DATA_TYPE_BYTES, shape=[2], raw_data=b"\1\0\0\0a"
            ),
            ["'s'", "2 BYTES elements"],
        ),
    ],
)
def test_malformed_tensors_name_the_tensor(tensor: tensor_pb2.Tensor, words: list[str]) -> None:
    with pytest.raises(TensorError) as caught:
        to_array(tensor)
    assert all(w in str(caught.value) for w in words), str(caught.value)


SIGNATURE = Signature(
    inputs=(TensorSpec("a", "FP32", (-1, 4)), TensorSpec("b", "INT64", (-1, 4))),
    outputs=(TensorSpec("sum", "FP32", (-1, 4)), TensorSpec("argmax", "INT64", (-1,))),
    max_batch_size=8,
)


def test_signature_accepts_matching_inputs() -> None:
    SIGNATURE.check_inputs({"a": np.zeros((3, 4), np.float32), "b": np.zeros((3, 4), np.int64)})
    assert SIGNATURE.select_outputs([]) == ("sum", "argmax")
    assert SIGNATURE.select_outputs(["argmax"]) == ("argmax",)


@pytest.mark.parametrize(
    ("feeds", "words"),
    [
        ({"a": np.zeros((3, 4), np.float32)}, "missing input 'b'"),
        (
            {"a": np.zeros((3, 4), np.float32), "b": np.zeros((3, 4), np.int64), "c": np.zeros(1)},
            "unknown input 'c'",
        ),
        (
            {"a": np.zeros((3, 4), np.float64), "b": np.zeros((3, 4), np.int64)},
            "expected datatype FP32, got FP64",
        ),
        (
            {"a": np.zeros((3, 5), np.float32), "b": np.zeros((3, 4), np.int64)},
            "expected shape [-1, 4], got [3, 5]",
        ),
        ({"a": np.zeros((9, 4), np.float32), "b": np.zeros((9, 4), np.int64)}, "batch size 9 exceeds"),
        ({"a": np.zeros((2, 4), np.float32), "b": np.zeros((3, 4), np.int64)}, "disagree on the batch size"),
    ],
)
def test_signature_rejects(feeds: dict[str, np.ndarray], words: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        SIGNATURE.check_inputs(feeds)
    assert words in str(caught.value)


def test_unknown_or_repeated_outputs() -> None:
    with pytest.raises(InvalidInput, match="unknown output 'x'"):
        SIGNATURE.select_outputs(["x"])
    with pytest.raises(InvalidInput, match="twice"):
        SIGNATURE.select_outputs(["sum", "sum"])


@pytest.mark.parametrize(
    ("shape", "count"),
    [((), 1), ((0,), 0), ((3, 4), 12), ((2**40, 0), 0), ((0, 2**47), 0), ((2**24, 2**24), 2**48)],
)
def test_element_count(shape: tuple[int, ...], count: int) -> None:
    assert element_count(shape, "x") == count


@pytest.mark.parametrize(
    "shape", [(-1,), (2, -3), (2**62,), (2**62, 0), (0, 2**31, 2**31), (2**24, 2**24, 2)]
)
def test_element_count_refuses_negative_and_overflowing_shapes(shape: tuple[int, ...]) -> None:
    with pytest.raises(TensorError, match="'x'"):
        element_count(shape, "x")
