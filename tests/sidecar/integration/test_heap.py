"""A sidecar that is its own process (the CLI's) freezes what start-up made; one in a host
process (the tests', an embedding) leaves that process's collector alone."""

from __future__ import annotations

import gc

from modelyard.sidecar.server import build_sidecar
from modelyard.sidecar.settings import Settings


async def _frozen_after_start(settle_heap: bool) -> int:
    settings = Settings(listen="127.0.0.1:0", upstream=("127.0.0.1:1",), admin_listen="")
    sidecar = build_sidecar(settings, settle_heap=settle_heap)
    gc.unfreeze()
    try:
        await sidecar.start()
        return gc.get_freeze_count()
    finally:
        gc.unfreeze()  # this test process's collector as it was
        await sidecar.stop(grace_s=0.1)


async def test_its_own_process_freezes_start_ups_objects() -> None:
    assert await _frozen_after_start(True) > 0


async def test_a_host_process_is_left_alone() -> None:
    assert await _frozen_after_start(False) == 0
