"""What a request's outputs become beyond its run, as it asked (the data plane's Call.answer):
classified, and written into the caller's shared memory regions.

Triton's classification extension: a requested output with parameter `classification` = k
comes back as BYTES holding its k largest values, each "value:index" or "value:index:label".

As Triton formats them (server/src/classification.cc): values with C++ std::to_string (floats
with six decimals, integers as they are), classes in descending order of value, the label from
the output's label file when it has a line for that index. A batching model is classified row by
row ([batch, k]); any other output as one flat list ([k]). k is capped at the element count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from modelyard.common.names import echo
from modelyard.service.errors import InvalidInput, Unsupported
from modelyard.service.shm.registry import Regions
from modelyard.tensors import NUMPY_BY_NAME, name_of, to_wire

Array = npt.NDArray[Any]
ShmLocation = tuple[str, int, int]  # region, offset, byte size


def top_k(name: str, array: Array, k: int, batched: bool, labels: Sequence[str]) -> Array:
    """The classification strings of `array` (an object array of bytes)."""
    if array.dtype.kind not in "iuf":
        raise InvalidInput(f"output {echo(name)}: classification needs a numeric output, not {array.dtype}")
    if k < 1:
        raise InvalidInput(f"output {echo(name)}: classification count must be at least 1, got {k}")
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


def classified(
    outputs: Mapping[str, Array],
    classify: Mapping[str, int],
    batched: bool,
    labels: Mapping[str, Sequence[str]],
) -> dict[str, Array]:
    """`outputs` with each one named in `classify` replaced by its top_k strings."""
    return {
        name: top_k(name, array, classify[name], batched, labels.get(name, ())) if name in classify else array
        for name, array in outputs.items()
    }


def write_to_regions(
    outputs: Mapping[str, Array], in_shm: Mapping[str, ShmLocation], regions: Regions
) -> None:
    """Write each output named in `in_shm` into its region (refused when it does not fit the
    byte size the request gave, or the region)."""
    for name, at in in_shm.items():
        array = outputs.get(name)
        if array is None:
            continue
        array = np.asarray(array)
        region, offset, size = at
        try:
            datatype = name_of(array.dtype)
        except ValueError:
            raise Unsupported(
                f"output {echo(name)}: numpy dtype {array.dtype} has no KServe V2 datatype"
            ) from None
        if array.dtype == NUMPY_BY_NAME[datatype] and datatype != "BYTES":
            # Straight from the array into the region: no intermediate bytes object.
            regions.write(region, offset, size, np.ascontiguousarray(array).reshape(-1).view(np.uint8), name)
        else:
            regions.write(region, offset, size, to_wire(array)[1], name)
