"""Concatenating requests into a batch and splitting the outputs back."""

from __future__ import annotations

import numpy as np
import pytest

from modelyard.service.batching.tensors import batch_key, batch_rows, concat, split
from modelyard.service.errors import ModelRunError


def test_key_ignores_only_the_batch_dimension() -> None:
    a: dict[str, np.ndarray] = {"x": np.zeros((1, 4), np.float32), "i": np.zeros((1, 2), np.int64)}
    b: dict[str, np.ndarray] = {
        "i": np.ones((7, 2), np.int64),
        "x": np.ones((7, 4), np.float32),
    }  # other order, other rows
    assert batch_key(a) == batch_key(b)
    assert batch_key(a) != batch_key({**a, "x": np.zeros((1, 5), np.float32)})  # width
    assert batch_key(a) != batch_key({**a, "x": np.zeros((1, 4), np.float64)})  # dtype
    assert batch_key(a) != batch_key({"x": a["x"]})  # inputs
    assert batch_rows(b) == 7 and batch_rows({}) == 0


def test_concat_then_split_gives_each_request_its_rows() -> None:
    rng = np.random.default_rng(3)
    parts = [
        {"x": rng.standard_normal((n, 3)).astype(np.float32), "t": np.array([[b"a"]] * n, dtype=object)}
        for n in (2, 1, 3)
    ]
    batch = concat(parts)
    assert batch["x"].shape == (6, 3) and batch["t"].shape == (6, 1)
    pieces = split(batch, [2, 1, 3])
    for part, piece in zip(parts, pieces, strict=True):
        np.testing.assert_array_equal(piece["x"], part["x"])
        np.testing.assert_array_equal(piece["t"], part["t"])


def test_split_gives_each_request_the_outputs_it_asked_for() -> None:
    y = np.arange(8, dtype=np.float32).reshape(4, 2)
    one = split({"y": y}, [1, 3], [("y",), ()])  # one output; a request that asked for none
    assert list(one[0]) == ["y"] and one[1] == {}
    np.testing.assert_array_equal(one[0]["y"], y[:1])
    views = split({"y": y}, [3, 1], [("y",), ("y",)])
    assert all(np.shares_memory(piece["y"], y) for piece in views)  # views of the batch, not copies
    np.testing.assert_array_equal(views[1]["y"], y[3:])
    both = split({"y": y, "s": y.sum(axis=1)}, [2, 2], [("s",), ("y", "s")])
    assert list(both[0]) == ["s"] and list(both[1]) == ["y", "s"]
    np.testing.assert_array_equal(both[1]["s"], y[2:].sum(axis=1))


def test_one_request_is_not_copied() -> None:
    x = np.zeros((2, 3), np.float32)
    assert concat([{"x": x}])["x"] is x


@pytest.mark.parametrize("bad", [np.zeros((5, 3)), np.float32(1.0)])
def test_outputs_without_the_batch_rows_cannot_be_split(bad: np.ndarray) -> None:
    with pytest.raises(ModelRunError, match="'y'"):
        split({"y": np.asarray(bad)}, [2, 4])
