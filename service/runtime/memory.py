"""Give freed heap memory back to the operating system after a model version is released.

Destroying an ONNX Runtime session frees its arena, but glibc keeps freed pages in its heaps for
reuse, so without a trim the resident size of a process that swaps versions climbs for a long
while before it levels off. malloc_trim(0) returns them. A no-op where libc has no malloc_trim.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

_trim: Callable[[int], int] | None = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _trim = _libc.malloc_trim
except (OSError, AttributeError):  # musl, macOS: nothing to do
    _trim = None


def trim_heap() -> None:
    if _trim is not None:
        _trim(0)
