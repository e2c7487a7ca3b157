"""BYTES tensors <-> ONNX Runtime string tensors.

Triton's BYTES elements are byte strings, and so are ours: any bytes travel through the APIs, the
batcher, ensembles and shared memory. ONNX Runtime keeps a string tensor's elements as C++
`std::string`s, which hold any bytes too; the limits are its Python binding's (onnxruntime 1.31,
checked by tests/service/unit/test_strings.py), and they decide how a tensor is fed:

- an object array of `str` reaches the model as those strings' UTF-8, embedded NULs and empty
  strings intact; `bytes` elements in an object array are not taken as bytes (the binding calls
  str() on them: b"hi" would reach the model as the text "b'hi'");
- a fixed-width numpy bytes array (dtype "S") reaches it as raw bytes, any bytes, but each element
  only up to its first NUL (the binding reads C strings; an element as wide as the dtype would run
  into the next one, so the width is the longest element's plus one).

So a tensor whose elements are all UTF-8 goes as `str` (lossless); one holding any other bytes
goes as fixed-width bytes, which is lossless while no element holds a NUL byte. A tensor that
holds both (bytes that are not UTF-8, and a NUL in some element) cannot be carried without
altering it, and is refused, naming the tensor and the element. Outputs come back through the
binding as `str`, decoded as UTF-8 strictly: a model whose string output is not UTF-8 fails its
run (ModelRunner.run says so).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from modelyard.service.errors import InvalidInput, TooLarge

Array = npt.NDArray[Any]

# A fixed-width copy takes count x (longest + 1) bytes: up to this much beyond what its elements
# hold is allowed, so that one long element among many short ones cannot ask for gigabytes.
PADDING_ALLOWANCE = 1 << 20


def _utf8(item: object) -> bool:
    if not isinstance(item, bytes):
        return True  # str (or anything str() takes): fed as text
    try:
        item.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def check_strings(name: str, array: Array) -> None:
    """Raise InvalidInput naming the tensor and element when a BYTES tensor cannot reach ONNX
    Runtime as it is: it holds bytes that are not UTF-8 and an element holds a NUL byte. Raise
    TooLarge when its fixed-width copy would be far larger than its elements. (A request's check,
    before it queues; to_ort checks again what a batch of requests together makes.)"""
    flat = array.reshape(-1)
    binary = next((i for i, item in enumerate(flat) if not _utf8(item)), None)
    if binary is not None:
        _check_fixed_width(name, flat, binary)


def _check_fixed_width(name: str, flat: Array, binary: int) -> None:
    """Element `binary` is not UTF-8, so the tensor goes as fixed-width bytes: no NUL may be in
    any element, and the copy must stay near the size of what the elements hold."""
    with_nul = next((i for i, item in enumerate(flat) if b"\0" in _as_bytes(item)), None)
    if with_nul is not None:
        raise InvalidInput(
            f"input {name!r}: BYTES element {binary} is not UTF-8 and element {with_nul} holds a NUL "
            "byte; ONNX Runtime's Python binding takes a tensor's bytes either as UTF-8 text (NULs "
            "kept) or as C strings (any bytes, up to a NUL), not both"
        )
    held = sum(len(_as_bytes(item)) for item in flat)
    width = max((len(_as_bytes(item)) for item in flat), default=0) + 1
    if flat.size * width > 2 * (held + flat.size) + PADDING_ALLOWANCE:
        raise TooLarge(
            f"input {name!r}: its BYTES elements are not UTF-8, so they go to ONNX Runtime as "
            f"fixed-width bytes ({flat.size} x {width} bytes, the longest element's width), far more "
            f"than the {held} bytes they hold; send elements of similar lengths"
        )


def _as_bytes(item: object) -> bytes:
    return item if isinstance(item, bytes) else str(item).encode("utf-8")


def to_ort(name: str, array: Array) -> Array:
    """A BYTES tensor (an object array of bytes) as ORT's Python binding takes it losslessly:
    str elements when every one is UTF-8, else fixed-width bytes one wider than the longest
    element (checked again here: a batch joins requests that each passed check_strings; a batch
    that fails is run request by request)."""
    flat = array.reshape(-1)
    out = np.empty(array.shape, dtype=object)
    texts = out.reshape(-1)
    for index, item in enumerate(flat):
        if isinstance(item, bytes):
            try:
                texts[index] = item.decode("utf-8")
            except UnicodeDecodeError:
                _check_fixed_width(name, flat, index)
                items = [_as_bytes(each) for each in flat]
                fixed = np.array(items, dtype=f"S{max(len(b) for b in items) + 1}")
                return fixed.reshape(array.shape)
        else:
            texts[index] = str(item)
    return out


def from_ort(array: Array) -> Array:
    """ORT's object array of str as the object array of bytes the APIs carry."""
    out = np.empty(array.shape, dtype=object)
    flat = out.reshape(-1)
    for index, item in enumerate(array.reshape(-1)):
        flat[index] = item.encode("utf-8") if isinstance(item, str) else bytes(item)
    return out


def feeds_for_ort(feeds: Mapping[str, Array], strings: frozenset[str]) -> dict[str, Array]:
    return {name: to_ort(name, a) if name in strings else a for name, a in feeds.items()}


def outputs_from_ort(arrays: Sequence[Array]) -> list[Array]:
    return [from_ort(a) if a.dtype == object else a for a in arrays]
