"""What a request's tensors say about themselves, checked before a byte of them is decoded.

Decoding (BYTES elements, typed contents) is Python work proportional to the request: a tensor of
millions of empty BYTES elements sent to an FP32 model must be refused from its header alone, not
after seconds of decoding on the event loop. Both APIs describe their tensors as `TensorHeader`s;
`check_headers` refuses what cannot fit the served version (name, datatype, rank, fixed
dimensions, batch size, element count) or its bounds (limits.max_elements / max_request_bytes,
a decoder's context length); `offload` says when the decoding that remains is large enough to run
in an executor rather than on the event loop; `decode_fixed` decodes the tensors of a plain
request (fixed-size datatypes, raw bytes) from headers that check_headers has passed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from modelyard.common.names import echo
from modelyard.service.errors import InvalidInput, TooLarge
from modelyard.service.generation.layout import ATTENTION_MASK, INPUT_IDS, POSITION_IDS
from modelyard.service.generation.model import DecoderModel
from modelyard.service.repository.model_config import LimitsConfig
from modelyard.service.runtime.signature import Signature, TensorSpec
from modelyard.tensors import MAX_SHAPE_ELEMENTS, NUMPY_BY_NAME, element_count

# A few extra tensors get the precise answer of the checks per tensor (unknown, given twice).
EXTRA_TENSORS_CHECKED = 64


def refuse_extra_tensors(model: str, signature: Signature, inputs: int, outputs: int) -> None:
    """InvalidInput when a request names many more inputs or outputs than the model has: it
    cannot be valid, and refusing it before any work per tensor keeps a message of 700,000
    tensors from holding the event loop for seconds."""
    if inputs <= len(signature.inputs) + EXTRA_TENSORS_CHECKED and outputs <= (
        len(signature.outputs) + EXTRA_TENSORS_CHECKED
    ):
        return  # every request but those refused (it runs on each)
    for kind, given, own in (
        ("inputs", inputs, len(signature.inputs)),
        ("outputs", outputs, len(signature.outputs)),
    ):
        if given > own + EXTRA_TENSORS_CHECKED:
            raise InvalidInput(f"the request names {given} {kind}; model {echo(model)} has {own}")


# Payloads that take Python work per element (BYTES, typed contents) above this many bytes are
# decoded in an executor; below it the hop to a thread costs more than the decoding.
INLINE_DECODE_BYTES = 64 * 1024


class TensorHeader(NamedTuple):  # a tuple: made for every tensor of every request
    name: str
    datatype: str | None  # KServe name; None when the request's datatype is unknown (the decoder says so)
    shape: tuple[int, ...]
    nbytes: int  # the tensor's payload as sent
    per_element: bool  # decoding touches every element in Python (BYTES, typed contents)


@dataclass(frozen=True)
class Bounds:
    """What one request to a version may take, computed once per version: its inputs (datatype,
    shape, fixed dimensions), batch size, the config's limits, and per input the dimensions bounded
    by the model (a decoder's context length and concurrent sequences)."""

    inputs: Mapping[str, tuple[TensorSpec, tuple[tuple[int, int], ...]]]  # name -> spec, fixed dims
    max_batch_size: int
    max_elements: int
    max_request_bytes: int
    # input name -> (axis, largest size, what sets it) for each bounded dimension
    dims: Mapping[str, tuple[tuple[int, int, str], ...]] = field(default_factory=dict)


def bounds_for(signature: Signature, limits: LimitsConfig, decoder: DecoderModel | None = None) -> Bounds:
    """A version's bounds. A decoder graph called through Infer is bounded as Generate bounds it:
    sequences no longer than the context length, no more rows than concurrent sequences."""
    inputs = {
        spec.name: (spec, tuple((i, d) for i, d in enumerate(spec.shape) if d != -1))
        for spec in signature.inputs
    }
    dims: dict[str, tuple[tuple[int, int, str], ...]] = {}
    if decoder is not None:
        context = (1, decoder.context_length, f"the context length {decoder.context_length}")
        rows = decoder.settings.max_concurrent_sequences
        batch = (0, rows, f"generation.max_concurrent_sequences {rows}")
        past = (2, decoder.context_length, context[2])
        dims = {name: (batch, context) for name in (INPUT_IDS, ATTENTION_MASK, POSITION_IDS)}
        dims.update({name: (batch, past) for name in decoder.layout.past_names})
    return Bounds(inputs, signature.max_batch_size, limits.max_elements, limits.max_request_bytes, dims)


def check_headers(bounds: Bounds, headers: Sequence[TensorHeader]) -> None:
    """Raise InvalidInput (or TensorError) for the first tensor that cannot fit the version or a
    bounded dimension, TooLarge when the request is over the element or byte limit."""
    elements = size = 0
    for header in headers:
        name, datatype, shape = header.name, header.datatype, header.shape
        found = bounds.inputs.get(name)
        if found is None:
            raise InvalidInput(f"unknown input {echo(name)}; the model's inputs are {sorted(bounds.inputs)}")
        spec, fixed = found
        if datatype is not None and datatype != spec.datatype:
            raise InvalidInput(f"input {echo(name)}: expected datatype {spec.datatype}, got {datatype}")
        # element_count's common case, without its call per tensor (and min() without a keyword:
        # a scalar's () holds no dimension to check)
        count = math.prod(shape)
        if not 0 < count <= MAX_SHAPE_ELEMENTS or (shape and min(shape) <= 0):
            count = element_count(shape, name)  # negative or overflowing shapes: TensorError
        elements += count
        if len(shape) != len(spec.shape):
            raise InvalidInput(f"input {echo(name)}: expected shape {list(spec.shape)}, got {list(shape)}")
        for i, d in fixed:  # a loop, not any(): no generator per tensor of every request
            if shape[i] != d:
                raise InvalidInput(
                    f"input {echo(name)}: expected shape {list(spec.shape)}, got {list(shape)}"
                )
        limit = bounds.max_batch_size
        if limit and shape and shape[0] > limit:
            raise InvalidInput(f"input {echo(name)}: batch size {shape[0]} exceeds max_batch_size {limit}")
        if bounds.dims:
            for axis, largest, what in bounds.dims.get(name, ()):
                if axis < len(shape) and shape[axis] > largest:
                    raise InvalidInput(
                        f"input {echo(name)}: dimension {axis} is {shape[axis]}, beyond {what}"
                    )
        size += header.nbytes
    if elements > bounds.max_elements:
        raise TooLarge(
            f"the request's inputs hold {elements} elements; the model takes at most "
            f"{bounds.max_elements} (limits.max_elements)"
        )
    if size > bounds.max_request_bytes:
        raise TooLarge(
            f"the request's tensors hold {size} bytes; the model takes at most "
            f"{bounds.max_request_bytes} (limits.max_request_bytes)"
        )


def offload(headers: Sequence[TensorHeader]) -> bool:
    """True when decoding these tensors is worth an executor hop (see INLINE_DECODE_BYTES)."""
    return sum(h.nbytes for h in headers if h.per_element) > INLINE_DECODE_BYTES


def decode_fixed(headers: Sequence[TensorHeader], contents: Sequence[bytes]) -> dict[str, np.ndarray]:
    """A plain request's tensors (each of a fixed-size datatype, its raw bytes in `contents`) as
    zero-copy arrays, from headers that check_headers has passed (names, datatypes, shapes): what
    is left to check is that no tensor comes twice and that each holds its shape's bytes. Both
    APIs read plain requests this way (service/api/tensor_headers.py)."""
    arrays: dict[str, np.ndarray] = {}
    if len(headers) != len(contents):  # zip(strict=True)'s check, without its keyword call
        raise ValueError("a header per tensor's contents")
    for header, data in zip(headers, contents):  # noqa: B905 (checked above)
        name, datatype, shape = header.name, header.datatype, header.shape
        if name in arrays:
            raise InvalidInput(f"input {echo(name)} is given twice")
        assert datatype is not None  # a plain request's datatypes are known
        dtype = NUMPY_BY_NAME[datatype]
        expected = math.prod(shape) * dtype.itemsize
        if len(data) != expected:
            raise InvalidInput(
                f"input {echo(name)}: shape {list(shape)} of {datatype} needs {expected} bytes of "
                f"raw data, got {len(data)}"
            )
        arrays[name] = np.frombuffer(data, dtype).reshape(shape)  # positional: cheaper than dtype=
    return arrays
