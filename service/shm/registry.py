"""Registered system shared-memory regions, and bounds-checked reads and writes into them.

A region is (name, key, offset, byte_size): `key` names a POSIX shared-memory object (shm_open's
"/name", i.e. /dev/shm/name on Linux), and the region is `byte_size` bytes of it from `offset`.
The registrations live in a RegionStore; each process opens an object by its key the first time
it serves a request that names a region of it. The store here is in-process; when the service
runs several worker processes, a store they share (one registration visible to every worker)
slots in unchanged, since nothing else is kept per process but the open descriptors.

The objects are read and written with pread/pwrite on their descriptors, never mapped: the
object's owner may shrink it (ftruncate) at any time, and touching a mapping past the new end
kills the process with SIGBUS. pread returns short there instead, and a write is checked against
the object's size first: a shrunk region answers INVALID_ARGUMENT. (A write racing a shrink can
only grow the object back; it cannot fault.) Registrations are bounded in number and bytes.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt

from modelyard.common.names import NAME_MAX, echo
from modelyard.service.errors import InvalidInput, ModelNotFound, TooLarge

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


@dataclass(frozen=True)
class RegionLimits:
    """How many regions may be registered at once, and how many bytes they may span together."""

    count: int = 256
    total_bytes: int = 8 * 1024**3

    def check(self, specs: Sequence[RegionSpec], spec: RegionSpec) -> None:
        """TooLarge when adding `spec` to the registered `specs` would pass a limit."""
        if len(specs) + 1 > self.count:
            raise TooLarge(
                f"shared memory region {echo(spec.name)}: {len(specs)} regions are registered, the "
                f"server's limit is {self.count} (unregister some first)"
            )
        total = sum(s.byte_size for s in specs) + spec.byte_size
        if total > self.total_bytes:
            raise TooLarge(
                f"shared memory region {echo(spec.name)}: {spec.byte_size} more bytes would make "
                f"{total} registered, the server's limit is {self.total_bytes}"
            )


class RegionStore(Protocol):
    """Where registrations live: shared by every process that serves requests."""

    # False when the name is taken; TooLarge (limits.check, under the store's lock) when full.
    def add(self, spec: RegionSpec, limits: RegionLimits | None = None) -> bool: ...
    def remove(self, name: str) -> RegionSpec | None: ...
    def get(self, name: str) -> RegionSpec | None: ...
    def all(self) -> list[RegionSpec]: ...


class LocalRegionStore:
    """The registrations of one process."""

    def __init__(self) -> None:
        self._specs: dict[str, RegionSpec] = {}
        self._lock = threading.Lock()

    def add(self, spec: RegionSpec, limits: RegionLimits | None = None) -> bool:
        with self._lock:
            if spec.name in self._specs:
                return False
            if limits is not None:
                limits.check(list(self._specs.values()), spec)
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


class _Opened:
    """An object's descriptor in this process, closed once it is released and no call uses it."""

    __slots__ = ("fd", "released", "users")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.users = 0
        self.released = False


