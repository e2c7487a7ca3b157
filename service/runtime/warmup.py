"""The inputs of a version's warm-up: Triton's `model_warmup` samples from its config
(repository/warmup_config.py) checked against the version's signature and built as feeds, or
synthetic ones (zeros, empty strings) where the config gives none.

A sample's file is read from the model's `warmup` folder, and only once it resolves inside the
repository (repository/files.py), as every file the service reads; messages name it relative to
the repository and never quote its bytes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from modelyard.service.errors import ModelLoadError
from modelyard.service.repository.files import read_inside, shown
from modelyard.service.repository.warmup_config import WARMUP_FOLDER, WarmupInput, WarmupSample
from modelyard.service.runtime.signature import Signature, TensorSpec
from modelyard.tensors import NUMPY_BY_NAME, TensorError, decode_bytes

Array = npt.NDArray[Any]

# What one warm-up file may hold: a sample is a request's worth of data.
MAX_FILE_BYTES = 64 << 20


def synthetic(spec: TensorSpec, rows: int = 1) -> Array:
    """Zeros (empty strings for BYTES) of the spec's shape, dynamic dimensions 1 (the first one
    `rows`)."""
    shape = tuple((rows if i == 0 else 1) if d < 0 else d for i, d in enumerate(spec.shape))
    if spec.datatype == "BYTES":
        return np.full(shape, b"", dtype=object)
    return np.zeros(shape, dtype=NUMPY_BY_NAME[spec.datatype])


def sample_feeds(sample: WarmupSample, signature: Signature, model_dir: Path, root: Path) -> dict[str, Array]:
    """The sample's inputs as feeds of `signature` (batch_size rows of the same row where the model
    batches); ModelLoadError (kind warmup) naming what does not fit."""
    where = f"{shown(root, model_dir)}: model_warmup {sample.name!r}"
    given = dict(sample.inputs)
    expected = [spec.name for spec in signature.inputs]
    if set(given) != set(expected):
        raise ModelLoadError(
            f"{where}: inputs {sorted(given)} are not the model's {sorted(expected)}", "warmup"
        )
    batched = bool(signature.max_batch_size)
    if batched and sample.batch_size > signature.max_batch_size:
        raise ModelLoadError(
            f"{where}: batch_size {sample.batch_size} exceeds max_batch_size {signature.max_batch_size}",
            "warmup",
        )
    if not batched and sample.batch_size != 1:
        raise ModelLoadError(f"{where}: batch_size must be 1 for a model without a batch dimension", "warmup")
    feeds = {}
    for spec in signature.inputs:
        item = given[spec.name]
        shape = ((sample.batch_size,) if batched else ()) + item.dims
        if item.datatype != spec.datatype:
            raise ModelLoadError(
                f"{where}: input {spec.name!r} is {spec.datatype}, not {item.datatype}", "warmup"
            )
        fixed = [(i, d) for i, d in enumerate(spec.shape) if d != -1]
        if len(shape) != len(spec.shape) or any(shape[i] != d for i, d in fixed):
            raise ModelLoadError(
                f"{where}: input {spec.name!r}: dims {list(item.dims)} do not fit {list(spec.shape)}",
                "warmup",
            )
        row = _row(item, f"{where}: input {spec.name!r}", model_dir, root)
        feeds[spec.name] = np.ascontiguousarray(np.broadcast_to(row, shape)) if batched else row
    return feeds


def _row(item: WarmupInput, where: str, model_dir: Path, root: Path) -> Array:
    dtype = NUMPY_BY_NAME[item.datatype]
    dims = item.dims
    if item.datatype == "BYTES" and item.source != "file":
        return np.full(dims, b"", dtype=object)  # as Triton: random strings are empty strings too
    if item.source == "zero":
        return np.zeros(dims, dtype=dtype)
    if item.source == "random":
        return _random(dims, dtype)
    path = model_dir / WARMUP_FOLDER / item.file
    data = read_inside(root, path, MAX_FILE_BYTES)
    if item.datatype == "BYTES":
        try:
            return decode_bytes(data, dims, item.file)
        except TensorError as exc:
            raise ModelLoadError(f"{where}: {shown(root, path)}: {exc}", "warmup") from None
    need = math.prod(dims) * dtype.itemsize
    if len(data) < need:
        raise ModelLoadError(
            f"{where}: {shown(root, path)} holds {len(data)} bytes, the sample needs {need}", "warmup"
        )
    return np.frombuffer(data[:need], dtype=dtype).reshape(dims).copy()


def _random(dims: tuple[int, ...], dtype: np.dtype[Any]) -> Array:
    """Random values of the type (seeded: the same warm-up on every load), finite floats."""
    rng = np.random.default_rng(0)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=dims).astype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=dims, dtype=dtype, endpoint=True)
    return rng.standard_normal(size=dims).astype(dtype)
