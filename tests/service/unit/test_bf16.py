"""BF16: the shared tensor helpers and a BF16 ONNX model run by the runner."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np

from models.demo_models import serialize
from modelyard import tensors
from modelyard.service.repository.model_config import ModelConfig
from modelyard.service.runtime.providers import detect_providers
from modelyard.service.runtime.session import load_runner
from tests.bf16_model import bf16_double

BF16 = np.dtype(ml_dtypes.bfloat16)


def test_bf16_has_its_own_name_and_two_byte_wire_form() -> None:
    x = np.array([[1.0, -2.5, 0.1, 3e38]], dtype=BF16)
    assert tensors.name_of(x.dtype) == "BF16"
    name, raw = tensors.to_wire(x)
    assert name == "BF16" and len(raw) == 8
    # The wire form is the upper half of each FP32 value, as tritonclient writes it.
    assert raw == (x.astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
    back = tensors.to_array(tensors.to_tensor("x", x))
    assert back.dtype == BF16 and back.tobytes() == x.tobytes()


def test_bf16_model_loads_and_runs(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    path.write_bytes(serialize(bf16_double()))
    runner = load_runner(path, ModelConfig(), detect_providers())
    assert [(t.name, t.datatype) for t in runner.signature.inputs + runner.signature.outputs] == [
        ("X", "BF16"),
        ("Y", "BF16"),
        ("Y32", "FP32"),
    ]
    x = np.array([[1.0, -2.5, 0.1, 7.0], [0, 1, 2, 3]], dtype=BF16)
    y, y32 = runner.run({"X": x}, ["Y", "Y32"])
    assert y.dtype == BF16 and y.shape == (2, 4)
    np.testing.assert_array_equal(y.astype(np.float32), x.astype(np.float32) * 2)
    np.testing.assert_array_equal(y32, x.astype(np.float32) * 2)
    (empty,) = runner.run({"X": np.zeros((0, 4), dtype=BF16)}, ["Y"])
    assert empty.shape == (0, 4) and empty.dtype == BF16
