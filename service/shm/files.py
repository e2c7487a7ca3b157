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

from modelyard.service.shm.registry import RegionLimits, RegionSpec

T = TypeVar("T")


class FileRegionStore:
    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock_path = path.with_suffix(".lock")
        self._cached: tuple[tuple[int, ...], dict[str, RegionSpec]] = ((), {})
        self._thread_lock = threading.RLock()

    def add(self, spec: RegionSpec, limits: RegionLimits | None = None) -> bool:
        def change(specs: dict[str, RegionSpec]) -> bool:
            if spec.name in specs:
                return False
            if limits is not None:
                limits.check(list(specs.values()), spec)  # under the lock every worker takes
            specs[spec.name] = spec
            return True

        return self._change(change)

    def remove(self, name: str) -> RegionSpec | None:
        return self._change(lambda specs: specs.pop(name, None))

    def get(self, name: str) -> RegionSpec | None:
        return self._read().get(name)

    def all(self) -> list[RegionSpec]:
        return sorted(self._read().values(), key=lambda s: s.name)

    def _read(self) -> dict[str, RegionSpec]:
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
                specs = {s["name"]: RegionSpec(**s) for s in json.load(file)}
            self._cached = (version, specs)
        return self._cached[1]

    def _change(self, change: Callable[[dict[str, RegionSpec]], T]) -> T:
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
