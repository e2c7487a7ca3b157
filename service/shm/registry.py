"""Registered system shared-memory regions, and bounds-checked reads and writes into them.

A region is (name, key, offset, byte_size): `key` names a POSIX shared-memory object (shm_open's
"/name", i.e. /dev/shm/name on Linux), and the region is `byte_size` bytes of it from `offset`.
The registrations live in a RegionStore; each process maps an object by its key the first time
it serves a request that names a region of it. The store here is in-process; when the service
runs several worker processes, a store they share (one registration visible to every worker)
slots in unchanged, since nothing else is kept per process but the mappings themselves.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt

from service.errors import InvalidInput, ModelNotFound

SHM_ROOT = Path("/dev/shm")
# shm_open names: one leading slash, then a plain name.
_KEY = re.compile(r"^/?[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}$")


class RegionNotFound(ModelNotFound):
    """No region is registered under that name (NOT_FOUND, as Triton answers)."""


@dataclass(frozen=True)
class RegionSpec:
    name: str
    key: str
    offset: int
    byte_size: int


class RegionStore(Protocol):
    """Where registrations live: shared by every process that serves requests."""

    def add(self, spec: RegionSpec) -> bool: ...  # False when the name is taken
    def remove(self, name: str) -> RegionSpec | None: ...
    def get(self, name: str) -> RegionSpec | None: ...
    def all(self) -> list[RegionSpec]: ...


class LocalRegionStore:
    """The registrations of one process."""

    def __init__(self) -> None:
        self._specs: dict[str, RegionSpec] = {}
        self._lock = threading.Lock()

    def add(self, spec: RegionSpec) -> bool:
        with self._lock:
            if spec.name in self._specs:
                return False
            self._specs[spec.name] = spec
            return True

    def remove(self, name: str) -> RegionSpec | None:
        with self._lock:
            return self._specs.pop(name, None)

    def get(self, name: str) -> RegionSpec | None:
        return self._specs.get(name)

    def all(self) -> list[RegionSpec]:
        with self._lock:
            return sorted(self._specs.values(), key=lambda s: s.name)


class SharedMemoryRegistry:
    def __init__(self, store: RegionStore | None = None, root: Path = SHM_ROOT) -> None:
        self.store: RegionStore = store if store is not None else LocalRegionStore()
        self._root = root
        self._maps: dict[str, mmap.mmap] = {}  # by key, in this process
        self._lock = threading.Lock()

    # -- registration (blocking: opens files; run off the event loop) ----------------------

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not name:
            raise InvalidInput("a shared memory region needs a name")
        if self.store.get(name) is not None:
            raise InvalidInput(f"shared memory region {name!r} is already registered")
        mapping = self._map(key)
        if offset + byte_size > len(mapping):
            raise InvalidInput(
                f"shared memory region {name!r}: offset {offset} + byte_size {byte_size} exceeds the "
                f"{len(mapping)} bytes of {key!r}"
            )
        if not self.store.add(RegionSpec(name, key, offset, byte_size)):
            raise InvalidInput(f"shared memory region {name!r} is already registered")

    def unregister(self, name: str = "") -> None:
        """One region, or every region when `name` is empty; an unknown name is no error."""
        for spec in self.store.all() if not name else [s for s in [self.store.get(name)] if s]:
            self.store.remove(spec.name)
        self._release_unused()

    def status(self, name: str = "") -> list[RegionSpec]:
        if not name:
            return self.store.all()
        spec = self.store.get(name)
        if spec is None:
            raise RegionNotFound(f"no system shared memory region {name!r} is registered")
        return [spec]

    # -- data ------------------------------------------------------------------------------

    def view(self, name: str, offset: int, size: int, tensor: str) -> memoryview:
        """`size` bytes of the region from `offset`, zero-copy; InvalidInput naming the tensor when
        the region is unknown or the span leaves it."""
        spec = self._spec(name, tensor)
        self._check_span(spec, offset, size, tensor)
        start = spec.offset + offset
        return memoryview(self._map(spec.key))[start : start + size]

    def write(
        self, name: str, offset: int, capacity: int, data: bytes | npt.NDArray[np.uint8], tensor: str
    ) -> None:
        """Write `data` at `offset` of the region, if it fits both the request's byte size for the
        tensor and the region."""
        spec = self._spec(name, tensor)
        self._check_span(spec, offset, capacity, tensor)
        if len(data) > capacity:
            raise InvalidInput(
                f"output {tensor!r}: {len(data)} bytes do not fit the {capacity} bytes given for it in "
                f"shared memory region {name!r}"
            )
        start = spec.offset + offset
        target = np.frombuffer(self._map(spec.key), dtype=np.uint8, count=len(data), offset=start)
        target[:] = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
        del target  # the mapping can be closed once no view of it is left

    def close(self) -> None:
        with self._lock:
            maps, self._maps = self._maps, {}
        for mapping in maps.values():
            _close(mapping)

    # -- internals -------------------------------------------------------------------------

    def _spec(self, name: str, tensor: str) -> RegionSpec:
        spec = self.store.get(name)
        if spec is None:
            raise InvalidInput(f"tensor {tensor!r}: no system shared memory region {name!r} is registered")
        return spec

    @staticmethod
    def _check_span(spec: RegionSpec, offset: int, size: int, tensor: str) -> None:
        if offset < 0 or size < 0 or offset + size > spec.byte_size:
            raise InvalidInput(
                f"tensor {tensor!r}: {size} bytes at offset {offset} leave shared memory region "
                f"{spec.name!r} of {spec.byte_size} bytes"
            )

    def _map(self, key: str) -> mmap.mmap:
        with self._lock:
            mapping = self._maps.get(key)
            if mapping is not None:
                return mapping
            if not _KEY.match(key):
                raise InvalidInput(f"shared memory key {key!r} is not a POSIX shared memory name")
            path = self._root / key.lstrip("/")
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            except OSError as exc:
                raise InvalidInput(f"shared memory key {key!r} cannot be opened: {exc.strerror}") from None
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
                    raise InvalidInput(f"shared memory key {key!r} is not a non-empty shared memory object")
                mapping = mmap.mmap(fd, info.st_size)
            finally:
                os.close(fd)
            self._maps[key] = mapping
            return mapping

    def _release_unused(self) -> None:
        used = {spec.key for spec in self.store.all()}
        with self._lock:
            unused = [key for key in self._maps if key not in used]
            released = [self._maps.pop(key) for key in unused]
        for mapping in released:
            _close(mapping)


def _close(mapping: mmap.mmap) -> None:
    # BufferError: a request still holds a view; the mapping goes when the view does.
    with contextlib.suppress(BufferError):
        mapping.close()
