"""The batcher as Triton's: a batch leaves at once when the queued requests make a preferred batch
size (the largest one reachable) without waiting out max_queue_delay for a larger one, and
statistics count compute per request."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from tests.service.unit.test_batcher import Rig, executor, held_first, looked_at_time, queued
from tests.support import eventually

__all__ = ["executor"]  # the fixture, shared with test_batcher


async def test_a_smaller_preferred_size_leaves_without_the_delay(executor: ThreadPoolExecutor) -> None:
    # Preferred [2, 4] of max 4; the delay never passes (the clock is not advanced past it).
    rig = Rig(executor, max_queue_delay_s=10.0, target_rows=4, preferred=frozenset({2, 4}))
    one = rig.send(1)
    await queued(rig, 1)
    await looked_at_time(rig, 0.0)
    assert rig.runner.runs == []  # one row: no preferred size, so it waits for company
    two = rig.send(2)
    await asyncio.gather(one, two)
    assert rig.ran() == [[1, 2]]


async def test_the_largest_reachable_preferred_size_leaves_and_the_rest_waits(
    executor: ThreadPoolExecutor,
) -> None:
    rig = Rig(executor, max_queue_delay_s=10.0, target_rows=4, preferred=frozenset({2}))
    rig.runner.gate.close()
    first = rig.send(0, rows=2)  # a preferred size alone: it leaves at once, held at the gate
    await eventually(lambda: rig.runner.gate.entered == 1, "the first run to start")
    waiting = [rig.send(v) for v in (1, 2, 3)]
    await queued(rig, 3)
    rig.runner.gate.open()
    await asyncio.gather(first, *waiting[:2])
    assert rig.ran() == [[0, 0], [1, 2]]
    await looked_at_time(rig, 0.0)
    assert rig.batcher.queued == 1  # request 3 alone makes no preferred size: it waits
    rig.clock.advance(10.0)
    await waiting[2]
    assert rig.ran()[-1] == [3]


async def test_compute_is_counted_per_request_as_triton_does(executor: ThreadPoolExecutor) -> None:
    rig = Rig(executor, max_batch_size=4, target_rows=4)
    first = await held_first(rig)
    waiting = [rig.send(v) for v in (1, 2, 3)]
    await queued(rig, 3)
    rig.runner.gate.open()
    await asyncio.gather(first, *waiting)
    assert rig.ran() == [[0], [1, 2, 3]]
    assert rig.stats.execution_count == 2
    assert rig.stats.compute_request_count == 4  # four requests, each charged its run's time
    assert rig.stats.compute_request_ns >= rig.stats.compute_ns  # the batch of three counts thrice
