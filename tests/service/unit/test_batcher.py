"""The batcher with a fake runner and a hand-stepped clock: batches form, priorities overtake,
bounds refuse at once, expired and cancelled requests never run, failures stay per request.

Runs are held at the fake runner's gate while a test builds up a queue, so nothing depends on the
machine's speed: the first request takes the only run slot, the rest wait behind it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from modelyard.service.batching.batcher import Batcher, BatchSettings, default_concurrency
from modelyard.service.errors import (
    DeadlineExceeded,
    InvalidInput,
    ModelRunError,
    ModelUnavailable,
    Overloaded,
)
from modelyard.service.metrics import ServiceMetrics
from modelyard.service.repository.model_config import ExecutionConfig, ModelConfig
from modelyard.service.runtime.instances import Instances
from modelyard.service.runtime.providers import CPU, CUDA
from modelyard.service.runtime.served import VersionStats
from modelyard.service.scheduling.queue import AdmissionPolicy, QueuePolicy, Scheduling
from tests.batching_fakes import FakeRunner, ManualClock
from tests.support import eventually, metric

ADMISSION = AdmissionPolicy(
    priority_levels=2,
    default_priority_level=2,
    default_queue_policy=QueuePolicy(max_queue_size=6, allow_timeout_override=True),
    priority_queue_policy=((1, QueuePolicy(max_queue_size=2)),),
)


class Rig:
    """A batcher over a FakeRunner, with its stats, metrics and clock at hand."""

    def __init__(self, executor: ThreadPoolExecutor, inline: bool = False, **settings: object) -> None:
        values: dict[str, object] = {
            "max_batch_size": 4,
            "target_rows": 4,
            "max_queue_delay_s": 0.0,
            "concurrency": 1,
            "admission": ADMISSION,
        }
        values.update(settings)
        self.runner = FakeRunner(inline=inline)
        self.clock = ManualClock()
        self.stats = VersionStats()
        self.metrics = ServiceMetrics()
        self.batcher = Batcher(
            Instances([self.runner]),
            BatchSettings(**values),  # type: ignore[arg-type]
            executor,
            self.stats,
            self.metrics.batching("m", "1", 2),
            self.clock,
            name="model m version 1",
        )

    def send(
        self, value: float, rows: int = 1, width: int = 3, **scheduling: object
    ) -> asyncio.Future[dict[str, np.ndarray]]:
        """One request whose x is `value` everywhere, so that each run shows whose rows it ran."""
        x = np.full((rows, width), value, np.float32)
        task = asyncio.ensure_future(
            self.batcher.infer({"x": x}, ("y",), Scheduling(**scheduling))  # type: ignore[arg-type]
        )
        return task

    def sample(self, name: str, **labels: str) -> float | None:
        return metric(self.metrics.registry, name, model="m", version="1", **labels)

    def ran(self) -> list[list[float]]:
        """The requests (by value) of each run, in order."""
        return [[float(v) for v in x[:, 0]] for x in self.runner.runs]


@pytest.fixture
async def executor() -> AsyncIterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max_workers=2)
    yield pool
    pool.shutdown(wait=True)


async def queued(rig: Rig, count: int) -> None:
    """Wait until `count` requests wait in the batcher's queue."""
    await eventually(lambda: rig.batcher.queued == count, f"{count} requests queued")


async def looked_at_time(rig: Rig, seconds: float) -> None:
    """Step the clock, and wait until the batcher's loop has taken its turn at the new time."""
    waits = rig.clock.waits
    rig.clock.advance(seconds)
    await eventually(lambda: rig.clock.waits > waits, "the batcher's loop to look at the time")


async def held_first(rig: Rig) -> asyncio.Future[dict[str, np.ndarray]]:
    """The first request, running and held: it takes the only slot."""
    rig.runner.gate.close()
    first = rig.send(0)
    await eventually(lambda: rig.runner.gate.entered == 1, "the first run to start")
    return first


async def test_requests_that_wait_together_run_together(executor: ThreadPoolExecutor) -> None:
    rig = Rig(executor, max_batch_size=4, target_rows=4)
    first = await held_first(rig)
    waiting = [rig.send(v) for v in (1, 2, 3, 4, 5, 6)]
    await queued(rig, 6)
    assert rig.batcher.queued == 6
    rig.runner.gate.open()
    results = await asyncio.gather(first, *waiting)
    assert rig.ran() == [[0], [1, 2, 3, 4], [5, 6]]  # up to max_batch_size, oldest first
    for value, result in zip(range(7), results, strict=True):
        assert list(result) == ["y"]
        np.testing.assert_array_equal(result["y"], np.full((1, 3), 2 * value, np.float32))
    assert rig.stats.execution_count == 3 and rig.stats.inference_count == 7
    assert rig.stats.success_count == 7 and rig.stats.queue_count == 7
    assert rig.sample("modelyard_batch_size_count") == 3
    assert rig.sample("modelyard_batch_size_sum") == 7


