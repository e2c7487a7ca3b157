"""What the served table holds: loaded model versions, and the leases that hold them.

A `Lease` is the one way anything holds a version: a request's (the data plane's `Call` is one),
a live sequence's, a stream's. A version counts its leases (`in_flight`); one taken out of the
table drains (waits for that count to reach 0) before its sessions are dropped. A lease is
released exactly once, by its `with` block's end or by `release()`, whichever comes first."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Self

import numpy as np

from modelyard.service.repository.model_config import ModelConfig
from modelyard.service.runtime.instances import Instances
from modelyard.service.runtime.runs import ActiveRuns
from modelyard.service.runtime.session import ModelRunner

# What a layer above (batching, generation) registers to let go of a version that retired.
RetireHook = Callable[["ServedVersion"], Awaitable[None]]


@dataclass
class VersionStats:
    """Counters behind the KServe/Triton ModelStatistics extension."""

    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    fail_ns: int = 0
    inference_count: int = 0  # items, counting each batch row
    execution_count: int = 0  # model runs
    compute_ns: int = 0
    # Admission to the start of the run: the batcher's queue, or the checks before an own run.
    # Every successful request counts once (perf_analyzer finds its model version by this count).
    queue_count: int = 0
    queue_ns: int = 0
    last_inference_ms: int = 0
    # Per request, as Triton's inference_stats.compute_*: each successful request counts once,
    # charged the compute time of the run that served it (a batch's run, for each request in it).
    compute_request_count: int = 0
    compute_request_ns: int = 0

    def record_request(self, ok: bool, elapsed_ns: int, requests: int = 1) -> None:
        """`requests` requests that ended together (a batch's), `elapsed_ns` their summed time."""
        if ok:
            self.success_count += requests
            self.success_ns += elapsed_ns
        else:
            self.fail_count += requests
            self.fail_ns += elapsed_ns
        self.last_inference_ms = time.time_ns() // 1_000_000

    def record_execution(self, items: int, compute_ns: int) -> None:
        """One successful model run, of `items` batch rows (from one request or several)."""
        self.inference_count += items
        self.execution_count += 1
        self.compute_ns += compute_ns

    def record_compute(self, requests: int, compute_ns: int) -> None:
        """`requests` successful requests served by one run of `compute_ns`."""
        self.compute_request_count += requests
        self.compute_request_ns += requests * compute_ns

    def record_queue(self, waited_ns: int, requests: int = 1) -> None:
        """`requests` requests that left the queue together, `waited_ns` their summed wait."""
        self.queue_count += requests
        self.queue_ns += waited_ns

    def record_run(
        self, ok: bool, inputs: Mapping[str, np.ndarray], batched: int, admitted_ns: int, start_ns: int
    ) -> int:
        """One request that was a run of its own (no batcher): admitted at `admitted_ns`, run from
        `start_ns` to now (returned, perf_counter ns). Its items are batch rows: the first
        input's first dimension where the model batches (`batched`: its max_batch_size). What
        record_request and, when it succeeded, record_queue, record_execution and
        record_compute(1, ...) count, in one body: it runs on every request of a cheap model,
        where four calls more would be a measurable share of the request."""
        end = time.perf_counter_ns()
        self.last_inference_ms = time.time_ns() // 1_000_000
        if not ok:
            self.fail_count += 1
            self.fail_ns += end - admitted_ns
            return end
        compute_ns = end - start_ns
        self.success_count += 1
        self.success_ns += end - admitted_ns
        self.queue_count += 1
        self.queue_ns += start_ns - admitted_ns
        self.inference_count += next(iter(inputs.values())).shape[0] if batched and inputs else 1
        self.execution_count += 1
        self.compute_ns += compute_ns
        self.compute_request_count += 1
        self.compute_request_ns += compute_ns
        return end


class ServedVersion:
    """One loaded version. Requests lease it for their whole duration, so that a version taken out
    of the table is released only after the requests that resolved it have finished.

    The layers above (batching, generation) keep their own per-version workers; they attach when
    the version loads (ModelManager.on_load) or on first use, and register a retire hook here to
    let go of them, so that nothing here knows what they are."""

    def __init__(
        self,
        model: str,
        version: int,
        runners: Sequence[ModelRunner],
        config: ModelConfig,
        fingerprint: tuple[object, ...] = (),
        memory_bytes: int = 0,
        runs: ActiveRuns | None = None,  # the service's stoppable runs
    ) -> None:
        self.model = model
        self.version = version
        self.label = f"model {model} version {version}"  # for messages and logs
        self.version_name = str(version)  # as requests and answers name it (made once)
        # Every instance holds the same model: the first one answers for the signature, the
        # graph's kind and the provider; runs go through `instances`.
        self.runner = runners[0]
        execution = config.execution
        self.instances = Instances(
            runners,
            [r.device for r in runners],
            runs=runs,
            max_runs=execution.max_concurrent_runs,
            max_queued=execution.max_queued_runs,
        )
        self.config = config
        self.fingerprint = fingerprint  # the files it was loaded from; a change means reload
        self.memory_bytes = memory_bytes  # estimate of all its instances, for the model's memory budget
        # By CUDA device: the memory its sessions took there by their warm-ups' end (NVML).
        self.device_bytes: dict[int, int] = {}
        # Class labels by output name, from the config's label files (classification extension).
        self.labels: Mapping[str, tuple[str, ...]] = {}
        self.stats = VersionStats()
        # The workers of the layers above (a batcher, a decode loop), stopped when it retires.
        self._retire_hooks: list[RetireHook] = []
        self.in_flight = 0  # the leases that hold it (Lease: the only code that changes this)
        self._drained: asyncio.Event | None = None

    def on_retire(self, hook: RetireHook) -> None:
        """Call `hook` when this version retires, after it drained, before its session is dropped."""
        self._retire_hooks.append(hook)

    async def stop_workers(self) -> None:
        """Stop the workers the layers above attached to this version (after draining: nothing is
        queued any more), in the order they attached, so that they let go of the session."""
        hooks, self._retire_hooks = self._retire_hooks, []
        for hook in hooks:
            await hook(self)

    def drop_session(self) -> None:
        """Drop the sessions of every instance, so that ONNX Runtime frees them now rather than
        whenever the last reference goes. A request still running past the drain timeout fails
        instead. Its share of the run threads goes back to the other versions."""
        self.instances.retire()
        del self.runner
        del self.instances

    async def drain(self, timeout_s: float) -> bool:
        """Wait until no request holds this version; False if the timeout passed first."""
        if self.in_flight == 0:
            return True
        self._drained = asyncio.Event()
        try:
            await asyncio.wait_for(self._drained.wait(), timeout_s)
            return True
        except TimeoutError:
            return False


class Lease:
    """A hold on one served version, from its making to its release (exactly once: `release()`
    or the end of its `with` block, whichever comes first; later calls do nothing). A class with
    slots, not a generator: a request makes one. The data plane's `Call` is the lease of a
    request; a live sequence takes one of its own for as long as it lives."""

    __slots__ = ("_held", "served")

    def __init__(self, served: ServedVersion) -> None:
        self.served = served
        self._held = True
        served.in_flight += 1

    def __enter__(self) -> Self:
        return self

    def release(self, *exc: object) -> None:
        """Let go of the version (once); the last lease of a draining version wakes its drain."""
        if self._held:
            self._held = False
            served = self.served
            served.in_flight -= 1
            if served.in_flight == 0 and served._drained is not None:
                served._drained.set()

    # The block's end is a release (one body: no frame of its own per request).
    __exit__ = release


@dataclass(frozen=True)
class ServedModel:
    """The served versions of one model; never mutated, replaced whole on every change."""

    name: str
    config: ModelConfig
    versions: Mapping[int, ServedVersion] = field(default_factory=dict)

    @cached_property
    def default(self) -> ServedVersion:
        # Requests without a version get the newest served one. Computed once: the model is
        # replaced whole on every change, and every request without a version asks.
        return self.versions[max(self.versions)]
