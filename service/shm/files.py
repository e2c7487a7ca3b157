"""A RegionStore shared by worker processes: the registrations in one JSON file, changed under an
exclusive lock and replaced atomically (rename), read again only when it was replaced (its inode
changed), so that a request that names a region costs one stat()."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TypeVar

from modelyard.service.shm.registry import Key, RegionLimits, RegionSpec, add_to, key_of

T = TypeVar("T")


class FileRegionStore:
    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock_path = path.with_suffix(".lock")
        self._cached: tuple[tuple[int, ...], dict[Key, RegionSpec]] = ((), {})
        self._thread_lock = threading.RLock()

    def add(self, spec: RegionSpec, limits: RegionLimits | None = None) -> bool:
        # Under the lock every worker takes: the limits hold across workers.
        return self._change(lambda specs: add_to(specs, spec, limits))

    def remove(self, owner: str, name: str) -> RegionSpec | None:
        return self._change(lambda specs: specs.pop((owner, name), None))

    def get(self, owner: str, name: str) -> RegionSpec | None:
        return self._read().get((owner, name))

    def all(self) -> list[RegionSpec]:
        return sorted(self._read().values(), key=key_of)

    def _read(self) -> dict[Key, RegionSpec]:
        try:
            version = _version(os.stat(self._path))
        except FileNotFoundError:
            return {}
        cached, specs = self._cached
        if version == cached:
            return specs
        with self._thread_lock, contextlib.suppress(FileNotFoundError):
            with open(self._path, encoding="utf-8") as file:
                version = _version(os.fstat(file.fileno()))
                specs = {key_of(spec): spec for spec in (RegionSpec(**s) for s in json.load(file))}
            self._cached = (version, specs)
        return self._cached[1]

    def _change(self, change: Callable[[dict[Key, RegionSpec]], T]) -> T:
        with self._locked():
            self._cached = ((), {})  # read afresh under the lock
            specs = dict(self._read())
            result = change(specs)
            temporary = self._path.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps([asdict(s) for s in specs.values()]), encoding="utf-8")
            os.replace(temporary, self._path)
            return result

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock, open(self._lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _version(info: os.stat_result) -> tuple[int, ...]:
    # An inode number can be reused once the replaced file is gone: times and size tell them apart.
    return (info.st_ino, info.st_mtime_ns, info.st_ctime_ns, info.st_size)
