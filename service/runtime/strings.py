"""BYTES tensors <-> ONNX Runtime string tensors.

What ORT's Python binding carries (onnxruntime 1.31, checked by tests/unit/test_strings.py): a
string tensor is fed from an object array of `str` and comes back as an object array of `str`,
both UTF-8 underneath. `bytes` elements are not taken as bytes: the binding calls str() on them,
so b"hi" would reach the model as the text "b'hi'". Embedded NULs and empty strings travel
intact in `str` elements (not in numpy "S"/"U" arrays, which cut at the first NUL). Bytes that are
not valid UTF-8 cannot be represented at all, so a request carrying them is refused, naming the
tensor and the element, rather than altered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from modelyard.service.errors import InvalidInput

Array = npt.NDArray[Any]


def check_utf8(name: str, array: Array) -> None:
    """Raise InvalidInput naming the tensor and element when a BYTES element is not UTF-8."""
    for index, item in enumerate(array.reshape(-1)):
        if isinstance(item, bytes):
            try:
                item.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidInput(
                    f"input {name!r}: BYTES element {index} is not valid UTF-8 (byte {exc.start}); "
                    "ONNX Runtime string tensors carry UTF-8 text only"
                ) from None


def to_ort(array: Array) -> Array:
    """An object array of bytes as the object array of str ORT takes (elements already checked)."""
    out = np.empty(array.shape, dtype=object)
    flat = out.reshape(-1)
    for index, item in enumerate(array.reshape(-1)):
        flat[index] = item.decode("utf-8") if isinstance(item, bytes) else str(item)
    return out


def from_ort(array: Array) -> Array:
    """ORT's object array of str as the object array of bytes the APIs carry."""
    out = np.empty(array.shape, dtype=object)
    flat = out.reshape(-1)
    for index, item in enumerate(array.reshape(-1)):
        flat[index] = item.encode("utf-8") if isinstance(item, str) else bytes(item)
    return out


def feeds_for_ort(feeds: Mapping[str, Array], strings: frozenset[str]) -> dict[str, Array]:
    return {name: to_ort(a) if name in strings else a for name, a in feeds.items()}


def outputs_from_ort(arrays: Sequence[Array]) -> list[Array]:
    return [from_ort(a) if a.dtype == object else a for a in arrays]
