"""Triton's classification extension: a requested output with parameter `classification` = k
comes back as BYTES holding its k largest values, each "value:index" or "value:index:label".

As Triton formats them (server/src/classification.cc): values with C++ std::to_string (floats
with six decimals, integers as they are), classes in descending order of value, the label from
the output's label file when it has a line for that index. A batching model is classified row by
row ([batch, k]); any other output as one flat list ([k]). k is capped at the element count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from modelyard.service.api.names import quoted
from modelyard.service.errors import InvalidInput

Array = npt.NDArray[Any]


def top_k(name: str, array: Array, k: int, batched: bool, labels: Sequence[str]) -> Array:
    """The classification strings of `array` (an object array of bytes)."""
    if array.dtype.kind not in "iuf":
        raise InvalidInput(f"output {quoted(name)}: classification needs a numeric output, not {array.dtype}")
    if k < 1:
        raise InvalidInput(f"output {quoted(name)}: classification count must be at least 1, got {k}")
    rows = array.reshape(array.shape[0] if batched and array.ndim else 1, -1)
    count = min(k, rows.shape[1])
    out = np.empty((rows.shape[0], count), dtype=object)
    for r, row in enumerate(rows):
        # Descending, ties by lower index: a stable ascending sort of the reversed row, read
        # backwards (negating the row instead would overflow unsigned and minimum values).
        order = row.shape[0] - 1 - np.argsort(row[::-1], kind="stable")[::-1]
        for c, index in enumerate(order[:count]):
            value = row[index]
            text = f"{float(value):f}" if array.dtype.kind == "f" else str(int(value))
            text += f":{index}"
            if index < len(labels) and labels[index]:
                text += f":{labels[index]}"
            out[r, c] = text.encode("utf-8")
    return out if batched and array.ndim else out.reshape(count)
