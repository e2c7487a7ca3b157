"""Triton's classification strings, and label files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from modelyard.service.answers import top_k
from modelyard.service.errors import InvalidInput
from modelyard.service.repository.labels import load_labels
from modelyard.service.repository.model_config import ConfigError, ModelConfig, TensorConfig


def test_rows_descending_ties_by_lower_index_with_labels() -> None:
    out = top_k("o", np.array([[0.1, 0.5, 0.5, 0.2]], np.float32), 3, True, ["a", "b"])
    assert out.tolist() == [[b"0.500000:1:b", b"0.500000:2", b"0.200000:3"]]


def test_integers_print_as_integers_and_unbatched_is_flat() -> None:
    out = top_k("o", np.array([[0, 255], [9, 1]], np.uint8), 10, False, [])
    assert out.tolist() == [b"255:1", b"9:2", b"1:3", b"0:0"]


def test_non_numeric_outputs_are_refused() -> None:
    with pytest.raises(InvalidInput, match="'o'"):
        top_k("o", np.array([b"x"], dtype=object), 1, False, [])


def test_label_file_beside_the_config(tmp_path: Path) -> None:
    (tmp_path / "labels.txt").write_text("cat\ndog\n")
    config = ModelConfig(outputs=(TensorConfig("y", "FP32", (-1, 2), "labels.txt"),))
    assert load_labels(tmp_path, config) == {"y": ("cat", "dog")}
    (tmp_path / "labels.txt").unlink()
    with pytest.raises(ConfigError, match=r"labels\.txt"):
        load_labels(tmp_path, config)
