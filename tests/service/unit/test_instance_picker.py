"""Model instances: placement on devices, the picker (fewest pending among healthy, ties to the
lowest index, resting after a device fault), runs spread over instances, device faults told from
bad input, the batcher's run slots per instance, and the per-instance metrics.

Runs are held at the fake runners' gates, so which instance is busy is decided by the test."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnxruntime.capi.onnxruntime_pybind11_state import EPFail, Fail, InvalidArgument

from modelyard.service.batching.batcher import Batcher, BatchSettings, default_concurrency
from modelyard.service.errors import DeviceFault, InvalidInput, ModelRejected, ModelRunError
from modelyard.service.metrics import ServiceMetrics
from modelyard.service.repository.model_config import ConfigError, ExecutionConfig, ModelConfig, parse_config
from modelyard.service.runtime.instances import Instances, load_instances, placements
from modelyard.service.runtime.providers import CPU, CUDA, ProviderChoice
from modelyard.service.runtime.served import VersionStats
from modelyard.service.runtime.session import (
    INLINE_WATCHDOG_S,
    ModelRunner,
    _providers,
    is_device_fault,
    run_error,
)
from modelyard.service.scheduling.queue import AdmissionPolicy, Scheduling
from tests.batching_fakes import FakeRunner, FaultyRunner, HandClock, ManualClock
from tests.support import eventually, metric

GPU = ProviderChoice(True, "test: CUDA usable")
NO_GPU = ProviderChoice(False, "test: no CUDA")


@pytest.fixture
async def executor() -> AsyncIterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max_workers=4)
    yield pool
    pool.shutdown(wait=True)


def x(value: float, rows: int = 1) -> dict[str, np.ndarray]:
    return {"x": np.full((rows, 3), value, np.float32)}


# -- placement and config --------------------------------------------------------------------


def test_instances_take_the_devices_in_turn_on_cuda_and_stay_on_the_cpu_otherwise() -> None:
    config = ModelConfig(execution=ExecutionConfig(instances=2, device_ids=(1, 3), device_id=1))
    assert [(p.index, p.device_id) for p in placements(config, GPU)] == [(0, 1), (1, 3), (2, 1), (3, 3)]
    # Without CUDA (or with provider cpu) device_ids name nothing: `instances` sessions on the CPU.
    assert [(p.index, p.device_id) for p in placements(config, NO_GPU)] == [(0, 1), (1, 1)]
    cpu = ModelConfig(execution=ExecutionConfig(provider="cpu", instances=3))
    assert len(placements(cpu, GPU)) == 3


def test_each_instance_is_built_with_its_device_in_the_cuda_provider_options() -> None:
    seen: list[int] = []

    def loader(path: Path, config: ModelConfig, providers: ProviderChoice) -> ModelRunner:
        seen.append(config.execution.device_id)
        return FakeRunner()  # type: ignore[return-value]

    config = ModelConfig(execution=ExecutionConfig(instances=2, device_ids=(0, 1), device_id=0))
    runners = load_instances(loader, Path("m/1/model.onnx"), config, GPU)
    assert len(runners) == 4
    assert seen == [0, 1, 0, 1]
    placed = ModelConfig(execution=ExecutionConfig(device_id=1, gpu_mem_limit_mb=64))
    cuda, cpu = _providers(placed, CUDA)
    assert cuda[0] == CUDA and cuda[1]["device_id"] == 1 and cpu == CPU


@pytest.mark.parametrize(
    ("execution", "named"),
    [
        ({"instances": 0}, "execution.instances: expected an integer >= 1"),
        ({"instances": True}, "execution.instances"),
        ({"instances": 17}, "at most 16 per version"),
        ({"instances": 9, "device_ids": [0, 1]}, "make 18 sessions"),
        ({"device_ids": []}, "execution.device_ids: expected a non-empty list"),
        ({"device_ids": [0, 0]}, "names a device twice"),
        ({"device_ids": [-1]}, "execution.device_ids[0]: expected an integer >= 0, got -1"),
        ({"device_ids": [1], "device_id": 1}, "device_id or device_ids, not both"),
        ({"device_ids": [1], "provider": "cpu"}, "provider is cpu"),
    ],
)
def test_instance_config_errors_name_the_key(execution: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        parse_config({"execution": execution})


def test_instance_config_defaults_to_one_session_on_device_id() -> None:
    assert parse_config({}).execution.sessions == 1
    execution = parse_config({"execution": {"instances": 2, "device_ids": [2, 5]}}).execution
    assert (execution.sessions, execution.device_id, execution.devices) == (4, 2, (2, 5))


# -- the picker ------------------------------------------------------------------------------


def test_the_picker_takes_the_fewest_pending_and_the_lowest_index_on_ties() -> None:
    instances = Instances([FakeRunner(), FakeRunner(), FakeRunner()])
    first, second, third = (instances.start() for _ in range(3))
    assert [i.index for i in (first, second, third)] == [0, 1, 2]  # each tie goes to the lowest index
    assert instances.start().index == 0  # one pending on each: the lowest index
    instances.finish(second)
    assert [i.pending for i in instances.all] == [2, 0, 1]
    assert instances.pick().index == 1  # the fewest pending, whatever its index
    instances.finish(third)
    assert instances.pick().index == 1  # 1 and 2 tie at none pending: the lower index
    instances.finish(first)
    instances.start()
    assert [i.pending for i in instances.all] == [1, 1, 0]


def test_an_instance_that_failed_on_its_device_rests_then_comes_back() -> None:
    clock = HandClock()
    instances = Instances([FakeRunner(), FakeRunner()], clock=clock, backoff_s=10.0)
    broken = instances.start()
    assert broken.index == 0
    instances.finish(broken, DeviceFault("CUDA failure 700"))
    assert not instances.healthy(broken)
    # Skipped while the other is healthy, even with more pending on the other.
    busy = [instances.start() for _ in range(3)]
    assert [i.index for i in busy] == [1, 1, 1]
    clock.now += 9.9
    assert instances.pick().index == 1
    clock.now += 0.2  # its rest is over
    assert instances.pick().index == 0
    assert instances.healthy(broken)


def test_bad_input_does_not_send_an_instance_to_rest() -> None:
    instances = Instances([FakeRunner(), FakeRunner()])
    first = instances.start()
    instances.finish(first, InvalidInput("x has the wrong shape"))
    instances.finish(instances.start(), ModelRunError("a BYTES output holds bytes that are not UTF-8"))
    assert all(instances.healthy(i) for i in instances.all)
    assert instances.pick().index == 0


def test_with_every_instance_resting_the_least_busy_still_runs() -> None:
    clock = HandClock()
    instances = Instances([FakeRunner(), FakeRunner()], clock=clock)
    a, b = instances.start(), instances.start()
    instances.start()  # a second run on instance 0 (ties: lowest index)
    instances.finish(a, DeviceFault("x"))
    instances.finish(b, DeviceFault("y"))
    assert [i.pending for i in instances.all] == [1, 0]
    assert instances.pick().index == 1


def test_device_faults_are_told_from_the_requests_own_failures() -> None:
    assert is_device_fault(EPFail("the CUDA execution provider failed"))
    assert is_device_fault(Fail("CUDA failure 700: an illegal memory access was encountered"))
    assert is_device_fault(Fail("CUBLAS failure 13: CUBLAS_STATUS_EXECUTION_FAILED"))
    assert not is_device_fault(Fail("Non-zero status code returned while running Reshape node"))
    assert not is_device_fault(ValueError("CUDA failure in a message of another kind"))
    assert isinstance(run_error(EPFail("boom"), "model m version 1"), DeviceFault)
    # ONNX Runtime's check of the feeds against the graph's inputs: the request's fault.
    assert isinstance(run_error(InvalidArgument("Invalid rank for input: x"), "m"), InvalidInput)
    # A kernel refusing the shapes it computed, from a request that fitted the signature: the
    # graph's fault or the values' (issue 34), model_rejected either way.
    assert isinstance(run_error(Fail("Reshape: the requested shape is invalid"), "m"), ModelRejected)
    kernel = InvalidArgument("Non-zero status code returned while running Gather node: bad indices")
    assert isinstance(run_error(kernel, "m"), ModelRejected)
    plain = run_error(Fail("the kernel's workspace is not initialised"), "model m version 1")
    assert isinstance(plain, ModelRunError) and not isinstance(plain, DeviceFault)


# -- runs --------------------------------------------------------------------------------------


async def test_a_run_goes_to_the_instance_that_is_not_busy(executor: ThreadPoolExecutor) -> None:
    held, free = FakeRunner(), FakeRunner()
    instances = Instances([held, free])
    held.gate.close()
    first = asyncio.ensure_future(instances.run(x(1), ["y"], executor, "m"))
    await eventually(lambda: held.gate.entered == 1, "the first run to hold instance 0")
    second = await instances.run(x(2), ["y"], executor, "m")  # instance 0 is still busy
    assert second[0].tolist() == [[4.0, 4.0, 4.0]]
    assert [r.tolist() for r in free.runs] == [x(2)["x"].tolist()]
    assert [i.pending for i in instances.all] == [1, 0]
    held.gate.open()
    assert (await first)[0].tolist() == [[2.0, 2.0, 2.0]]
    assert [(i.pending, i.runs) for i in instances.all] == [(0, 1), (0, 1)]


async def test_a_client_that_leaves_keeps_its_instance_counted_until_the_run_ends(
    executor: ThreadPoolExecutor,
) -> None:
    runner = FakeRunner()
    instances = Instances([runner, FakeRunner()])
    runner.gate.close()
    call = asyncio.ensure_future(instances.run(x(1), ["y"], executor, "m"))
    await eventually(lambda: runner.gate.entered == 1, "the run to start")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert instances.all[0].pending == 1  # still running on its executor thread
    runner.gate.open()
    await eventually(lambda: instances.all[0].pending == 0, "the run to end")


class SlowInlineRunner(FakeRunner):
    """Inline by its warm-up, but its runs take longer than the inline watchdog allows."""

    def __init__(self) -> None:
        super().__init__(inline=True)

    def run(
        self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str], options: Any = None
    ) -> list[np.ndarray]:
        # The run itself, on the CPU of the loop's thread: the event loop is held meanwhile.
        end = time.thread_time() + INLINE_WATCHDOG_S * 1.5
        while time.thread_time() < end:
            pass
        return super().run(feeds, output_names)


class PreemptedInlineRunner(FakeRunner):
    """Inline, cheap, but its thread waits past the watchdog for a core (as on a loaded machine:
    the clock runs, the thread's CPU time does not)."""

    def __init__(self) -> None:
        super().__init__(inline=True)

    def run(
        self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str], options: Any = None
    ) -> list[np.ndarray]:
        time.sleep(INLINE_WATCHDOG_S * 1.5)  # off the CPU, as a preempted thread is
        return super().run(feeds, output_names)


