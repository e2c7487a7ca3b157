"""Runs that can be stopped: each run on an executor thread gets its own ONNX Runtime RunOptions,
whose `terminate` flag ONNX Runtime checks between nodes (and between a Loop's iterations), so
that a run whose callers all left, or that outlives the shutdown's grace, gives its executor
thread, its slot and its core back within a node's time.

Inline runs (fixed-cost graphs, microseconds: session.py `runs_inline`) take no RunOptions: they
end before anything could stop them, and creating one costs about a microsecond.

ActiveRuns is touched on the event loop only (start, end, terminate_all); the executor threads
only hand the options to ONNX Runtime, which reads the flag.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import onnxruntime as ort

from modelyard.service.errors import DeadlineExceeded, ModelUnavailable, ServiceError
from modelyard.service.runtime.capacity import RunCapacity

log = logging.getLogger(__name__)

# How long shutdown waits for the executor's threads once their runs were stopped: a run inside
# one long kernel sees the flag only when that kernel ends.
EXECUTOR_STOP_S = 2.0
SHUTDOWN_MESSAGE = "the service is shutting down; the run was stopped before it finished"


class RunTiming(Protocol):
    """Where a request's run says when it started and how long it took (the data plane's Call):
    `admitted_ns` is set before the run is asked for; the run sets `queue_ns` (admission to the
    start of its run: a wait for the version's run slots, a batcher's queue, an executor thread)
    and `run_ns` (its run on its thread, or its batch's run), both time.perf_counter_ns spans."""

    admitted_ns: int
    queue_ns: int
    run_ns: int


class RunControl:
    """One run's RunOptions, why it was stopped (None while it may run), and when it ran: set on
    its executor thread (run_checked), read on the loop once the run's future is done."""

    __slots__ = ("options", "run_ns", "started_ns", "timed", "timer", "why")

    def __init__(self) -> None:
        self.options = ort.RunOptions()
        self.why: ServiceError | None = None
        self.timer: asyncio.TimerHandle | None = None  # the run-time bound (ActiveRuns.max_run_s)
        self.timed = False  # whether its thread stamps the two below (a dyed call's run)
        self.started_ns = 0  # time.perf_counter_ns when its thread started the run
        self.run_ns = 0  # how long the run took there

    def terminate(self, why: ServiceError) -> None:
        """Stop the run at ONNX Runtime's next check; it then fails with `why` (the first reason
        given wins)."""
        if self.why is None:
            self.why = why
        self.options.terminate = True


class ActiveRuns:
    """The stoppable runs of one service (its executor runs), so that shutdown can stop them all."""

    def __init__(self, max_run_s: float = 0.0, capacity: RunCapacity | None = None) -> None:
        self._runs: set[RunControl] = set()
        self.closing = False
        # The longest a run may take, whether or not its caller set a deadline (a caller without
        # one must not hold a thread and a slot for ever); 0: no bound.
        self.max_run_s = max_run_s
        # Who may take the run threads: each version's bound, and the shadows (capacity.py).
        self.capacity = capacity if capacity is not None else RunCapacity()

    def __len__(self) -> int:
        return len(self._runs)

    def __iter__(self) -> Iterator[RunControl]:
        return iter(list(self._runs))

    def start(self) -> RunControl:
        control = RunControl()
        if self.closing:  # a run that starts after the grace ended stops at once
            control.terminate(ModelUnavailable(SHUTDOWN_MESSAGE))
        elif self.max_run_s > 0:
            control.timer = asyncio.get_running_loop().call_later(self.max_run_s, self._too_long, control)
        self._runs.add(control)
        return control

    def _too_long(self, control: RunControl) -> None:
        # Made when the bound passes, not for every run: most runs end long before it.
        control.terminate(
            DeadlineExceeded(
                f"the run took longer than the service's limit of {self.max_run_s:g} s "
                "(--max-run-s) and was stopped"
            )
        )

    def end(self, control: RunControl) -> None:
        self._runs.discard(control)
        if control.timer is not None:
            control.timer.cancel()

    def terminate_all(self) -> int:
        """Stop every run (shutdown): each fails UNAVAILABLE/draining. Returns how many."""
        self.closing = True
        runs = list(self._runs)
        for control in runs:
            control.terminate(ModelUnavailable(SHUTDOWN_MESSAGE))
        return len(runs)


# Set when shutdown gave up waiting for a run: its thread would hold the interpreter's exit
# (concurrent.futures joins its threads), so the command line exits without it (service/cli.py).
abandoned = threading.Event()


async def shut_down_executor(executor: ThreadPoolExecutor, timeout_s: float = EXECUTOR_STOP_S) -> bool:
    """Shut the executor down, waiting at most `timeout_s` for its threads (from a daemon thread:
    neither the event loop nor asyncio's default executor waits on it); False, and `abandoned`
    set, when a thread is still running then."""
    loop = asyncio.get_running_loop()
    finished = asyncio.Event()

    def wait() -> None:
        executor.shutdown(wait=True, cancel_futures=True)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(finished.set)

    threading.Thread(target=wait, name="executor-shutdown", daemon=True).start()
    try:
        await asyncio.wait_for(finished.wait(), timeout_s)
        return True
    except TimeoutError:
        log.error("a model run did not stop within %.1f s of the shutdown; exiting without it", timeout_s)
        abandoned.set()
        return False
