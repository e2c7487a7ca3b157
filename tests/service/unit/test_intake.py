"""Header checks before decoding, and when decoding leaves the event loop."""

from __future__ import annotations

import pytest

from modelyard.service.errors import InvalidInput
from modelyard.service.intake import INLINE_DECODE_BYTES, TensorHeader, bounds_for, check_headers, offload
from modelyard.service.repository.model_config import LimitsConfig
from modelyard.service.runtime.signature import Signature, TensorSpec
from modelyard.tensors import TensorError

SIG = Signature((TensorSpec("x", "FP32", (-1, 4)), TensorSpec("s", "BYTES", (-1,))), (), max_batch_size=8)
BOUNDS = bounds_for(SIG, LimitsConfig())


def header(name: str, datatype: str | None, shape: tuple[int, ...], nbytes: int = 0) -> TensorHeader:
    return TensorHeader(name, datatype, shape, nbytes, per_element=datatype == "BYTES")


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        (header("y", "FP32", (1, 4)), "unknown input 'y'"),
        (header("x", "BYTES", (3_000_000, 4), 48_000_000), "expected datatype FP32, got BYTES"),
        (header("x", "FP32", (1, 5)), "expected shape [-1, 4]"),
        (header("x", "FP32", (1, 4, 1)), "expected shape [-1, 4]"),
        (header("x", "FP32", (9, 4)), "batch size 9 exceeds max_batch_size 8"),
    ],
)
def test_headers_that_cannot_fit_are_refused(bad: TensorHeader, words: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        check_headers(BOUNDS, [bad])
    assert words in str(caught.value)


def test_overflowing_shapes_are_refused_from_the_header() -> None:
    sig = Signature((TensorSpec("x", "FP32", (-1, -1, -1)),), (), max_batch_size=0)
    with pytest.raises(TensorError):
        check_headers(bounds_for(sig, LimitsConfig()), [header("x", "FP32", (2**31, 2**31, 2**31))])


def test_fitting_headers_pass_and_large_per_element_payloads_leave_the_loop() -> None:
    small = [header("x", "FP32", (2, 4), 32), header("s", "BYTES", (2,), 10)]
    check_headers(BOUNDS, small)
    assert not offload(small)
    assert offload([header("s", "BYTES", (8,), INLINE_DECODE_BYTES + 1)])
    assert not offload([header("x", "FP32", (8, 4), 10 * INLINE_DECODE_BYTES)])  # zero-copy view
