"""What ONNX Runtime's Python string tensors carry, and the runner's BYTES conversions around it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from models.demo_models import make_model, serialize
from modelyard.service.errors import InvalidInput, ModelLoadError
from modelyard.service.repository.config import ModelConfig
from modelyard.service.runtime.providers import detect_providers
from modelyard.service.runtime.session import load_runner
from modelyard.service.runtime.strings import check_utf8
from tests.strings_model import string_identity

SAMPLES = [b"hello", b"", b"a\x00b", "é".encode(), b"\x00", b"x" * 1000]


def objects(items: list[object]) -> np.ndarray:
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


def test_numpy_fixed_width_strings_lose_nul_so_they_are_not_used(session: ort.InferenceSession) -> None:
    (out,) = session.run(None, {"TEXT": np.array([b"a\x00b"], dtype="S")})
    assert out.tolist() == ["a"]


def test_non_utf8_cannot_be_expressed(session: ort.InferenceSession) -> None:
    with pytest.raises(UnicodeDecodeError):
        session.run(None, {"TEXT": np.array([b"\xff"], dtype="S")})
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


def test_non_utf8_input_is_refused_naming_tensor_and_element() -> None:
    check_utf8("TEXT", objects([b"ok", "é".encode()]))
    with pytest.raises(InvalidInput, match=r"input 'TEXT': BYTES element 1 is not valid UTF-8"):
        check_utf8("TEXT", objects([b"ok", b"\xff\xfe"]))


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
