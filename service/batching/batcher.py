"""The dynamic batcher of one model version: requests queue, batch, run together, and part again.

Requests wait in an AdmissionQueue (priorities, bounded queues, deadlines). A loop on the event
loop forms a batch whenever a run slot is free: the head of the queue (highest priority, oldest)
and the requests behind it whose inputs match it apart from the batch dimension, in queue order,
up to max_batch_size rows. The batch leaves at once when it reaches the largest preferred batch
size (or max_batch_size), or, as Triton's dynamic batcher, when what is queued makes a smaller
preferred size (the largest one reachable leaves); otherwise when its oldest request has waited
max_queue_delay_us. While
every slot is busy, requests pile up, so batches grow with the load by themselves.

With several model instances (execution.instances), each batch runs on the instance the version's
Instances picks (fewest pending runs among healthy ones), and by default there are at least as many
run slots as instances, so that every instance can run a batch at once.

A request that finds nothing queued and a slot free runs at once (waiting could gain nothing).
A batch is concatenated, run once, and its outputs are split back per request, all on an executor
thread (the event loop only plans). Models cheap enough to run inline run on the loop; their runs
end before the next request is read, so they batch only when a max_queue_delay holds requests
back. A batch that fails is rerun one request at a time, so that one request's bad values cannot
fail the requests that happened to share its run.

A batch on the executor can be stopped (runtime/runs.py): its RunOptions.terminate is set once
every request of the batch is gone (each one's deadline passed or its client cancelled), never
while one still waits for it; a request that leaves a batch others still wait for only stops
waiting. A stopped batch is not rerun request by request. At shutdown every run is stopped.

The batcher does not lease versions: callers hold their version's lease while queued, so a
retiring version drains its queue before `close`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass

import numpy as np

from modelyard.service.batching.tensors import batch_rows, concat, rows_and_key, split
from modelyard.service.errors import (
    DeadlineExceeded,
    DeviceFault,
    ModelRunError,
    ModelUnavailable,
    ServiceError,
)
from modelyard.service.metrics import BatchingMetrics
from modelyard.service.repository.model_config import ModelConfig
from modelyard.service.runtime.instances import Instance, Instances
from modelyard.service.runtime.providers import CUDA
from modelyard.service.runtime.runs import RunControl, RunTiming
from modelyard.service.runtime.served import VersionStats
from modelyard.service.runtime.session import Runnable as Runner
from modelyard.service.runtime.session import run_checked, run_error
from modelyard.service.scheduling.clock import Clock, MonotonicClock
from modelyard.service.scheduling.queue import (
    DEFAULT_SCHEDULING,
    AdmissionPolicy,
    AdmissionQueue,
    Scheduling,
    Ticket,
)

log = logging.getLogger(__name__)

Outputs = dict[str, np.ndarray]


@dataclass(frozen=True)
class BatchSettings:
    max_batch_size: int
    target_rows: int  # a batch leaves as soon as it holds this many rows
    max_queue_delay_s: float
    concurrency: int  # batches running at once
    admission: AdmissionPolicy
    preferred: frozenset[int] = frozenset()  # preferred_batch_sizes

    @classmethod
    def from_config(cls, config: ModelConfig, provider: str, cpus: int) -> BatchSettings:
        """Settings for a version of `config` whose instances run on `provider`."""
        batching = config.dynamic_batching
        if batching is None or not config.max_batch_size:
            raise ValueError("the model config asks for no dynamic batching")
        return cls(
            max_batch_size=config.max_batch_size,
            target_rows=max(batching.preferred_batch_sizes, default=config.max_batch_size),
            max_queue_delay_s=batching.max_queue_delay_us / 1e6,
            concurrency=batching.max_concurrent_batches or default_concurrency(config, provider, cpus),
            admission=batching.admission,
            preferred=frozenset(batching.preferred_batch_sizes),
        )


def default_concurrency(config: ModelConfig, provider: str, cpus: int) -> int:
    """Batches that keep the devices busy without oversubscribing them."""
    if provider == CUDA:
        # On each session, one batch's host side (copies, Python) overlaps the other's kernels.
        return 2 * config.execution.sessions
    sessions = config.execution.instances  # on the CPU device_ids place nothing (instances.placements)
    threads = config.execution.intra_op_threads
    # ONNX Runtime's default intra-op pool already uses every core for one run. With a smaller
    # pool, runs share the cores but one: the event loop (gRPC, batching) needs one to itself.
    # Every instance can run a batch at once, even where that oversubscribes the cores: more
    # instances than that is what the config asked for.
    return max(sessions, max(1, (cpus - 1) // threads) if threads else 1)


@dataclass(eq=False, slots=True)
class _Pending:
    """One request in the batcher: its inputs, and the future its caller awaits."""

    feeds: Mapping[str, np.ndarray]
    names: tuple[str, ...]
    key: Hashable  # None when it never queues
    rows: int
    future: asyncio.Future[Outputs]
    arrived_ns: int
    # Once it runs on the executor: the run's control, and every request of its batch.
    control: RunControl | None = None
    batch: list[_Pending] | None = None
    # Once it ran: when the run that served it started and how long it took (perf_counter ns).
    started_ns: int = 0
    run_ns: int = 0


Outcome = Outputs | ServiceError


class Batcher:
    def __init__(
        self,
        instances: Instances,
        settings: BatchSettings,
        executor: Executor,
        stats: VersionStats,
        metrics: BatchingMetrics,
        clock: Clock | None = None,  # test seam: a clock stepped by hand
        name: str = "the model",  # for messages: "model m version 3"
    ) -> None:
        self.settings = settings
        self.name = name
        self._instances: Instances | None = instances
        self._executor = executor
        self._stats = stats
        self._metrics = metrics
        self._clock = clock or MonotonicClock()
        self._queue: AdmissionQueue[_Pending] = AdmissionQueue(settings.admission, self._clock, metrics, name)
        self._busy = 0  # batches running
        # Its run slots: the settings', within the version's bound on the service's run threads
        # (runtime/capacity.py: its share of them while other versions run there too).
        self._concurrency = min(settings.concurrency, instances.limit)
        instances.on_limit(self._limit_changed)
        # A request that finds nothing queued and a slot free runs at once, unless the settings
        # hold requests back for company (max_queue_delay). Inline models always find it so: their
        # runs end before the event loop takes the next request.
        self._runs_at_once = not settings.max_queue_delay_s
        self._wake = asyncio.Event()
        self._wake_at: float | None = None  # when the loop looks again unless woken (None: never)
        self._loop_task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def queued(self) -> int:
        return len(self._queue)

    def queued_at(self, level: int) -> int:
        return self._queue.depth(level)

    @property
    def has_idle_slot(self) -> bool:
        """A request could run now without waiting, and none waits."""
        return self._busy < self._concurrency and not self._queue

    def _limit_changed(self, limit: int) -> None:
        """The version's bound on the run threads changed (another version loaded or retired)."""
        self._concurrency = min(self.settings.concurrency, limit)
        if self._queue:
            self._kick()  # a slot more may start what waits

    # -- requests -----------------------------------------------------------------------------

    async def infer(
        self,
        feeds: Mapping[str, np.ndarray],
        names: Sequence[str],
        scheduling: Scheduling = DEFAULT_SCHEDULING,
        timing: RunTiming | None = None,
    ) -> Outputs:
        """Run one request's (checked) inputs as part of a batch; raise InvalidInput (priority),
        Overloaded (queue full), DeadlineExceeded (deadline passed while queued), ModelUnavailable
        (the version stopped), or what the run raised. `timing`, when given, gets the request's
        wait and its run's time (RunTiming: the batch's run, for each request in it)."""
        instances = self._instances
        if self._closed or instances is None:
            raise ModelUnavailable(f"{self.name} is no longer served")
        rows, key = rows_and_key(feeds)
        arrived = time.perf_counter_ns()
        # Checked in this order, cheapest first: under load a slot is seldom free.
        if self._runs_at_once and self._busy < self._concurrency and not self._queue:
            # A free slot and nothing queued: nothing can join, and waiting gains nothing.
            level, _ = self._queue.check(scheduling)
            self._metrics.dequeued(level, 0.0)
            self._stats.record_queue(0)
            if instances.runs_inline:
                return self._run_inline(instances, feeds, tuple(names), rows, arrived, timing)
            pending = _Pending(
                feeds, tuple(names), None, rows, asyncio.get_running_loop().create_future(), arrived
            )
            self._start([pending], rows)
            try:
                outputs = await pending.future
            except asyncio.CancelledError:
                self._left(pending)
                raise
            if timing is not None:
                timing.queue_ns, timing.run_ns = pending.started_ns - timing.admitted_ns, pending.run_ns
            return outputs
        pending = _Pending(
            feeds, tuple(names), key, rows, asyncio.get_running_loop().create_future(), arrived
        )
        ticket = self._queue.admit(pending, scheduling)
        # While every slot is busy an arrival changes nothing the loop is waiting for, unless its
        # deadline comes first: skipping the wake-up saves the loop a turn per request under load.
        if self._busy < self._concurrency or (
            ticket.deadline is not None and _earlier(ticket.deadline, self._wake_at)
        ):
            self._kick()
        try:
            outputs = await pending.future
        except asyncio.CancelledError:
            # The client left (or its gRPC deadline passed): while queued it never runs.
            self._queue.remove(ticket)
            self._left(pending)
            raise
        if timing is not None:
            timing.queue_ns, timing.run_ns = pending.started_ns - timing.admitted_ns, pending.run_ns
        return outputs

    def _left(self, pending: _Pending) -> None:
        """A request's caller left; if its batch is running and nobody else waits for it, stop it."""
        control, batch = pending.control, pending.batch
        if control is not None and batch is not None and all(item.future.done() for item in batch):
            control.terminate(
                DeadlineExceeded(f"every request of a batch of {self.name} left; the run was stopped")
            )

    def _run_inline(
        self,
        instances: Instances,
        feeds: Mapping[str, np.ndarray],
        names: tuple[str, ...],
        rows: int,
        arrived: int,
        timing: RunTiming | None = None,
    ) -> Outputs:
        """A request alone, on the event loop: the cheapest path, for models whose runs take
        microseconds (no future, no concatenation, no split; one instance)."""
        self._metrics.batch_size.observe(rows)
        runs: list[tuple[int, int]] = []
        instance = instances.start()
        if timing is not None:
            timing.queue_ns = time.perf_counter_ns() - timing.admitted_ns
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            outputs = _execute(instance.runner, feeds, names, self.name, runs)
        except ServiceError as exc:
            instances.finish(instance, exc)
            instances.ran_inline(time.perf_counter() - start, self.name, time.thread_time() - cpu)
            self._stats.record_request(False, time.perf_counter_ns() - arrived)
            raise
        instances.finish(instance)
        instances.ran_inline(runs[0][1] / 1e9, self.name, time.thread_time() - cpu)
        if timing is not None:
            timing.run_ns = runs[0][1]
        self._stats.record_execution(*runs[0])
        self._stats.record_compute(1, runs[0][1])
        self._stats.record_request(True, time.perf_counter_ns() - arrived)
        return outputs

    async def close(self) -> None:
        """Stop (the version retired and drained): anything still queued is answered UNAVAILABLE;
        the instances are let go of, so that their sessions can be freed."""
        self._closed = True
        for ticket in self._queue.close():
            self._fail(ticket.item, ModelUnavailable(f"{self.name} stopped serving before the request ran"))
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._instances = None
        self._metrics.close()

    # -- the loop -----------------------------------------------------------------------------

    def _kick(self) -> None:
        if self._closed:
            return
        self._wake.set()
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(
                self._loop(), name=f"batcher {self.name}"
            )

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            self._wake_at = self._safe_turn()
            await self._clock.wait(self._wake, self._wake_at)

    def _safe_turn(self) -> float | None:
        try:
            return self._turn()
        except Exception:  # a bug: answer what waits rather than leave it hanging for ever
            log.exception("batcher of %s failed", self.name)
            for ticket in self._queue.close():
                self._fail(ticket.item, ModelRunError(f"the batcher of {self.name} failed"))
            return None

    def _turn(self) -> float | None:
        """Drop expired requests and start what may start; return when to look again (None: when
        something happens)."""
        for ticket in self._queue.expire():
            self._fail(
                ticket.item,
                DeadlineExceeded(f"the request's deadline passed while it waited for {self.name}; not run"),
            )
        wake_at = self._queue.next_deadline()
        while self._queue and self._busy < self._concurrency:
            batch, rows, ready_at = self._plan()
            if ready_at > self._clock.now():
                wake_at = ready_at if wake_at is None else min(wake_at, ready_at)
                break
            self._queue.take(batch)
            now = self._clock.now()
            waited = 0.0
            items: list[_Pending] = []
            for ticket in batch:  # one pass: the summed wait (seconds, made ns once) and the items
                waited += now - ticket.enqueued_at
                items.append(ticket.item)
            self._stats.record_queue(int(waited * 1e9), len(batch))  # once per batch, not per request
            self._start(items, rows)
            wake_at = self._queue.next_deadline()
        return wake_at

    def _plan(self) -> tuple[list[Ticket[_Pending]], int, float]:
        """The next batch, its rows, and when it may leave: now if it is full, else when its oldest
        request has waited max_queue_delay."""
        settings = self.settings
        batch: list[Ticket[_Pending]] = []
        rows = 0
        oldest = float("inf")
        full = False
        key: Hashable = None
        preferred_at = preferred_rows = 0  # batch length and rows at the largest preferred size on the way
        for ticket in self._queue:
            item = ticket.item
            if batch and item.key != key:
                continue  # cannot share this run; it leads a later batch
            if batch and rows + item.rows > settings.max_batch_size:
                full = True
                break
            if not batch:
                key = item.key
            batch.append(ticket)
            rows += item.rows
            if ticket.enqueued_at < oldest:  # not min(): no call per request
                oldest = ticket.enqueued_at
            if rows >= settings.target_rows:
                full = True
                break
            if rows in settings.preferred:
                preferred_at, preferred_rows = len(batch), rows
        if not full and preferred_at:
            # As Triton's dynamic batcher: what is queued makes a preferred size, so that batch
            # leaves now rather than waiting out max_queue_delay for a larger one.
            del batch[preferred_at:]
            rows, full = preferred_rows, True
        return batch, rows, (self._clock.now() if full else oldest + settings.max_queue_delay_s)

    # -- running ------------------------------------------------------------------------------

    def _start(self, items: list[_Pending], rows: int) -> None:
        self._busy += 1
        self._metrics.batch_size.observe(rows)
        instances = self._instances
        assert instances is not None
        instance = instances.start()
        if instances.runs_inline:
            done: _Computed | None = None
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                done = _compute(instance.runner, items, self.name)
                self._deliver(items, done)
            finally:
                self._busy -= 1
                instances.finish(instance, done.fault if done is not None else None)
                instances.ran_inline(time.perf_counter() - start, self.name, time.thread_time() - cpu)
            return
        loop = asyncio.get_running_loop()
        control = instances.runs.start()
        for item in items:
            item.control, item.batch = control, items
        try:
            future = self._executor.submit(_compute, instance.runner, items, self.name, control)
        except RuntimeError as exc:  # the executor is shut down
            self._busy -= 1
            instances.runs.end(control)
            instances.finish(instance)
            self._deliver(items, _Computed([run_error(exc, self.name)] * len(items), []))
            return
        # One hop back to the event loop when the run ends. (run_in_executor and a task take four,
        # each behind every callback already waiting on a busy loop, while the model sits idle.)
        future.add_done_callback(
            lambda done: loop.call_soon_threadsafe(self._finished, items, instances, instance, control, done)
        )

    def _finished(
        self,
        items: list[_Pending],
        instances: Instances,
        instance: Instance,
        control: RunControl,
        future: Future[_Computed],
    ) -> None:
        self._busy -= 1
        instances.runs.end(control)
        try:
            done = future.result()
        except Exception as exc:  # a bug in _compute
            done = _Computed([run_error(exc, self.name)] * len(items), [])
        instances.finish(instance, done.fault)
        self._deliver(items, done)
        if self._queue:  # with nothing queued there is nothing to plan: no turn of the loop task
            # The answers first; the next batch is planned by the loop task's next turn, behind
            # the handlers those answers woke, so that what arrived meanwhile joins it: fuller
            # batches without a wait window, and so less CPU a request under load.
            self._kick()

    def _deliver(self, items: list[_Pending], done: _Computed) -> None:
        # Statistics are kept here, on the event loop, not on executor threads; the successes'
        # once per batch (their count and summed time), not per request.
        stats = self._stats
        now = time.perf_counter_ns()
        served = arrived_ns = 0
        for item, outcome in zip(items, done.outcomes, strict=True):
            future = item.future
            if isinstance(outcome, ServiceError):
                stats.record_request(False, now - item.arrived_ns)
                if not future.done():  # else its caller left while it ran
                    future.set_exception(outcome)
            else:
                served += 1
                arrived_ns += item.arrived_ns
                # No done() call first: a future is done here only if its caller left. (Not
                # contextlib.suppress: a context manager a request costs more than the call.)
                try:  # noqa: SIM105
                    future.set_result(outcome)
                except asyncio.InvalidStateError:
                    pass
        if served:
            stats.record_request(True, served * now - arrived_ns, served)
        for rows, compute_ns in done.runs:
            stats.record_execution(rows, compute_ns)
        if len(done.runs) == 1:  # one run served every successful request of the batch
            stats.record_compute(served, done.runs[0][1])
        else:  # the batch failed and was rerun request by request: one run per success
            for _, compute_ns in done.runs:
                stats.record_compute(1, compute_ns)

    def _fail(self, item: _Pending, error: ServiceError) -> None:
        self._stats.record_request(False, time.perf_counter_ns() - item.arrived_ns)
        if not item.future.done():
            item.future.set_exception(error)