async def test_a_batchs_answers_go_out_before_the_next_batch_forms(executor: ThreadPoolExecutor) -> None:
    """A caller that sends again as soon as it is answered (a closed-loop client) joins the
    request that waited behind its batch: the next batch forms after the answers went out."""
    rig = Rig(executor)
    rig.runner.gate.close()

    async def closed_loop() -> None:
        for value in (0, 2):  # awaited here, as a handler awaits it (no task between)
            await rig.batcher.infer({"x": np.full((1, 3), value, np.float32)}, ("y",))

    client = asyncio.ensure_future(closed_loop())
    await eventually(lambda: rig.runner.gate.entered == 1, "the first run to start")
    waiting = rig.send(1)
    await queued(rig, 1)
    rig.runner.gate.open()
    await asyncio.gather(client, waiting)
    assert rig.ran() == [[0], [1, 2]]
    assert rig.stats.success_count == 3 and rig.stats.queue_count == 3


async def test_a_caller_that_leaves_a_running_batch_stops_waiting_and_the_rest_are_answered(
    executor: ThreadPoolExecutor,
) -> None:
    rig = Rig(executor, target_rows=2, max_queue_delay_s=1.0)  # two rows leave at once, together
    rig.runner.gate.close()
    leaving, staying = rig.send(1), rig.send(2)
    await eventually(lambda: rig.runner.gate.entered == 1, "the batch of both to start")
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    rig.runner.gate.open()
    answer = await asyncio.wait_for(staying, 10)  # not left hanging by the one that left
    np.testing.assert_array_equal(answer["y"], np.full((1, 3), 4, np.float32))
    assert rig.ran() == [[1, 2]]  # one run, not stopped: a caller still waited for it
    assert rig.stats.success_count == 2 and rig.stats.execution_count == 1


async def test_only_matching_shapes_share_a_run_and_others_still_run(executor: ThreadPoolExecutor) -> None:
    rig = Rig(executor)
    first = await held_first(rig)
    wide = rig.send(1, width=5)
    narrow = [rig.send(v) for v in (2, 3)]
    big = rig.send(4, rows=3)  # 3 rows do not fit beside the 2 narrow rows (max 4)
    await queued(rig, 4)
    rig.runner.gate.open()
    await asyncio.gather(first, wide, *narrow, big)
    assert rig.ran() == [[0], [1], [2, 3], [4, 4, 4]]
    assert (await big)["y"].shape == (3, 3)


async def test_higher_priority_overtakes_a_full_low_priority_queue(executor: ThreadPoolExecutor) -> None:
    rig = Rig(executor, max_batch_size=2, target_rows=2)
    first = await held_first(rig)
    low = [rig.send(10 + i) for i in range(6)]  # fills level 2 (max_queue_size 6)
    await queued(rig, 6)
    with pytest.raises(Overloaded, match="priority 2 queue"):
        await rig.send(99)  # refused at once: the held run is still holding every slot
    high = [rig.send(1, priority=1), rig.send(2, priority=1)]
    await queued(rig, 8)
    assert rig.batcher.queued_at(1) == 2 and rig.batcher.queued_at(2) == 6
    assert rig.sample("modelyard_queue_depth", priority="1") == 2
    rig.runner.gate.open()
    await asyncio.gather(first, *low, *high)
    assert rig.ran() == [[0], [1, 2], [10, 11], [12, 13], [14, 15]]
    assert rig.sample("modelyard_queue_rejections_total", priority="2", reason="queue_full") == 1


async def test_deadline_passed_in_the_queue_is_answered_and_never_run(executor: ThreadPoolExecutor) -> None:
    rig = Rig(executor)
    first = await held_first(rig)
    expiring = rig.send(1, timeout_us=1000)  # level 2 allows a shorter timeout
    kept = rig.send(2)
    await queued(rig, 2)
    rig.clock.advance(0.002)
    with pytest.raises(DeadlineExceeded, match="not run"):
        await expiring  # answered while the held run still holds the slot
    rig.runner.gate.open()
    await asyncio.gather(first, kept)
    assert rig.ran() == [[0], [2]]
    assert rig.sample("modelyard_queue_rejections_total", priority="2", reason="deadline") == 1
    assert rig.stats.fail_count == 1


async def test_client_deadline_counts_too(executor: ThreadPoolExecutor) -> None:
    rig = Rig(executor)
    first = await held_first(rig)
    expiring = rig.send(1, time_remaining_s=0.5)
    await queued(rig, 1)
    await looked_at_time(rig, 0.4)
    assert not expiring.done()
    rig.clock.advance(0.2)
    with pytest.raises(DeadlineExceeded):
        await expiring
    with pytest.raises(DeadlineExceeded):
        await rig.send(2, time_remaining_s=0.0)  # already late: refused at the door
    rig.runner.gate.open()
    await first
    assert rig.ran() == [[0]]


async def test_cancelled_while_queued_is_removed_and_never_run(executor: ThreadPoolExecutor) -> None:
    rig = Rig(executor)
    first = await held_first(rig)
    leaving, staying = rig.send(1), rig.send(2)
    await queued(rig, 2)
    leaving.cancel()
    await queued(rig, 1)
    assert rig.sample("modelyard_queue_rejections_total", priority="2", reason="cancelled") == 1
    rig.runner.gate.open()
    await asyncio.gather(first, staying)
    assert rig.ran() == [[0], [2]]