async def test_an_inline_run_that_waited_for_a_core_keeps_the_version_inline(
    executor: ThreadPoolExecutor,
) -> None:
    instances = Instances([PreemptedInlineRunner()])
    await instances.run(x(1), ["y"], executor, "m")
    assert instances.runs_inline


async def test_an_inline_run_past_the_watchdog_moves_the_version_off_the_loop(
    executor: ThreadPoolExecutor,
) -> None:
    runner = SlowInlineRunner()
    instances = Instances([runner])
    assert instances.runs_inline
    await instances.run(x(1), ["y"], executor, "m")
    assert not instances.runs_inline  # for good: the next run goes to the executor, stoppable
    runner.inline = False  # so that the fake holds at its gate, as an executor run
    runner.gate.close()
    run = asyncio.ensure_future(instances.run(x(1), ["y"], executor, "m"))
    await eventually(lambda: len(instances.runs) == 1, "the run on the executor")
    runner.gate.open()
    await run
    assert len(instances.runs) == 0


async def test_a_caller_that_leaves_stops_its_run(executor: ThreadPoolExecutor) -> None:
    runner = FakeRunner()
    instances = Instances([runner])
    runner.gate.close()
    call = asyncio.ensure_future(instances.run(x(1), ["y"], executor, "m"))
    await eventually(lambda: runner.gate.entered == 1, "the run to start")
    (control,) = instances.runs
    assert not control.options.terminate
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert control.options.terminate  # ONNX Runtime stops it at its next check
    runner.gate.open()


