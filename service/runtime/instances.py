"""The model instances of one served version: sessions of the same model file placed on devices
(`execution.instances` on each of `execution.device_ids`), and the choice of which one runs a request.

The choice is least-loaded dispatch across the instances (and so across GPUs): the fewest pending
runs among healthy instances, ties to the lowest index. Instances are numbered device by device in
turn, so ties spread a light load over the devices before any device takes two. An instance whose
run failed on its device (DeviceFault) rests for UNHEALTHY_BACKOFF_S and is skipped while another
is healthy; no request is refused for want of a healthy instance (with every instance resting, the
least busy of all runs it). The counts are plain ints, touched on the event loop only; the runs go
to the executor.

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
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Protocol

import numpy as np

from modelyard.service.errors import DeadlineExceeded, DeviceFault, Overloaded
from modelyard.service.repository.model_config import ModelConfig
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


class WaitLimit(Protocol):
    """How long a run may wait for its version's run slot (a request's Scheduling), asked only
    when it has to wait."""

    def wait_s(self) -> float | None: ...


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
        max_runs: int = 0,  # runs on the executor at once (max_concurrent_runs); 0: its share
        max_queued: int = 0,  # runs that may wait for one of those (max_queued_runs); 0: no bound
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
        # The version's bound on the service's run threads (capacity.py): `limit` runs at once,
        # `busy` of them going (Instances.run's; a batcher keeps its own within the limit), the
        # rest waiting in order (each a future its slot is handed to).
        capacity = self.capacity = self.runs.capacity
        self._max_runs = max_runs
        # Never fewer than its instances: each one is a session the config asked to run side by
        # side (as a batcher's run slots, even where they oversubscribe the threads).
        self.limit = max_runs or max(len(self.all), capacity.share)
        self.max_queued = max_queued
        self.busy = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._limit_listeners: list[Callable[[int], None]] = []
        if not self.runs_inline:
            capacity.register(self)

    # -- the version's bound on the run threads ---------------------------------------------------

    def share_changed(self, share: int) -> None:
        """The service's share per version changed (a version loaded or retired): a version with
        no bound of its own takes the new one, and its waiting runs start if it grew."""
        limit = max(len(self.all), share)
        if self._max_runs or limit == self.limit:
            return
        self.limit = limit
        for listener in self._limit_listeners:
            listener(limit)
        self._pump()

    def on_limit(self, listener: Callable[[int], None]) -> None:
        """Call `listener` with the version's new bound whenever it changes (a batcher's runs)."""
        self._limit_listeners.append(listener)

    def retire(self) -> None:
        """The version is let go of: its share goes back to the others."""
        self.capacity.unregister(self)

    @property
    def waiting(self) -> int:
        """Runs waiting for the version's bound."""
        return len(self._waiters)

    @property
    def has_idle_slot(self) -> bool:
        """A run could start now without waiting, and none waits."""
        return self.busy < self.limit and not self._waiters

    async def _wait_for_slot(self, label: str, limit: WaitLimit | None) -> None:
        """Wait for one of the version's run slots (handed over by _pump, `busy` counted for
        this run); Overloaded when too many wait, DeadlineExceeded when `limit` passes first."""
        wait_s = limit.wait_s() if limit is not None else None
        if self.max_queued and len(self._waiters) >= self.max_queued:
            raise Overloaded(
                f"{label} has {self.busy} runs going (its bound: execution.max_concurrent_runs, or "
                f"its share of the service's run threads) and {len(self._waiters)} waiting "
                "(execution.max_queued_runs); retry later"
            )
        if wait_s is not None and wait_s <= 0:
            raise DeadlineExceeded(f"the request's deadline passed before a run slot of {label} was free")
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[None] = loop.create_future()
        self._waiters.append(turn)
        self.capacity.waiting += 1
        timer = loop.call_later(wait_s, self._expired, turn, label) if wait_s is not None else None
        try:
            await turn
        except BaseException:
            if turn.done() and not turn.cancelled() and turn.exception() is None:
                self._give_slot()  # it was handed a slot, and left before taking it
            else:
                self._leave(turn)
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _expired(self, turn: asyncio.Future[None], label: str) -> None:
        if not turn.done():
            self._leave(turn)
            turn.set_exception(
                DeadlineExceeded(
                    f"the request's deadline passed while it waited for a run slot of {label}; not run"
                )
            )

    def _leave(self, turn: asyncio.Future[None]) -> None:
        if turn in self._waiters:
            self._waiters.remove(turn)
            self.capacity.waiting -= 1

    def _give_slot(self) -> None:
        self.busy -= 1
        if self._waiters:
            self._pump()

    def _pump(self) -> None:
        """Hand free slots to the runs waiting, oldest first."""
        waiters = self._waiters
        while waiters and self.busy < self.limit:
            turn = waiters.popleft()
            self.capacity.waiting -= 1
            if not turn.done():  # else it left (its caller cancelled) and is gone
                self.busy += 1
                turn.set_result(None)

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
            self.capacity.register(self)  # it takes run threads from now on
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
        wait: WaitLimit | None = None,
    ) -> list[np.ndarray]:
        """Run once on the chosen instance: inline on the event loop when the model is cheap enough
        (one instance only), else on the executor once one of the version's run slots is free
        (waiting at most what `wait` allows, in order), stopped if the caller leaves. `timing`, when given,
        gets the run's queue and run time (RunTiming)."""
        if self.runs_inline:
            started = time.perf_counter_ns()
            arrays = self.run_here(feeds, output_names, label)
            if timing is not None:
                timing.queue_ns = started - timing.admitted_ns
                timing.run_ns = time.perf_counter_ns() - started
            return arrays
        if self.busy < self.limit and not self._waiters:
            self.busy += 1  # the version's slot, given back when the run itself ends (_ran)
        else:
            await self._wait_for_slot(label, wait)
        instance = self.start()
        control = self.runs.start()
        if timing is not None:
            control.timed = True
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[list[np.ndarray]] = loop.create_future()
        if len(self.all) == 1:
            # Nothing to choose between: counted around the call, with no more work per request
            # than a plain run (a caller that leaves counts its run down early, and stops it).
            error: BaseException | None = None
            future: Future[list[np.ndarray]] | None = None
            try:
                future = executor.submit(run_checked, instance.runner, feeds, output_names, label, control)
                future.add_done_callback(partial(_hand_back, loop, partial(self._ran, waiter)))
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
                if future is None:  # not submitted (the executor is shut down): no run to end
                    self._give_slot()
                raise
            finally:
                self.runs.end(control)
                self.finish(instance, error)
        return await self._run_many(executor, instance, control, waiter, feeds, output_names, label, timing)

    async def run_shadow(
        self,
        feeds: Mapping[str, np.ndarray],
        output_names: Sequence[str],
        label: str,
        timing: RunTiming | None = None,
    ) -> list[np.ndarray]:
        """Run a shadow call (capacity.py): on the shadows' idle-priority thread, outside the
        version's run slots; the caller has checked that capacity is spare. Inline models run
        inline (microseconds)."""
        if self.runs_inline:
            started = time.perf_counter_ns()
            arrays = self.run_here(feeds, output_names, label)
            if timing is not None:
                timing.queue_ns = started - timing.admitted_ns
                timing.run_ns = time.perf_counter_ns() - started
            return arrays
        capacity = self.capacity
        executor = capacity.shadow_executor
        capacity.shadows += 1
        instance = self.start()
        control = self.runs.start()
        control.timed = timing is not None
        waiter: asyncio.Future[list[np.ndarray]] = asyncio.get_running_loop().create_future()
        return await self._run_many(
            executor, instance, control, waiter, feeds, output_names, label, timing, self._shadow_ended
        )

    def _shadow_ended(self) -> None:
        self.capacity.shadows -= 1

    async def _run_many(
        self,
        executor: Executor,
        instance: Instance,
        control: RunControl,
        waiter: asyncio.Future[list[np.ndarray]],
        feeds: Mapping[str, np.ndarray],
        output_names: Sequence[str],
        label: str,
        timing: RunTiming | None,
        ended: Callable[[], None] | None = None,  # when the run ended: a slot, or a shadow's thread
    ) -> list[np.ndarray]:
        ended = ended or self._give_slot
        try:
            future = executor.submit(run_checked, instance.runner, feeds, output_names, label, control)
        except BaseException:
            self.runs.end(control)
            self.finish(instance)
            ended()
            raise
        # Counted until the run itself ends, not its caller's wait: a client that leaves does not
        # stop a run already on its executor thread, and the instance is busy until then. (The
        # count is down before the caller resumes, in the one hop back to the loop.)
        loop = asyncio.get_running_loop()
        future.add_done_callback(
            partial(_hand_back, loop, partial(self._finished, instance, control, waiter, ended))
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

    def _ran(self, waiter: asyncio.Future[list[np.ndarray]], future: Future[list[np.ndarray]]) -> None:
        """A run of the one instance ended (on the loop): its slot goes to the next run, then its
        caller takes the outcome. (_give_slot's body, inline: it runs on every such run.)"""
        self.busy -= 1
        if self._waiters:
            self._pump()
        _settle(waiter, future)

    def _finished(
        self,
        instance: Instance,
        control: RunControl,
        waiter: asyncio.Future[list[np.ndarray]],
        ended: Callable[[], None],
        future: Future[list[np.ndarray]],
    ) -> None:
        self.runs.end(control)
        self.finish(instance, None if future.cancelled() else future.exception())
        ended()
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
    its own on the loop, and copies the state: two hops' work on the loop for every run.)"""
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
