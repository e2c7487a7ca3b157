"""What ONNX Runtime's Python string tensors carry, and the runner's BYTES conversions around it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from models.demo_models import make_model, serialize
from modelyard.service.errors import InvalidInput, ModelLoadError, TooLarge, Unsupported
from modelyard.service.repository.model_config import ModelConfig
from modelyard.service.runtime.providers import detect_providers
from modelyard.service.runtime.session import load_runner
from modelyard.service.runtime.strings import check_strings, to_ort
from tests.strings_model import byte_lookup, string_identity

SAMPLES = [b"hello", b"", b"a\x00b", "é".encode(), b"\x00", b"x" * 1000]


def objects(items: Sequence[object]) -> np.ndarray:
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array


@pytest.fixture(scope="module")
def session() -> ort.InferenceSession:
    return ort.InferenceSession(serialize(string_identity(batch=False)), providers=["CPUExecutionProvider"])


def test_onnxruntime_turns_bytes_elements_into_their_repr(session: ort.InferenceSession) -> None:
    # The reason for the conversion: bytes go in as str(b"hi") == "b'hi'".
    (out,) = session.run(None, {"TEXT": objects([b"hi"])})
    assert out.tolist() == ["b'hi'"]


def test_onnxruntime_str_elements_keep_nul_and_empty(session: ort.InferenceSession) -> None:
    texts = ["hello", "", "a\x00b", "é", "\x00"]
    (out,) = session.run(None, {"TEXT": objects(list(texts))})
    assert out.tolist() == texts


def test_numpy_fixed_width_strings_stop_at_nul(session: ort.InferenceSession) -> None:
    (out,) = session.run(None, {"TEXT": np.array([b"a\x00b"], dtype="S")})
    assert out.tolist() == ["a"]


@pytest.fixture(scope="module")
def lookup() -> ort.InferenceSession:
    return ort.InferenceSession(
        serialize(byte_lookup([b"\xff\xfe", b"ok"], batch=False)), providers=["CPUExecutionProvider"]
    )


def test_fixed_width_bytes_reach_the_model_as_raw_bytes(lookup: ort.InferenceSession) -> None:
    # One wider than the longest element: each is then a NUL-terminated C string.
    (ids,) = lookup.run(None, {"TEXT": np.array([b"\xff\xfe", b"ok", b"\xff"], dtype="S3")})
    assert ids.tolist() == [0, 1, -1]


def test_an_element_as_wide_as_the_dtype_runs_into_the_next(lookup: ort.InferenceSession) -> None:
    # Why to_ort makes the width one more than the longest element: the binding reads C strings.
    # (The last element is empty, all NULs, so that nothing is read past the array's end.)
    (ids,) = lookup.run(None, {"TEXT": np.array([b"\xff\xfe", b"ok", b""], dtype="S2")})
    assert ids.tolist() == [-1, 1, -1]


def test_non_utf8_cannot_come_back_or_go_in_as_str(session: ort.InferenceSession) -> None:
    with pytest.raises(UnicodeDecodeError):  # the output is decoded as UTF-8, strictly
        session.run(None, {"TEXT": np.array([b"\xff"], dtype="S2")})
    with pytest.raises(UnicodeEncodeError):
        session.run(None, {"TEXT": objects(["\udcff"])})


def test_runner_round_trips_bytes(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    path.write_bytes(serialize(string_identity(batch=True)))
    runner = load_runner(path, ModelConfig(), detect_providers())
    text = objects(list(SAMPLES)).reshape(2, 3)
    (echo,) = runner.run({"TEXT": text}, ["ECHO"])
    assert echo.shape == (2, 3)
    assert [type(x) for x in echo.reshape(-1)] == [bytes] * 6
    assert echo.reshape(-1).tolist() == SAMPLES


def test_utf8_goes_as_text_and_other_bytes_as_fixed_width() -> None:
    text = objects([b"ok", "é".encode(), b"a\x00b", b""])
    check_strings("TEXT", text)
    assert to_ort("TEXT", text).tolist() == ["ok", "é", "a\x00b", ""]
    binary = objects([b"ok", b"\xff\xfe", b""])
    check_strings("TEXT", binary)
    fed = to_ort("TEXT", binary)
    assert fed.dtype == np.dtype("S3") and fed.tolist() == [b"ok", b"\xff\xfe", b""]


def test_non_utf8_beside_a_nul_is_refused_naming_tensor_and_elements() -> None:
    with pytest.raises(
        InvalidInput, match=r"input 'TEXT': BYTES element 1 is not UTF-8 and element 2 holds a NUL"
    ):
        check_strings("TEXT", objects([b"ok", b"\xff\xfe", b"a\x00"]))


def test_to_ort_refuses_what_a_batch_of_valid_requests_makes_together() -> None:
    # Each request passed check_strings; joined in one batch they cannot be fed as they are (the
    # batcher then runs each request alone).
    joined = objects([b"\xff\xfe", b"a\x00b"])
    with pytest.raises(InvalidInput, match="element 0 is not UTF-8 and element 1 holds a NUL"):
        to_ort("TEXT", joined)


def test_a_fixed_width_copy_far_larger_than_its_elements_is_refused() -> None:
    many = objects([b"\xff"] + [b""] * 100_000 + [b"x" * 4096])
    with pytest.raises(TooLarge, match=r"input 'TEXT'.*100002 x 4097 bytes"):
        check_strings("TEXT", many)
    check_strings("TEXT", objects([b"\xff" * 100] * 1000))  # even lengths: no padding to speak of


def test_runner_feeds_non_utf8_bytes_and_refuses_echoing_them(tmp_path: Path) -> None:
    path = tmp_path / "lookup.onnx"
    path.write_bytes(serialize(byte_lookup([b"\xff\xfe", "é".encode(), b"\x00"])))
    runner = load_runner(path, ModelConfig(), detect_providers())
    (ids,) = runner.run({"TEXT": objects([b"\xff\xfe", "é".encode(), b"zz"]).reshape(1, 3)}, ["ID"])
    assert ids.tolist() == [[0, 1, -1]]
    (ids,) = runner.run({"TEXT": objects([b"\x00", "é".encode()]).reshape(1, 2)}, ["ID"])  # UTF-8: NUL kept
    assert ids.tolist() == [[2, 1]]
    echo_path = tmp_path / "echo.onnx"
    echo_path.write_bytes(serialize(string_identity(batch=True)))
    echo = load_runner(echo_path, ModelConfig(), detect_providers())
    with pytest.raises(Unsupported, match="not UTF-8"):
        echo.run({"TEXT": objects([b"\xff"]).reshape(1, 1)}, ["ECHO"])


def test_a_model_that_emits_non_utf8_fails_to_load_saying_why(tmp_path: Path) -> None:
    constant = helper.make_tensor("c", TensorProto.STRING, [1], vals=[b"\xff\xfe"])  # type: ignore[list-item]
    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["TEXT"], ["copy"]),
            helper.make_node("Constant", [], ["ECHO"], value=constant),
        ],
        "bad_strings",
        [helper.make_tensor_value_info("TEXT", TensorProto.STRING, [1])],
        [helper.make_tensor_value_info("ECHO", TensorProto.STRING, [1])],
    )
    path = tmp_path / "model.onnx"
    path.write_bytes(serialize(make_model(graph)))
    with pytest.raises(ModelLoadError, match="not UTF-8"):
        load_runner(path, ModelConfig(), detect_providers())
