"""The shared-memory registry on real POSIX shared memory: bounds, views, writes, unregister."""

from __future__ import annotations

import os
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import pytest

from modelyard.service.errors import InvalidInput, TooLarge
from modelyard.service.shm.files import FileRegionStore
from modelyard.service.shm.registry import (
    LocalRegionStore,
    RegionLimits,
    RegionNotFound,
    RegionSpec,
    SharedMemoryRegistry,
)


@pytest.fixture
def region() -> Iterator[shared_memory.SharedMemory]:
    block = shared_memory.SharedMemory(f"modelyard_unit_{os.getpid()}", create=True, size=256)
    try:
        yield block
    finally:
        block.close()
        block.unlink()


def test_view_and_write_stay_within_the_region(region: shared_memory.SharedMemory) -> None:
    registry = SharedMemoryRegistry()
    registry.register("r", "/" + region.name, 64, 128, owner="")  # bytes 64..191 of the object
    region.buf[64:72] = np.arange(2, dtype=np.float32).tobytes()
    view = registry.read("r", 0, 8, "x", owner="")
    assert np.frombuffer(view, np.float32).tolist() == [0.0, 1.0]
    registry.write("r", 120, 8, b"\x01" * 8, "y", owner="")
    assert bytes(region.buf[184:192]) == b"\x01" * 8
    with pytest.raises(InvalidInput, match=r"'x'.*leave shared memory region 'r'"):
        registry.read("r", 124, 8, "x", owner="")
    with pytest.raises(InvalidInput, match="do not fit"):
        registry.write("r", 0, 4, b"12345678", "y", owner="")
    del view
    registry.unregister("r", owner="")
    with pytest.raises(InvalidInput, match="no system shared memory region 'r'"):
        registry.read("r", 0, 8, "x", owner="")
    registry.close()


def test_registration_is_checked(region: shared_memory.SharedMemory) -> None:
    registry = SharedMemoryRegistry()
    key = "/" + region.name
    with pytest.raises(InvalidInput, match="exceeds"):
        registry.register("r", key, 200, 100, owner="")
    for bad_key in ("/../etc/passwd", "a/b", "/nope_not_there"):
        with pytest.raises(InvalidInput):
            registry.register("r", bad_key, 0, 1, owner="")
    registry.register("r", key, 0, 8, owner="")
    with pytest.raises(InvalidInput, match="already registered"):
        registry.register("r", key, 0, 8, owner="")
    assert registry.status(owner="") == [RegionSpec("r", key, 0, 8, "")]
    with pytest.raises(RegionNotFound):
        registry.status("other", owner="")
    registry.unregister(owner="")
    assert registry.status(owner="") == []
    registry.close()


def test_a_registration_made_elsewhere_is_opened_by_key(region: shared_memory.SharedMemory) -> None:
    # Two registries over one store stand for two worker processes: either serves the region.
    store = LocalRegionStore()
    SharedMemoryRegistry(store).register("r", "/" + region.name, 0, 16, owner="")
    other = SharedMemoryRegistry(store)
    other.write("r", 0, 4, b"abcd", "y", owner="")
    assert bytes(region.buf[:4]) == b"abcd"
    other.close()


def test_a_shrunk_object_is_invalid_input_not_a_fault(region: shared_memory.SharedMemory) -> None:
    registry = SharedMemoryRegistry()
    registry.register("r", "/" + region.name, 0, 256, owner="")
    os.ftruncate(region._fd, 100)  # type: ignore[attr-defined]  # the owner shrinks it
    assert bytes(registry.read("r", 0, 100, "x", owner="")) == bytes(100)  # what is still there reads
    with pytest.raises(InvalidInput, match="region 'r' is shorter than registered"):
        registry.read("r", 64, 64, "x", owner="")
    with pytest.raises(InvalidInput, match="region 'r' is shorter than registered"):
        registry.write("r", 64, 64, b"\x01" * 64, "y", owner="")
    assert os.fstat(region._fd).st_size == 100  # type: ignore[attr-defined]  # a refused write grows nothing
    os.ftruncate(region._fd, 256)  # type: ignore[attr-defined]  # so that close() can unmap its buffer
    registry.close()


def test_registrations_are_bounded(region: shared_memory.SharedMemory) -> None:
    registry = SharedMemoryRegistry(limits=RegionLimits(count=2, total_bytes=200))
    key = "/" + region.name
    registry.register("a", key, 0, 150, owner="")
    with pytest.raises(TooLarge, match="limit is 200"):
        registry.register("b", key, 0, 51, owner="")
    registry.register("b", key, 0, 50, owner="")
    with pytest.raises(TooLarge, match="limit is 2"):
        registry.register("c", key, 0, 1, owner="")
    with pytest.raises(InvalidInput, match="at most 128"):
        registry.register("n" * 129, key, 0, 1, owner="")
    registry.unregister("a", owner="")
    registry.register("c", key, 0, 1, owner="")
    registry.close()


def test_regions_belong_to_their_owner(region: shared_memory.SharedMemory) -> None:
    # Another caller can neither read, write, list nor unregister them: to it the name is unknown.
    registry = SharedMemoryRegistry(limits=RegionLimits(count=1, total_bytes=256))
    key = "/" + region.name
    registry.register("r", key, 0, 16, owner="token:alice")
    region.buf[:4] = b"abcd"
    for other in ("token:mallory", ""):
        with pytest.raises(InvalidInput, match="no system shared memory region 'r'"):
            registry.read("r", 0, 4, "x", owner=other)
        with pytest.raises(InvalidInput, match="no system shared memory region 'r'"):
            registry.write("r", 0, 4, b"zzzz", "y", owner=other)
        assert registry.status(owner=other) == []
        with pytest.raises(RegionNotFound):
            registry.status("r", owner=other)
        registry.unregister("r", owner=other)
        registry.unregister(owner=other)  # "every region" of the other caller: none
    assert bytes(region.buf[:4]) == b"abcd"
    assert [s.name for s in registry.status(owner="token:alice")] == ["r"]
    # Names and limits are per owner: the other caller has a region "r" of its own.
    registry.register("r", key, 8, 8, owner="token:mallory")
    with pytest.raises(TooLarge, match="limit is 1"):
        registry.register("s", key, 0, 1, owner="token:mallory")
    view = registry.of(lambda: "token:alice")
    assert bytes(view.read("r", 0, 4, "x")) == b"abcd"
    registry.unregister(owner="token:alice")
    assert [s.owner for s in registry.status(owner="token:mallory")] == ["token:mallory"]
    registry.close()


def test_the_file_store_keeps_owners_apart(region: shared_memory.SharedMemory, tmp_path: Path) -> None:
    # The store that worker processes share: two registries over one file, two owners.
    path = tmp_path / "regions.json"
    first, second = SharedMemoryRegistry(FileRegionStore(path)), SharedMemoryRegistry(FileRegionStore(path))
    key = "/" + region.name
    first.register("r", key, 0, 16, owner="token:alice")
    first.register("r", key, 16, 16, owner="")
    region.buf[:4], region.buf[16:20] = b"aaaa", b"nnnn"
    assert bytes(second.read("r", 0, 4, "x", owner="token:alice")) == b"aaaa"
    assert bytes(second.read("r", 0, 4, "x", owner="")) == b"nnnn"
    second.unregister(owner="")
    assert [s.owner for s in first.store.all()] == ["token:alice"]
    first.close()
    second.close()
