"""Each version's bound on the service's run threads (runtime/capacity.py, Instances): a share of
the threads among the versions that run on them, waiting in order beyond it (bounded, deadlines
honoured), given back when a run ends; and the shadows' spare-capacity rule and idle thread. With
FakeRunners held at their gates (tests/batching_fakes.py): no timing."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from modelyard.service.batching.batcher import Batcher, BatchSettings
from modelyard.service.errors import DeadlineExceeded, Overloaded
from modelyard.service.metrics import ServiceMetrics
from modelyard.service.runtime.capacity import UNBOUNDED, RunCapacity, lowest_priority
from modelyard.service.runtime.instances import Instances
from modelyard.service.runtime.runs import ActiveRuns
from modelyard.service.runtime.served import VersionStats
from modelyard.service.scheduling.queue import AdmissionPolicy, Scheduling
from tests.batching_fakes import FakeRunner
from tests.support import eventually


@pytest.fixture
async def executor() -> AsyncIterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max_workers=4)
    yield pool
    pool.shutdown(wait=True)


def x(value: float) -> dict[str, np.ndarray]:
    return {"x": np.full((1, 3), value, np.float32)}


def versions(threads: int, *runners: FakeRunner, max_runs: int = 0, max_queued: int = 0) -> list[Instances]:
    runs = ActiveRuns(capacity=RunCapacity(threads))
    return [Instances([runner], runs=runs, max_runs=max_runs, max_queued=max_queued) for runner in runners]


def test_the_threads_are_shared_among_the_versions_that_run_on_them() -> None:
    one = versions(4, FakeRunner())[0]
    assert one.limit == UNBOUNDED  # alone: no bound of its own, its runs queue as before
    capacity = one.capacity
    runs = one.runs
    two = Instances([FakeRunner()], runs=runs)
    assert (one.limit, two.limit) == (2, 2)
    Instances([FakeRunner(inline=True)], runs=runs)  # runs on the event loop: takes no thread
    assert (one.limit, two.limit, capacity.versions) == (2, 2, 2)
    three = Instances([FakeRunner()], runs=runs)
    assert (one.limit, two.limit, three.limit) == (1, 1, 1)  # never 0: at least one each
    own = Instances([FakeRunner()], runs=runs, max_runs=3)  # its own bound, whatever the share
    assert own.limit == 3
    three.retire()
    own.retire()
    assert (one.limit, two.limit) == (2, 2)  # the share grows back
    two.retire()
    assert one.limit == UNBOUNDED


async def test_a_version_at_its_bound_waits_in_order_and_another_version_does_not(
    executor: ThreadPoolExecutor,
) -> None:
    slow, fast = FakeRunner(), FakeRunner()
    busy, other = versions(2, slow, fast)
    assert busy.limit == other.limit == 1
    slow.gate.close()
    first = asyncio.ensure_future(busy.run(x(1), ["y"], executor, "v2"))
    await eventually(lambda: slow.gate.entered == 1, "v2's first run to start")
    second = asyncio.ensure_future(busy.run(x(2), ["y"], executor, "v2"))
    third = asyncio.ensure_future(busy.run(x(3), ["y"], executor, "v2"))
    await eventually(lambda: busy.waiting == 2, "v2's next runs to wait for its bound")
    assert busy.capacity.waiting == 2 and slow.gate.entered == 1  # waiting, not on a thread
    # The other version's run starts at once, on the thread v2 may not take.
    assert (await other.run(x(5), ["y"], executor, "v1"))[0].tolist() == [[10.0] * 3]
    assert busy.waiting == 2 and not first.done()
    slow.gate.open()
    assert [(await call)[0][0, 0] for call in (first, second, third)] == [2.0, 4.0, 6.0]
    assert [run[0, 0] for run in slow.runs] == [1.0, 2.0, 3.0]  # in order
    assert (busy.busy, busy.waiting, busy.capacity.waiting) == (0, 0, 0)


async def test_the_wait_is_bounded_and_honours_deadlines_and_cancels(executor: ThreadPoolExecutor) -> None:
    runner = FakeRunner()
    (only,) = versions(1, runner, max_runs=1, max_queued=2)
    runner.gate.close()
    running = asyncio.ensure_future(only.run(x(1), ["y"], executor, "m"))
    await eventually(lambda: runner.gate.entered == 1, "the run to start")
    waits = asyncio.ensure_future(only.run(x(2), ["y"], executor, "m"))
    await eventually(lambda: only.waiting == 1, "a run waiting")
    # Generous: its deadline must not pass before the test has seen it wait.
    late = asyncio.ensure_future(only.run(x(3), ["y"], executor, "m", wait=Scheduling(time_remaining_s=2.0)))
    await eventually(lambda: only.waiting == 2, "two runs waiting")
    with pytest.raises(Overloaded, match="max_queued_runs"):  # the third one is shed at once
        await only.run(x(4), ["y"], executor, "m")
    with pytest.raises(DeadlineExceeded):
        await late
    assert only.waiting == 1 and only.capacity.waiting == 1
    waits.cancel()  # its caller left while it waited: it never runs
    with pytest.raises(asyncio.CancelledError):
        await waits
    assert only.waiting == 0 and only.capacity.waiting == 0
    with pytest.raises(DeadlineExceeded):
        # No time left at all: refused at once, not queued.
        await only.run(x(5), ["y"], executor, "m", wait=Scheduling(timeout_us=1, time_remaining_s=-1.0))
    runner.gate.open()
    await running
    assert [run[0, 0] for run in runner.runs] == [1.0]  # the others never ran
    assert only.busy == 0
    assert (await only.run(x(6), ["y"], executor, "m"))[0][0, 0] == 12.0  # its slot came back


async def test_a_slot_is_given_back_when_the_run_ends_not_when_its_caller_leaves(
    executor: ThreadPoolExecutor,
) -> None:
    runner = FakeRunner()
    (only,) = versions(1, runner, max_runs=1)
    runner.gate.close()
    call = asyncio.ensure_future(only.run(x(1), ["y"], executor, "m"))
    await eventually(lambda: runner.gate.entered == 1, "the run to start")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert only.busy == 1  # its thread is still taken until the run stops
    runner.gate.open()
    await eventually(lambda: only.busy == 0, "the slot back once the run ended")


async def test_shadows_run_only_on_spare_capacity_on_an_idle_priority_thread(
    executor: ThreadPoolExecutor,
) -> None:
    runner = FakeRunner()
    (only,) = versions(1, runner, max_runs=1)
    capacity = only.capacity
    assert capacity.spare(len(only.runs)) == ""
    runner.gate.close()
    shadow = asyncio.ensure_future(only.run_shadow(x(1), ["y"], "m"))
    await eventually(lambda: runner.gate.entered == 1, "the shadow to run")
    assert capacity.shadows == 1 and only.busy == 0  # outside the version's slots
    assert "shadow thread" in capacity.spare(len(only.runs))  # one shadow at a time
    real = asyncio.ensure_future(only.run(x(2), ["y"], executor, "m"))  # not delayed by it
    await eventually(lambda: runner.gate.entered == 2, "the real run to start beside the shadow")
    runner.gate.open()
    await shadow
    await real
    assert capacity.shadows == 0 and capacity.spare(len(only.runs)) == ""
    capacity.waiting = 1
    assert "wait for a run slot" in capacity.spare(0)
    capacity.waiting = 0
    assert "every run thread" in capacity.spare(1)
    assert capacity.close() is not None
    assert "shutting down" in capacity.spare(0)


def test_the_lowest_priority_is_sched_idle_on_linux() -> None:
    seen: list[int] = []

    def look() -> None:
        lowest_priority()
        seen.append(os.sched_getscheduler(0))

    thread = threading.Thread(target=look)
    thread.start()
    thread.join()
    assert seen == [os.SCHED_IDLE]
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # the caller's own thread is untouched


async def test_a_batchers_run_slots_stay_within_its_versions_share(executor: ThreadPoolExecutor) -> None:
    runner = FakeRunner()
    batched, other = versions(2, runner, FakeRunner())
    settings = BatchSettings(
        max_batch_size=1, target_rows=1, max_queue_delay_s=0.0, concurrency=2, admission=AdmissionPolicy()
    )
    metrics = ServiceMetrics().batching("m", "1", 1)
    batcher = Batcher(batched, settings, executor, VersionStats(), metrics, name="m")
    assert batcher._concurrency == 1  # two batches asked, one thread its share
    runner.gate.close()
    calls = [asyncio.ensure_future(batcher.infer(x(v), ("y",))) for v in (1, 2)]
    await eventually(lambda: runner.gate.entered == 1 and batcher.queued == 1, "one batch, one queued")
    other.retire()  # the other version leaves: the share grows back, and the queued one starts
    assert batcher._concurrency == 2
    await eventually(lambda: runner.gate.entered == 2, "the second batch on the thread given back")
    runner.gate.open()
    assert [(await call)["y"][0, 0] for call in calls] == [2.0, 4.0]
    await batcher.close()
