"""What a request's tensors say about themselves, checked before a byte of them is decoded.

Decoding (BYTES elements, typed contents) is Python work proportional to the request: a tensor of
millions of empty BYTES elements sent to an FP32 model must be refused from its header alone, not
after seconds of decoding on the event loop. Both APIs describe their tensors as `TensorHeader`s;
`check_headers` refuses what cannot fit the served version (name, datatype, rank, fixed
dimensions, batch size, element count) or its bounds (limits.max_elements / max_request_bytes,
a decoder's context length); `offload` says when the decoding that remains is large enough to run
in an executor rather than on the event loop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from modelyard.tensors import element_count

from service.errors import InvalidInput, TooLarge
from service.generation.layout import ATTENTION_MASK, INPUT_IDS, POSITION_IDS
from service.generation.model import DecoderModel
from service.repository.config import LimitsConfig
from service.runtime.signature import Signature

# Payloads that take Python work per element (BYTES, typed contents) above this many bytes are
# decoded in an executor; below it the hop to a thread costs more than the decoding.
INLINE_DECODE_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class TensorHeader:
    name: str
    datatype: str | None  # KServe name; None when the request's datatype is unknown (the decoder says so)
    shape: tuple[int, ...]
    nbytes: int  # the tensor's payload as sent
    per_element: bool  # decoding touches every element in Python (BYTES, typed contents)


@dataclass(frozen=True)
class Bounds:
    """What one request to a version may ask: the config's limits, and per input the dimensions
    bounded by the model (a decoder's context length and concurrent sequences)."""

    max_elements: int
    max_request_bytes: int
    # input name -> (axis, largest size, what sets it) for each bounded dimension
    dims: Mapping[str, tuple[tuple[int, int, str], ...]] = field(default_factory=dict)


def bounds_for(limits: LimitsConfig, decoder: DecoderModel | None) -> Bounds:
    """A version's bounds. A decoder graph called through Infer is bounded as Generate bounds it:
    sequences no longer than the context length, no more rows than concurrent sequences."""
    if decoder is None:
        return Bounds(limits.max_elements, limits.max_request_bytes)
    context = (1, decoder.context_length, f"the context length {decoder.context_length}")
    rows = decoder.settings.max_concurrent_sequences
    batch = (0, rows, f"generation.max_concurrent_sequences {rows}")
    past = (2, decoder.context_length, context[2])
    dims = {name: (batch, context) for name in (INPUT_IDS, ATTENTION_MASK, POSITION_IDS)}
    dims.update({name: (batch, past) for name in decoder.layout.past_names})
    return Bounds(limits.max_elements, limits.max_request_bytes, dims)


UNBOUNDED = Bounds(max_elements=1 << 62, max_request_bytes=1 << 62)


def check_headers(signature: Signature, headers: Sequence[TensorHeader], bounds: Bounds = UNBOUNDED) -> None:
    """Raise InvalidInput (or TensorError) for the first tensor that cannot fit `signature` or a
    bounded dimension, TooLarge when the request is over the element or byte limit."""
    specs = {spec.name: spec for spec in signature.inputs}
    elements = 0
    for header in headers:
        spec = specs.get(header.name)
        if spec is None:
            raise InvalidInput(f"unknown input {header.name!r}; the model's inputs are {sorted(specs)}")
        if header.datatype is not None and header.datatype != spec.datatype:
            raise InvalidInput(
                f"input {header.name!r}: expected datatype {spec.datatype}, got {header.datatype}"
            )
        shape = header.shape
        elements += element_count(shape, header.name)  # negative or overflowing shapes: TensorError
        if len(shape) != len(spec.shape) or any(
            want != -1 and have != want for have, want in zip(shape, spec.shape, strict=True)
        ):
            raise InvalidInput(f"input {header.name!r}: expected shape {list(spec.shape)}, got {list(shape)}")
        limit = signature.max_batch_size
        if limit and shape and shape[0] > limit:
            raise InvalidInput(f"input {header.name!r}: batch size {shape[0]} exceeds max_batch_size {limit}")
        for axis, largest, what in bounds.dims.get(header.name, ()):
            if axis < len(shape) and shape[axis] > largest:
                raise InvalidInput(f"input {header.name!r}: dimension {axis} is {shape[axis]}, beyond {what}")
    if elements > bounds.max_elements:
        raise TooLarge(
            f"the request's inputs hold {elements} elements; the model takes at most "
            f"{bounds.max_elements} (limits.max_elements)"
        )
    size = sum(h.nbytes for h in headers)
    if size > bounds.max_request_bytes:
        raise TooLarge(
            f"the request's tensors hold {size} bytes; the model takes at most "
            f"{bounds.max_request_bytes} (limits.max_request_bytes)"
        )


def offload(headers: Sequence[TensorHeader]) -> bool:
    """True when decoding these tensors is worth an executor hop (see INLINE_DECODE_BYTES)."""
    return sum(h.nbytes for h in headers if h.per_element) > INLINE_DECODE_BYTES