async def test_a_lone_request_waits_out_the_queue_delay_for_company(executor: ThreadPoolExecutor) -> None:
    rig = Rig(executor, max_queue_delay_s=0.001, target_rows=3)
    lone = rig.send(1)
    await queued(rig, 1)
    assert rig.runner.runs == []
    second = rig.send(2)
    await queued(rig, 2)
    await looked_at_time(rig, 0.0)
    assert rig.runner.runs == []  # two rows: not yet the preferred three
    rig.clock.advance(0.001)
    await asyncio.gather(lone, second)
    assert rig.ran() == [[1, 2]]
    # A preferred size leaves at once, without waiting out the delay.
    await asyncio.gather(rig.send(3), rig.send(4), rig.send(5))
    assert rig.ran()[-1] == [3, 4, 5]


async def test_inline_models_run_at_once_or_batch_with_a_delay(executor: ThreadPoolExecutor) -> None:
    rig = Rig(executor, inline=True, max_batch_size=8, target_rows=8)
    results = await asyncio.gather(*(rig.send(v) for v in range(3)))
    assert rig.ran() == [[0], [1], [2]]  # each ran before the next arrived: nothing to batch
    assert [float(r["y"][0, 0]) for r in results] == [0, 2, 4]
    delayed = Rig(executor, inline=True, max_batch_size=8, target_rows=8, max_queue_delay_s=0.001)
    waiting = [delayed.send(v) for v in range(5)]
    await queued(delayed, 5)
    assert delayed.runner.runs == []
    delayed.clock.advance(0.001)
    await asyncio.gather(*waiting)
    assert delayed.ran() == [[0, 1, 2, 3, 4]]


async def test_a_failing_request_does_not_fail_its_batch(executor: ThreadPoolExecutor) -> None:
    rig = Rig(executor)
    first = await held_first(rig)
    good, bad, other = rig.send(1), rig.send(float("nan")), rig.send(3)
    await queued(rig, 3)
    rig.runner.gate.open()
    await first
    assert float((await good)["y"][0, 0]) == 2 and float((await other)["y"][0, 0]) == 6
    with pytest.raises(ModelRunError, match="model m version 1 failed: x holds a NaN"):
        await bad
    assert len(rig.runner.runs) == 5  # the held one, the failed batch, then each request alone
    assert rig.stats.fail_count == 1 and rig.stats.success_count == 3


async def test_outputs_each_request_asked_for(executor: ThreadPoolExecutor) -> None:
    rig = Rig(executor)
    first = await held_first(rig)
    x = np.ones((1, 3), np.float32)
    sums = asyncio.ensure_future(rig.batcher.infer({"x": x}, ("s",)))
    both = asyncio.ensure_future(rig.batcher.infer({"x": x}, ("s", "y")))
    await queued(rig, 2)
    rig.runner.gate.open()
    await first
    assert list(await sums) == ["s"] and list(await both) == ["s", "y"]
    assert rig.runner.rows == [1, 2]


async def test_priority_must_be_a_level(executor: ThreadPoolExecutor) -> None:
    rig = Rig(executor)
    with pytest.raises(InvalidInput, match="priority 3"):
        await rig.send(1, priority=3)
    assert rig.runner.runs == []


async def test_close_answers_what_is_left_and_refuses_more(executor: ThreadPoolExecutor) -> None:
    rig = Rig(executor)
    first = await held_first(rig)
    left = rig.send(1)
    await queued(rig, 1)
    await rig.batcher.close()
    with pytest.raises(ModelUnavailable):
        await left
    with pytest.raises(ModelUnavailable):
        await rig.send(2)
    assert rig.sample("modelyard_queue_depth", priority="2") is None  # the version's series are gone
    rig.runner.gate.open()
    await first


async def test_concurrent_batches_up_to_the_limit(executor: ThreadPoolExecutor) -> None:
    rig = Rig(executor, concurrency=2)
    rig.runner.gate.close()
    running = [rig.send(1), rig.send(2)]
    await eventually(lambda: rig.runner.gate.entered == 2, "two runs at once")
    third = rig.send(3)
    await queued(rig, 1)
    rig.runner.gate.open()
    await asyncio.gather(*running, third)


def test_default_concurrency_fits_the_device() -> None:
    assert default_concurrency(ModelConfig(), CPU, cpus=2) == 1  # ORT's pool already uses every core
    assert default_concurrency(ModelConfig(), CPU, cpus=16) == 1
    four_threads = ModelConfig(execution=ExecutionConfig(intra_op_threads=4))
    assert default_concurrency(four_threads, CPU, cpus=16) == 3  # a core left to the event loop
    one_thread = ModelConfig(execution=ExecutionConfig(intra_op_threads=1))
    assert default_concurrency(one_thread, CPU, cpus=2) == 1
    assert default_concurrency(ModelConfig(), CUDA, cpus=2) == 2
