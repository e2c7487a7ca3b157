"""The model instances of one served version: sessions of the same model file placed on devices
(`execution.instances` on each of `execution.device_ids`), and the choice of which one runs a request.

The choice is the seeds' multi-GPU scheduling: the fewest pending runs among healthy instances,
ties to the lowest index. Instances are numbered device by device in turn, so ties spread a light
load over the devices before any device takes two. An instance whose run failed on its device
(DeviceFault) rests for UNHEALTHY_BACKOFF_S and is skipped while another is healthy; no request is
refused for want of a healthy instance (with every instance resting, the least busy of all runs
it). The counts are plain ints, touched on the event loop only; the runs go to the executor.

A run on the executor can be stopped (runtime/runs.py): when its caller leaves (its deadline
passed, or it cancelled) the run's RunOptions.terminate is set, so that its thread, its instance
and its core come back. An inline run (fixed cost, microseconds) is timed instead: one that takes
longer than INLINE_WATCHDOG_S, on the loop thread's own CPU as well as by the clock, moves the
version off the event loop for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np

from modelyard.service.errors import DeadlineExceeded, DeviceFault
from modelyard.service.repository.config import ModelConfig
from modelyard.service.runtime.providers import ProviderChoice
from modelyard.service.runtime.runs import ActiveRuns, RunControl, RunTiming
from modelyard.service.runtime.session import (
    INLINE_WATCHDOG_S,
    ModelRunner,
    Runnable,
    run_checked,
    run_error,
)

log = logging.getLogger(__name__)

# How long an instance whose device failed a run is skipped (while another instance is healthy).
UNHEALTHY_BACKOFF_S = 10.0

Loader = Callable[[Path, ModelConfig, ProviderChoice], ModelRunner]


@dataclass(frozen=True)
class Placement:
    index: int
    device_id: int  # the CUDA device of this instance's session (unused on CPU)


def placements(config: ModelConfig, providers: ProviderChoice) -> tuple[Placement, ...]:
    """Where each instance of a version goes: on CUDA device by device in turn (instance 0 on the
    first device, 1 on the second, ...), `execution.instances` rounds of them; on the CPU,
    `execution.instances` sessions (device_ids name GPUs: there is one CPU)."""
    execution = config.execution
    on_cuda = execution.provider != "cpu" and providers.cuda_usable
    devices = execution.devices if on_cuda else (execution.device_id,)
    return tuple(
        Placement(index, device)
        for index, device in enumerate(d for _ in range(execution.instances) for d in devices)
    )


def load_instances(
    loader: Loader, model_file: Path, config: ModelConfig, providers: ProviderChoice
) -> list[ModelRunner]:
    """Load every instance of a version (blocking: on the loading thread), each built from the
    config with its own device_id (the CUDA provider's device_id option); the first failure fails
    the version, and the instances already loaded are dropped with it."""
    return [
        loader(
            model_file, replace(config, execution=replace(config.execution, device_id=p.device_id)), providers
        )
        for p in placements(config, providers)
    ]


@dataclass(eq=False)
class Instance:
    index: int
    runner: Runnable
    device: str  # "cpu" or "cuda:<id>": for logs and metrics
    pending: int = 0  # runs started and not yet finished
    runs: int = 0  # runs started, ever
    resting_until: float = 0.0  # skipped until then (monotonic clock): its device failed a run
    faults: int = 0  # runs that failed on its device, ever


class Instances:
    """The instances of one served version and the choice among them (on the event loop)."""

    def __init__(
        self,
        runners: Sequence[Runnable],
        devices: Sequence[str] = (),
        clock: Callable[[], float] = time.monotonic,  # test seam: a clock stepped by hand
        backoff_s: float = UNHEALTHY_BACKOFF_S,
        runs: ActiveRuns | None = None,  # the service's stoppable runs (shutdown stops them)
    ) -> None:
        if not runners:
            raise ValueError("a version needs at least one instance")
        self.all: tuple[Instance, ...] = tuple(
            Instance(index, runner, devices[index] if devices else "cpu")
            for index, runner in enumerate(runners)
        )
        self._clock = clock
        self._backoff_s = backoff_s
        self.runs = runs if runs is not None else ActiveRuns()
        # With more than one instance every run goes to the executor: an inline run holds the
        # event loop, so instances would only take turns, never run side by side.
        self.runs_inline = len(self.all) == 1 and self.all[0].runner.runs_inline

    def healthy(self, instance: Instance) -> bool:
        return not instance.resting_until or instance.resting_until <= self._clock()

    def pick(self) -> Instance:
        """The instance the next run goes to: fewest pending among the healthy, lowest index first."""
        if len(self.all) == 1:
            return self.all[0]
        best: Instance | None = None
        for instance in self.all:
            if instance.resting_until:
                if not self.healthy(instance):
                    continue
                instance.resting_until = 0.0  # its rest is over
            if best is None or instance.pending < best.pending:
                best = instance
        if best is None:  # every instance rests: the least busy still serves (min keeps the first)
            best = min(self.all, key=lambda i: i.pending)
        return best

    def start(self) -> Instance:
        """Pick an instance and count a run on it; `finish` must follow."""
        instance = self.pick()
        instance.pending += 1
        instance.runs += 1
        return instance

    def finish(self, instance: Instance, error: BaseException | None = None) -> None:
        """A run on `instance` ended; a DeviceFault sends the instance to rest."""
        instance.pending -= 1
        if isinstance(error, DeviceFault):
            instance.faults += 1
            instance.resting_until = self._clock() + self._backoff_s
            log.warning(
                "instance %d (%s) failed on its device; skipped for %.0f s while another is healthy: %s",
                instance.index,
                instance.device,
                self._backoff_s,
                error,
            )

    def ran_inline(self, elapsed_s: float, label: str, cpu_s: float) -> None:
        """The watchdog of inline runs: one that held the event loop past INLINE_WATCHDOG_S sends
        every later run of this version to the executor. `cpu_s`, the loop thread's own CPU time
        in the run: a run that took the time waiting for a core (the thread preempted on a loaded
        machine: tens of milliseconds at a time) is not one that costs it, and must not send a
        cheap model's every later run through the executor's hand-off."""
        if elapsed_s > INLINE_WATCHDOG_S and cpu_s > INLINE_WATCHDOG_S / 2 and self.runs_inline:
            self.runs_inline = False
            log.warning(
                "%s: an inline run held the event loop for %.1f ms (over %.0f ms); its runs go to "
                "the executor from now on",
                label,
                elapsed_s * 1e3,
                INLINE_WATCHDOG_S * 1e3,
            )

    def run_here(
        self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str], label: str
    ) -> list[np.ndarray]:
        """Run inline, on the calling thread (the event loop), where `runs_inline`: one instance
        and a run of microseconds, so nothing to choose and never pending when anyone looks;
        counted only (this is every request of a cheap model), and timed by the watchdog. A plain
        function, not a coroutine: the request path calls it without an await."""
        only = self.all[0]
        only.runs += 1
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            # run_checked without a RunControl (an inline run is not stoppable), one call fewer.
            return only.runner.run(feeds, output_names)
        except Exception as exc:
            raise run_error(exc, label) from None
        finally:
            elapsed = time.perf_counter() - start
            if elapsed > INLINE_WATCHDOG_S:  # the watchdog's call only for a run that may concern it
                self.ran_inline(elapsed, label, time.thread_time() - cpu)

    async def run(
        self,
        feeds: Mapping[str, np.ndarray],
        output_names: Sequence[str],
        executor: Executor,
        label: str,
        timing: RunTiming | None = None,
    ) -> list[np.ndarray]:
        """Run once on the chosen instance: inline on the event loop when the model is cheap enough
        (one instance only), else on the executor, stopped if the caller leaves. `timing`, when
        given, gets the run's queue and run time (RunTiming)."""
        if self.runs_inline:
            started = time.perf_counter_ns()
            arrays = self.run_here(feeds, output_names, label)
            if timing is not None:
                timing.queue_ns = started - timing.admitted_ns
                timing.run_ns = time.perf_counter_ns() - started
            return arrays
        instance = self.start()
        control = self.runs.start()
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[list[np.ndarray]] = loop.create_future()
        if len(self.all) == 1:
            # Nothing to choose between: counted around the call, with no more work per request
            # than a plain run (a caller that leaves counts its run down early, and stops it).
            error: BaseException | None = None
            future: Future[list[np.ndarray]] | None = None
            try:
                future = executor.submit(run_checked, instance.runner, feeds, output_names, label, control)
                future.add_done_callback(partial(_hand_back, loop, partial(_settle, waiter)))
                arrays = await waiter
                if timing is not None:
                    timing.queue_ns = control.started_ns - timing.admitted_ns
                    timing.run_ns = control.run_ns
                return arrays
            except asyncio.CancelledError as exc:
                error = exc
                if future is not None:
                    future.cancel()  # still queued: it never starts
                control.terminate(_caller_left(label))
                raise
            except BaseException as exc:
                error = exc
                raise
            finally:
                self.runs.end(control)
                self.finish(instance, error)
        try:
            future = executor.submit(run_checked, instance.runner, feeds, output_names, label, control)
        except BaseException:
            self.runs.end(control)
            self.finish(instance)
            raise
        # Counted until the run itself ends, not its caller's wait: a client that leaves does not
        # stop a run already on its executor thread, and the instance is busy until then. (The
        # count is down before the caller resumes, in the one hop back to the loop.)
        future.add_done_callback(
            partial(_hand_back, loop, partial(self._finished, instance, control, waiter))
        )
        try:
            arrays = await waiter
        except asyncio.CancelledError:
            future.cancel()  # still queued: it never starts
            control.terminate(_caller_left(label))
            raise
        if timing is not None:
            timing.queue_ns = control.started_ns - timing.admitted_ns
            timing.run_ns = control.run_ns
        return arrays

    def _finished(
        self,
        instance: Instance,
        control: RunControl,
        waiter: asyncio.Future[list[np.ndarray]],
        future: Future[list[np.ndarray]],
    ) -> None:
        self.runs.end(control)
        self.finish(instance, None if future.cancelled() else future.exception())
        _settle(waiter, future)

    def snapshot(self) -> list[tuple[str, str, int, int, bool, int]]:
        """(index, device, pending, runs, healthy, device faults) of each instance, for metrics."""
        return [(str(i.index), i.device, i.pending, i.runs, self.healthy(i), i.faults) for i in self.all]


def _hand_back(
    loop: asyncio.AbstractEventLoop,
    settle: Callable[[Future[list[np.ndarray]]], None],
    future: Future[list[np.ndarray]],
) -> None:
    """A run's future is done (on its executor thread, or where shutdown cancelled it): `settle`
    on the loop, in one hop. (run_in_executor's wrap_future takes the hop and then a callback of
    its own on the loop, and its copy of the state: ~15 us of CPU a run on one core.)"""
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
        loop.call_soon_threadsafe(settle, future)


def _settle(waiter: asyncio.Future[list[np.ndarray]], future: Future[list[np.ndarray]]) -> None:
    """The caller's waiter takes the run's outcome (a waiter whose caller left is done already)."""
    if waiter.done():
        return
    if future.cancelled():  # shutdown cancelled it before it started
        waiter.cancel()
        return
    exc = future.exception()
    if exc is None:
        waiter.set_result(future.result())
    else:
        waiter.set_exception(exc)


def _caller_left(label: str) -> DeadlineExceeded:
    # Nobody reads it: the caller's answer (CANCELLED, DEADLINE_EXCEEDED) is gRPC's.
    return DeadlineExceeded(f"the caller of a run of {label} left; the run was stopped")