async def one_running_one_queued(
    pool: ThreadPoolExecutor, count: int
) -> tuple[list[FakeRunner], Instances, asyncio.Future[Any], asyncio.Future[Any]]:
    """`count` held runners on a one-thread `pool`: a first run started (holding the thread) and a
    second waiting in the executor's queue."""
    runners = [FakeRunner() for _ in range(count)]
    instances = Instances(runners)
    for runner in runners:
        runner.gate.close()
    first = asyncio.ensure_future(instances.run(x(1), ["y"], pool, "m"))
    await eventually(lambda: sum(r.gate.entered for r in runners) == 1, "the first run to start")
    queued = asyncio.ensure_future(instances.run(x(2), ["y"], pool, "m"))
    await eventually(lambda: sum(i.pending for i in instances.all) == 2, "the second run to queue")
    return runners, instances, first, queued


@pytest.mark.parametrize("count", [1, 2])
async def test_a_queued_run_whose_caller_left_never_starts(count: int) -> None:
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        runners, instances, first, queued = await one_running_one_queued(pool, count)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        for runner in runners:
            runner.gate.open()
        await first
        await eventually(lambda: not any(i.pending for i in instances.all), "both counted down")
        assert sum(len(r.runs) for r in runners) == 1 and len(instances.runs) == 0
    finally:
        pool.shutdown(wait=True)