class SharedMemoryRegistry:
    def __init__(
        self, store: RegionStore | None = None, root: Path = SHM_ROOT, limits: RegionLimits | None = None
    ) -> None:
        self.store: RegionStore = store if store is not None else LocalRegionStore()
        self._root = root
        self._limits = limits if limits is not None else RegionLimits()
        self._opened: dict[str, _Opened] = {}  # by key, in this process
        self._lock = threading.Lock()

    # -- registration (blocking: opens files; run off the event loop) ----------------------

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not name:
            raise InvalidInput("a shared memory region needs a name")
        # The name keys the registrations (and a file shared by workers): short, printable.
        if len(name) > NAME_MAX or not name.isprintable():
            raise InvalidInput(
                f"shared memory region name {echo(name)} must be at most {NAME_MAX} printable characters"
            )
        if self.store.get(name) is not None:
            raise InvalidInput(f"shared memory region {echo(name)} is already registered")
        try:
            with self._use(key) as fd:
                size = os.fstat(fd).st_size
            if offset + byte_size > size:
                raise InvalidInput(
                    f"shared memory region {echo(name)}: offset {offset} + byte_size {byte_size} exceeds "
                    f"the {size} bytes of {echo(key)}"
                )
            if not self.store.add(RegionSpec(name, key, offset, byte_size), self._limits):
                raise InvalidInput(f"shared memory region {echo(name)} is already registered")
        except Exception:
            self._release_unused()  # no descriptor stays open for a refused registration
            raise

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
            raise RegionNotFound(f"no system shared memory region {echo(name)} is registered")
        return [spec]

    # -- data (blocking: a copy of up to a region's size; off the event loop when large) ----

    def read(self, name: str, offset: int, size: int, tensor: str) -> memoryview:
        """A copy of `size` bytes of the region from `offset`; InvalidInput naming the tensor when
        the region is unknown, the span leaves it, or its object is shorter than the region now."""
        spec = self._spec(name, tensor)
        self._check_span(spec, offset, size, tensor)
        buffer = memoryview(bytearray(size))
        start = spec.offset + offset
        with self._use(spec.key) as fd:
            done = 0
            while done < size:
                # Past the object's end pread returns 0 (a mapping would fault there).
                count = os.preadv(fd, [buffer[done:]], start + done)
                if count == 0:
                    raise self._shrunk(spec, tensor)
                done += count
        return buffer

    def write(
        self, name: str, offset: int, capacity: int, data: bytes | npt.NDArray[np.uint8], tensor: str
    ) -> None:
        """Write `data` at `offset` of the region, if it fits both the request's byte size for the
        tensor and the region (and the region's object still holds it)."""
        spec = self._spec(name, tensor)
        self._check_span(spec, offset, capacity, tensor)
        if len(data) > capacity:
            raise InvalidInput(
                f"output {echo(tensor)}: {len(data)} bytes do not fit the {capacity} bytes given for it in "
                f"shared memory region {echo(name)}"
            )
        start = spec.offset + offset
        source = (data.data if isinstance(data, np.ndarray) else memoryview(data)).cast("B")
        with self._use(spec.key) as fd:
            if os.fstat(fd).st_size < start + len(source):
                raise self._shrunk(spec, tensor)
            done = 0
            while done < len(source):
                done += os.pwritev(fd, [source[done:]], start + done)

    def close(self) -> None:
        with self._lock:
            opened, self._opened = self._opened, {}
            for entry in opened.values():
                self._release(entry)

    # -- internals -------------------------------------------------------------------------

    def _spec(self, name: str, tensor: str) -> RegionSpec:
        spec = self.store.get(name)
        if spec is None:
            raise InvalidInput(
                f"tensor {echo(tensor)}: no system shared memory region {echo(name)} is registered"
            )
        return spec

    @staticmethod
    def _check_span(spec: RegionSpec, offset: int, size: int, tensor: str) -> None:
        if offset < 0 or size < 0 or offset + size > spec.byte_size:
            raise InvalidInput(
                f"tensor {echo(tensor)}: {size} bytes at offset {offset} leave shared memory region "
                f"{echo(spec.name)} of {spec.byte_size} bytes"
            )

    @staticmethod
    def _shrunk(spec: RegionSpec, tensor: str) -> InvalidInput:
        return InvalidInput(
            f"tensor {echo(tensor)}: shared memory region {echo(spec.name)} is shorter than registered "
            f"(its object {echo(spec.key)} was shrunk)"
        )

    @contextlib.contextmanager
    def _use(self, key: str) -> Iterator[int]:
        """The object's descriptor, held open while the caller uses it (an unregister meanwhile
        closes it afterwards, never under a read: a reused descriptor number would be another file)."""
        with self._lock:
            entry = self._opened.get(key)
            if entry is None:
                entry = self._opened[key] = _Opened(self._open(key))
            entry.users += 1
        try:
            yield entry.fd
        finally:
            with self._lock:
                entry.users -= 1
                if entry.released and entry.users == 0:
                    os.close(entry.fd)

    def _open(self, key: str) -> int:
        if not _KEY.match(key):
            raise InvalidInput(f"shared memory key {echo(key)} is not a POSIX shared memory name")
        path = self._root / key.lstrip("/")
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise InvalidInput(f"shared memory key {echo(key)} cannot be opened: {exc.strerror}") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
            os.close(fd)
            raise InvalidInput(f"shared memory key {echo(key)} is not a non-empty shared memory object")
        return fd

    def _release_unused(self) -> None:
        used = {spec.key for spec in self.store.all()}
        with self._lock:
            for key in [key for key in self._opened if key not in used]:
                self._release(self._opened.pop(key))

    @staticmethod
    def _release(entry: _Opened) -> None:
        # Under the lock: closed now, or by its last user.
        entry.released = True
        if entry.users == 0:
            os.close(entry.fd)
