"""Registered system shared-memory regions, and bounds-checked reads and writes into them.

A region is (name, key, offset, byte_size): `key` names a POSIX shared-memory object (shm_open's
"/name", i.e. /dev/shm/name on Linux), and the region is `byte_size` bytes of it from `offset`.
The registrations live in a RegionStore; each process opens an object by its key the first time
it serves a request that names a region of it. The store here is in-process; when the service
runs several worker processes, a store they share (one registration visible to every worker)
slots in unchanged, since nothing else is kept per process but the open descriptors.

Regions belong to the caller that registered them (its `owner`: the identity of its credential,
modelyard.process.auth.Authorizer.identity; "" for a caller without one): each owner has its own
names, sees, uses and unregisters only its own regions, and another's region answers exactly as a
name nobody registered. The limits hold per owner, so one caller cannot fill the table for others.

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
from collections.abc import Callable, Iterable, Iterator, Sequence
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
    owner: str = ""  # who registered it (Authorizer.identity); "" a caller without a credential


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


Key = tuple[str, str]  # (owner, name)


def key_of(spec: RegionSpec) -> Key:
    return (spec.owner, spec.name)


def owned(specs: Iterable[RegionSpec], owner: str) -> list[RegionSpec]:
    return [s for s in specs if s.owner == owner]


def add_to(specs: dict[Key, RegionSpec], spec: RegionSpec, limits: RegionLimits | None) -> bool:
    """The one rule of adding (under the store's lock): False when the owner has the name already;
    TooLarge when the owner's regions would pass a limit."""
    if key_of(spec) in specs:
        return False
    if limits is not None:
        limits.check(owned(specs.values(), spec.owner), spec)
    specs[key_of(spec)] = spec
    return True


class RegionStore(Protocol):
    """Where registrations live: shared by every process that serves requests."""

    # False when the owner has the name already; TooLarge (limits.check, under the store's lock)
    # when the owner's regions are at a limit.
    def add(self, spec: RegionSpec, limits: RegionLimits | None = None) -> bool: ...
    def remove(self, owner: str, name: str) -> RegionSpec | None: ...
    def get(self, owner: str, name: str) -> RegionSpec | None: ...
    def all(self) -> list[RegionSpec]: ...  # every owner's


class LocalRegionStore:
    """The registrations of one process."""

    def __init__(self) -> None:
        self._specs: dict[Key, RegionSpec] = {}
        self._lock = threading.Lock()

    def add(self, spec: RegionSpec, limits: RegionLimits | None = None) -> bool:
        with self._lock:
            return add_to(self._specs, spec, limits)

    def remove(self, owner: str, name: str) -> RegionSpec | None:
        with self._lock:
            return self._specs.pop((owner, name), None)

    def get(self, owner: str, name: str) -> RegionSpec | None:
        return self._specs.get((owner, name))

    def all(self) -> list[RegionSpec]:
        with self._lock:
            return sorted(self._specs.values(), key=key_of)


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

    def of(self, owner: Callable[[], str]) -> Regions:
        """The regions of one call's caller (`owner` is asked once, when a region is first named)."""
        return Regions(self, owner)

    # -- registration (blocking: opens files; run off the event loop) ----------------------

    def register(self, name: str, key: str, offset: int, byte_size: int, *, owner: str) -> None:
        if not name:
            raise InvalidInput("a shared memory region needs a name")
        # The name keys the registrations (and a file shared by workers): short, printable.
        if len(name) > NAME_MAX or not name.isprintable():
            raise InvalidInput(
                f"shared memory region name {echo(name)} must be at most {NAME_MAX} printable characters"
            )
        if self.store.get(owner, name) is not None:
            raise InvalidInput(f"shared memory region {echo(name)} is already registered")
        try:
            with self._use(key) as fd:
                size = os.fstat(fd).st_size
            if offset + byte_size > size:
                raise InvalidInput(
                    f"shared memory region {echo(name)}: offset {offset} + byte_size {byte_size} exceeds "
                    f"the {size} bytes of {echo(key)}"
                )
            if not self.store.add(RegionSpec(name, key, offset, byte_size, owner), self._limits):
                raise InvalidInput(f"shared memory region {echo(name)} is already registered")
        except Exception:
            self._release_unused()  # no descriptor stays open for a refused registration
            raise

    def unregister(self, name: str = "", *, owner: str) -> None:
        """One of the owner's regions, or all of them when `name` is empty; an unknown name is no
        error."""
        for spec in owned(self.store.all(), owner) if not name else [self.store.get(owner, name)]:
            if spec is not None:
                self.store.remove(owner, spec.name)
        self._release_unused()

    def status(self, name: str = "", *, owner: str) -> list[RegionSpec]:
        if not name:
            return owned(self.store.all(), owner)
        spec = self.store.get(owner, name)
        if spec is None:
            raise RegionNotFound(f"no system shared memory region {echo(name)} is registered")
        return [spec]

    # -- data (blocking: a copy of up to a region's size; off the event loop when large) ----

    def read(self, name: str, offset: int, size: int, tensor: str, *, owner: str) -> memoryview:
        """A copy of `size` bytes of the owner's region from `offset`; InvalidInput naming the tensor
        when the region is unknown, the span leaves it, or its object is shorter than the region now."""
        spec = self._spec(owner, name, tensor)
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
        self,
        name: str,
        offset: int,
        capacity: int,
        data: bytes | npt.NDArray[np.uint8],
        tensor: str,
        *,
        owner: str,
    ) -> None:
        """Write `data` at `offset` of the owner's region, if it fits both the request's byte size
        for the tensor and the region (and the region's object still holds it)."""
        spec = self._spec(owner, name, tensor)
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

    def _spec(self, owner: str, name: str, tensor: str) -> RegionSpec:
        spec = self.store.get(owner, name)
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


class Regions:
    """One call's view of the registry: its caller's regions, read and written by name. The owner
    is asked for only when the call names a region (most calls never do)."""

    __slots__ = ("_identify", "_owner", "_registry")

    def __init__(self, registry: SharedMemoryRegistry, identify: Callable[[], str]) -> None:
        self._registry = registry
        self._identify = identify
        self._owner: str | None = None

    @property
    def owner(self) -> str:
        if self._owner is None:
            self._owner = self._identify()
        return self._owner

    def read(self, name: str, offset: int, size: int, tensor: str) -> memoryview:
        return self._registry.read(name, offset, size, tensor, owner=self.owner)

    def write(
        self, name: str, offset: int, capacity: int, data: bytes | npt.NDArray[np.uint8], tensor: str
    ) -> None:
        self._registry.write(name, offset, capacity, data, tensor, owner=self.owner)