@pytest.mark.parametrize("count", [1, 2])
async def test_a_run_that_shutdown_cancelled_in_the_queue_answers_its_caller(count: int) -> None:
    pool = ThreadPoolExecutor(max_workers=1)
    runners, instances, first, queued = await one_running_one_queued(pool, count)
    pool.shutdown(wait=False, cancel_futures=True)  # as runs.shut_down_executor does
    with pytest.raises(asyncio.CancelledError):
        await queued  # answered, not left waiting for a run that will never come
    for runner in runners:
        runner.gate.open()
    await first
    await eventually(lambda: not any(i.pending for i in instances.all), "both counted down")
    assert len(instances.runs) == 0


async def test_a_device_fault_moves_the_next_runs_to_the_healthy_instance(
    executor: ThreadPoolExecutor,
) -> None:
    broken = FaultyRunner(EPFail("CUDA execution provider failed"))
    healthy = FakeRunner()
    instances = Instances([broken, healthy])
    with pytest.raises(DeviceFault):
        await instances.run(x(1), ["y"], executor, "m")
    for value in (2, 3):
        await instances.run(x(value), ["y"], executor, "m")
    assert len(broken.runs) == 1
    assert len(healthy.runs) == 2


# -- batching ----------------------------------------------------------------------------------


def test_the_batcher_has_a_run_slot_for_every_instance() -> None:
    one = ModelConfig(execution=ExecutionConfig(intra_op_threads=1))
    two = ModelConfig(execution=ExecutionConfig(intra_op_threads=1, instances=2))
    assert default_concurrency(one, CPU, cpus=2) == 1  # unchanged for one instance
    assert default_concurrency(two, CPU, cpus=2) == 2
    assert default_concurrency(two, CPU, cpus=16) == 15  # a pool of one thread each: cores but one
    gpus = ModelConfig(execution=ExecutionConfig(instances=2, device_ids=(0, 1)))
    assert default_concurrency(gpus, CUDA, cpus=2) == 8  # two batches on each of 4 sessions
    # Without CUDA those GPU placements collapse into `instances` CPU sessions: one slot each.
    assert default_concurrency(gpus, CPU, cpus=2) == 2


