"""What a request's tensors say about themselves, checked before a byte of them is decoded.

Decoding (BYTES elements, typed contents) is Python work proportional to the request: a tensor of
millions of empty BYTES elements sent to an FP32 model must be refused from its header alone, not
after seconds of decoding on the event loop. Both APIs describe their tensors as `TensorHeader`s;
`check_headers` refuses what cannot fit the served version (name, datatype, rank, fixed
dimensions, element count); `offload` says when the decoding that remains is large enough to run
in an executor rather than on the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from modelyard.tensors import element_count

from service.errors import InvalidInput
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


def check_headers(signature: Signature, headers: Sequence[TensorHeader]) -> None:
    """Raise InvalidInput (or TensorError) for the first tensor that cannot fit `signature`."""
    specs = {spec.name: spec for spec in signature.inputs}
    for header in headers:
        spec = specs.get(header.name)
        if spec is None:
            raise InvalidInput(f"unknown input {header.name!r}; the model's inputs are {sorted(specs)}")
        if header.datatype is not None and header.datatype != spec.datatype:
            raise InvalidInput(
                f"input {header.name!r}: expected datatype {spec.datatype}, got {header.datatype}"
            )
        shape = header.shape
        if len(shape) != len(spec.shape) or any(
            want != -1 and have != want for have, want in zip(shape, spec.shape, strict=True)
        ):
            raise InvalidInput(f"input {header.name!r}: expected shape {list(spec.shape)}, got {list(shape)}")
        limit = signature.max_batch_size
        if limit and shape and shape[0] > limit:
            raise InvalidInput(f"input {header.name!r}: batch size {shape[0]} exceeds max_batch_size {limit}")
        element_count(shape, header.name)  # overflowing shapes: TensorError (INVALID_ARGUMENT)


def offload(headers: Sequence[TensorHeader]) -> bool:
    """True when decoding these tensors is worth an executor hop (see INLINE_DECODE_BYTES)."""
    return sum(h.nbytes for h in headers if h.per_element) > INLINE_DECODE_BYTES
