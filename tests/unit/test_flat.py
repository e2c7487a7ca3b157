"""modelyard.flat: the FlatBuffers Infer messages round-trip every fixed-size datatype, decode
without copying, and refuse what they cannot carry or read."""

from __future__ import annotations

import numpy as np
import pytest
from modelyard import flat
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