def rig(runners: list[FakeRunner], executor: ThreadPoolExecutor) -> tuple[Batcher, Instances]:
    instances = Instances(runners)
    settings = BatchSettings(
        max_batch_size=4, target_rows=4, max_queue_delay_s=0.0, concurrency=2, admission=AdmissionPolicy()
    )
    metrics = ServiceMetrics().batching("m", "1", 1)
    batcher = Batcher(
        instances, settings, executor, VersionStats(), metrics, ManualClock(), "model m version 1"
    )
    return batcher, instances


async def test_two_batches_run_at_once_on_two_instances(executor: ThreadPoolExecutor) -> None:
    a, b = FakeRunner(), FakeRunner()
    a.gate.close()
    b.gate.close()
    batcher, instances = rig([a, b], executor)
    calls = [asyncio.ensure_future(batcher.infer(x(v), ("y",), Scheduling())) for v in (1, 2)]
    await eventually(lambda: a.gate.entered == 1 and b.gate.entered == 1, "a run on each instance")
    third = asyncio.ensure_future(batcher.infer(x(3), ("y",), Scheduling()))
    await eventually(lambda: batcher.queued == 1, "the third request to queue: both slots busy")
    a.gate.open()
    b.gate.open()
    answers = await asyncio.gather(*calls, third)
    assert [float(answer["y"][0, 0]) for answer in answers] == [2.0, 4.0, 6.0]
    assert sorted(len(r.runs) for r in (a, b)) == [1, 2]
    assert [i.pending for i in instances.all] == [0, 0]
    await batcher.close()


async def test_a_batch_that_fails_on_its_device_is_not_rerun_alone(executor: ThreadPoolExecutor) -> None:
    broken = FaultyRunner(Fail("CUDA failure 700: an illegal memory access was encountered"))
    broken.gate.close()
    batcher, instances = rig([broken], executor)
    first = asyncio.ensure_future(batcher.infer(x(1), ("y",), Scheduling()))
    await eventually(lambda: broken.gate.entered == 1, "the first run to hold the instance")
    # Held with a second slot free would run the next request at once: fill that slot too.
    second = asyncio.ensure_future(batcher.infer(x(2), ("y",), Scheduling()))
    await eventually(lambda: broken.gate.entered == 2, "the second run to hold the instance")
    batched = [asyncio.ensure_future(batcher.infer(x(v), ("y",), Scheduling())) for v in (3, 4)]
    await eventually(lambda: batcher.queued == 2, "two requests queued behind the held runs")
    broken.gate.open()
    results = await asyncio.gather(first, second, *batched, return_exceptions=True)
    assert all(isinstance(r, DeviceFault) for r in results)
    # Two runs alone and one batch of two: rerunning the batch request by request would add two.
    assert sorted(len(r) for r in broken.runs) == [1, 1, 2]
    assert not instances.healthy(instances.all[0])  # with no other instance it still serves
    await batcher.close()


# -- metrics -----------------------------------------------------------------------------------


def test_per_instance_series_count_runs_and_leave_with_the_version() -> None:
    metrics = ServiceMetrics()
    old, new = Instances([FakeRunner(), FakeRunner()]), Instances([FakeRunner()])
    metrics.instances.add("m", "1", old)
    metrics.instances.add("m", "1", new)  # the same version number reloaded, serving beside it
    first = old.start()
    old.start()  # instance 1, still running
    old.finish(first)
    new.finish(new.start())

    def sample(name: str, instance: str) -> float | None:
        return metric(metrics.registry, name, model="m", version="1", instance=instance, device="cpu")

    assert sample("modelyard_instance_runs_total", "0") == 2  # both loads' instance 0
    assert sample("modelyard_instance_runs_total", "1") == 1
    assert sample("modelyard_instance_in_flight", "1") == 1
    assert sample("modelyard_instance_healthy", "0") == 1
    metrics.instances.remove("m", "1", old)
    assert sample("modelyard_instance_runs_total", "0") == 2  # carried: the counter never goes back
    assert sample("modelyard_instance_runs_total", "1") == 1
    metrics.instances.remove("m", "1", new)
    assert sample("modelyard_instance_runs_total", "0") is None
    assert sample("modelyard_instance_in_flight", "1") is None