def _earlier(deadline: float | None, wake_at: float | None) -> bool:
    return deadline is not None and (wake_at is None or deadline < wake_at)


@dataclass
class _Computed:
    outcomes: list[Outcome]  # one per request of the batch
    runs: list[tuple[int, int]]  # (rows, compute ns) of each successful model run

    @property
    def fault(self) -> DeviceFault | None:
        """The device's failure, if the run failed on its device (its instance then rests)."""
        return next((o for o in self.outcomes if isinstance(o, DeviceFault)), None)


def _compute(
    runner: Runner, items: list[_Pending], name: str, control: RunControl | None = None
) -> _Computed:
    """On an executor thread: concatenate, run once, split. If the batch fails, run each request
    alone, so that each gets its own answer."""
    runs: list[tuple[int, int]] = []
    names = items[0].names  # most batches: every request asks for the same outputs (one tuple)
    for item in items:
        if item.names is not names:
            names = tuple(dict.fromkeys(output for each in items for output in each.names))
            break
    try:
        feeds = concat([item.feeds for item in items])
        started = time.perf_counter_ns()
        outputs = _execute(runner, feeds, names, name, runs, control)
        outcomes: list[Outcome] = list(
            split(outputs, [item.rows for item in items], [item.names for item in items])
        )
        run_ns = runs[-1][1]
        for item in items:  # here, on the executor thread: the event loop reads them after the hop
            item.started_ns, item.run_ns = started, run_ns
    except ServiceError as exc:
        # A device's failure is no request's: running each alone would fail each on it again.
        # A stopped run is not rerun either.
        stopped = control is not None and control.why is not None
        if len(items) == 1 or isinstance(exc, DeviceFault) or stopped:
            return _Computed([exc] * len(items), runs)
        return _Computed([_alone(runner, item, name, runs, control) for item in items], runs)
    return _Computed(outcomes, runs)


def _alone(
    runner: Runner, item: _Pending, name: str, runs: list[tuple[int, int]], control: RunControl | None
) -> Outcome:
    try:
        item.started_ns = time.perf_counter_ns()
        outputs = _execute(runner, item.feeds, item.names, name, runs, control)
        item.run_ns = runs[-1][1]
        return outputs
    except ServiceError as exc:
        return exc


def _execute(
    runner: Runner,
    feeds: Mapping[str, np.ndarray],
    names: tuple[str, ...],
    label: str,
    runs: list[tuple[int, int]],
    control: RunControl | None = None,
) -> Outputs:
    start = time.perf_counter_ns()
    arrays = run_checked(runner, feeds, names, label, control)
    runs.append((batch_rows(feeds), time.perf_counter_ns() - start))
    return dict(zip(names, arrays, strict=True))
