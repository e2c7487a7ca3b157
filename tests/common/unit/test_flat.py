"""modelyard.flat: the FlatBuffers Infer messages round-trip every fixed-size datatype, decode
without copying, read what any writer of the schema writes, and refuse what they cannot carry or
read."""

from __future__ import annotations

import flatbuffers
import numpy as np
import pytest

from modelyard import flat
from modelyard.flat.v1 import InferRequest, Tensor
from modelyard.tensors import NUMPY_BY_NAME, TensorError


def test_round_trip_of_every_fixed_size_datatype() -> None:
    arrays = {
        name: np.arange(24).reshape(2, 3, 4).astype(dtype)
        for name, dtype in NUMPY_BY_NAME.items()
        if name != "BYTES"
    }
    decoded = flat.decode_request(flat.encode_request("m", arrays, "7", ["a", "b"]))
    assert (decoded.model_name, decoded.model_version, decoded.output_names) == ("m", "7", ("a", "b"))
    for name, array in arrays.items():
        assert decoded.tensors[name].dtype == array.dtype
        np.testing.assert_array_equal(decoded.tensors[name], array)
    scalar = flat.decode_response(flat.encode_response("m", "1", {"s": np.array(2.5, np.float32)}))
    assert scalar.tensors["s"].shape == () and scalar.tensors["s"] == np.float32(2.5)
    integers: dict[str, np.ndarray] = {"u": np.array(3, np.uint8), "i": np.array(7, np.int64)}
    integers["one"] = np.array([9], np.uint8)
    for name, value in flat.decode_response(flat.encode_response("m", "1", integers)).tensors.items():
        assert value.shape == integers[name].shape and value == integers[name]


def test_decoding_makes_no_copy() -> None:
    x = np.random.default_rng(0).standard_normal((256, 1024), np.float32)
    message = flat.encode_request("m", {"x": x})
    view = flat.decode_request(message).tensors["x"]
    assert not view.flags.owndata and not view.flags.writeable
    assert np.shares_memory(view, np.frombuffer(message, np.uint8))
    np.testing.assert_array_equal(view, x)


def test_what_cannot_be_carried_or_read_is_refused() -> None:
    with pytest.raises(TensorError, match="BYTES"):
        flat.encode_request("m", {"s": np.array([b"a"], dtype=object)})
    message = flat.encode_request("m", {"x": np.ones((4, 4), np.float32)})
    for broken in (b"", b"\x00\x01", message[: len(message) // 3]):
        with pytest.raises(TensorError, match="not a valid"):
            flat.decode_request(broken)


def test_tensor_data_starts_on_16_bytes() -> None:
    arrays: dict[str, np.ndarray] = {"a": np.arange(3, dtype=np.uint8), "b": np.ones(5)}
    arrays["c"] = np.ones(2, np.float16)
    message = flat.encode_request("m", arrays, "1", ["b"])
    start = np.frombuffer(message, np.uint8).ctypes.data
    for view in flat.decode_request(message).tensors.values():
        assert (view.ctypes.data - start) % 16 == 0


def written_by_the_generated_builder(pad: int) -> bytes:
    """An FP64 tensor written with flatc's builder functions only: its data aligned to 1 byte (the
    generated starter's alignment), shifted by a `pad`-byte vector written before it."""
    data = np.arange(6, dtype=np.float64).view(np.uint8)
    builder = flatbuffers.Builder(0)
    builder.CreateByteVector(bytes(pad))
    Tensor.TensorStartDataVector(builder, data.size)
    for byte in reversed(data.tolist()):
        builder.PrependUint8(byte)
    data_at = builder.EndVector()
    Tensor.TensorStartShapeVector(builder, 2)
    builder.PrependInt64(3)
    builder.PrependInt64(2)
    shape_at = builder.EndVector()
    name_at, type_at = builder.CreateString("x"), builder.CreateString("FP64")
    Tensor.TensorStart(builder)
    Tensor.TensorAddName(builder, name_at)
    Tensor.TensorAddDatatype(builder, type_at)
    Tensor.TensorAddShape(builder, shape_at)
    Tensor.TensorAddData(builder, data_at)
    tensor_at = Tensor.TensorEnd(builder)
    InferRequest.InferRequestStartInputsVector(builder, 1)
    builder.PrependUOffsetTRelative(tensor_at)
    inputs_at = builder.EndVector()
    model_at = builder.CreateString("m")
    InferRequest.InferRequestStart(builder)
    InferRequest.InferRequestAddModelName(builder, model_at)
    InferRequest.InferRequestAddInputs(builder, inputs_at)
    builder.Finish(InferRequest.InferRequestEnd(builder))
    return bytes(builder.Output())


def test_a_message_from_another_writer_decodes_aligned_or_copied() -> None:
    copied = viewed = 0
    for pad in range(8):  # some of these leave the FP64 data off an 8-byte boundary
        message = written_by_the_generated_builder(pad)
        decoded = flat.decode_request(message)
        x = decoded.tensors["x"]
        assert (decoded.model_name, decoded.model_version, decoded.output_names) == ("m", "", ())
        np.testing.assert_array_equal(x, np.arange(6, dtype=np.float64).reshape(2, 3))
        assert x.flags.aligned and not x.flags.writeable
        if np.shares_memory(x, np.frombuffer(message, np.uint8)):
            viewed += 1
        else:
            copied += 1
    assert copied and viewed
