"""Give freed heap memory back to the operating system after a model version is released; and
how much memory the process may use (the default of the run memory bound).

Destroying an ONNX Runtime session frees its arena, but glibc keeps freed pages in its heaps for
reuse, so without a trim the resident size of a process that swaps versions climbs for a long
while before it levels off. malloc_trim(0) returns them. A no-op where libc has no malloc_trim.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from pathlib import Path

from modelyard.process.cores import CGROUP

_trim: Callable[[int], int] | None = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _trim = _libc.malloc_trim
except (OSError, AttributeError):  # musl, macOS: nothing to do
    _trim = None


def trim_heap() -> None:
    if _trim is not None:
        _trim(0)


def usable_memory_bytes(cgroup: Path = CGROUP, meminfo: Path = Path("/proc/meminfo")) -> int:
    """The memory this process may use: its cgroup's limit (v2 memory.max, v1
    memory.limit_in_bytes) where it is below the machine's, else the machine's (MemTotal); 0 when
    neither can be read."""
    total = 0
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        total = 0
    for limit_file in (cgroup / "memory.max", cgroup / "memory" / "memory.limit_in_bytes"):
        try:
            text = limit_file.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and (not total or int(text) < total):
            return int(text)
    return total
