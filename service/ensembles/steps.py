"""One ensemble request: its steps, run in the service without leaving the process.

Each step is a request of the data plane like any other (service/dataplane.py): it leases its
model's version, its tensors are checked against that version's signature and limits, it queues
in that version's batcher or for its run slots at the request's priority and deadline, and it
counts in that version's statistics. Before any step runs, every step's version is resolved and
leased at once (a step of the same model as another runs on the same version), so that a swap
while the request runs never mixes versions in one answer; the leases end with the request.

A step runs as soon as the tensors it is fed exist (steps that need nothing of each other run at
the same time: a fan-out); the first step to fail stops the others and is the answer. A step whose
model or version is not served answers UNAVAILABLE (the ensemble is there; a step of it cannot
run now), naming the step; any other error keeps its kind, its message prefixed with the step.

To the data plane an ensemble's version looks like any served version whose runs go to the
executor: its `instances` are EnsembleSteps, whose run is the steps (an ensemble takes no share of
the run threads: its steps take theirs).
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np

from modelyard.service.dataplane import Call, DataPlane
from modelyard.service.errors import ModelNotFound, ModelUnavailable, ServiceError
from modelyard.service.repository.ensemble_config import EnsembleStep
from modelyard.service.runtime.capacity import RunCapacity
from modelyard.service.runtime.instances import Instances, WaitLimit
from modelyard.service.runtime.runs import ActiveRuns, RunTiming
from modelyard.service.runtime.session import ModelRunner
from modelyard.service.scheduling.queue import DEFAULT_SCHEDULING, Scheduling

Arrays = dict[str, np.ndarray]


@dataclass(frozen=True)
class Plan:
    """An ensemble version's steps (in an order that runs each after those that feed it)."""

    label: str  # "ensemble e version 1", for messages
    steps: tuple[EnsembleStep, ...]
    dataplane: DataPlane

    async def run(
        self, feeds: Mapping[str, np.ndarray], names: Sequence[str], scheduling: Scheduling
    ) -> Arrays:
        with ExitStack() as leases:  # each step's call, released when the request ends
            calls = self._open(leases)
            made = await self._flow(calls, feeds, scheduling)
        return {name: made[name] for name in names}

    def _open(self, leases: ExitStack) -> list[Call]:
        """Every step's call (DataPlane.open), its version resolved and leased together with the
        others' (no await between): one set of versions for the whole request. Each is entered
        on `leases` as it opens, so that a step that cannot open releases those before it."""
        calls: list[Call] = []
        pinned: dict[str, str] = {}  # model -> the version its newest-version steps run on
        for index, step in enumerate(self.steps):
            version = step.pinned or pinned.get(step.model, "")
            try:
                call = leases.enter_context(self.dataplane.open(step.model, version))
            except ServiceError as exc:
                raise _step_error(exc, f"{self.label}: step {index} (model {step.model!r})") from None
            calls.append(call)
            if not step.pinned:
                pinned[step.model] = call.served.version_name
        return calls

    async def _flow(
        self, calls: list[Call], feeds: Mapping[str, np.ndarray], scheduling: Scheduling
    ) -> Arrays:
        loop = asyncio.get_running_loop()
        made: Arrays = dict(feeds)
        ready: dict[str, asyncio.Future[None]] = {
            tensor: loop.create_future() for step in self.steps for _, tensor in step.outputs
        }
        deadline = None if scheduling.time_remaining_s is None else loop.time() + scheduling.time_remaining_s

        async def run(index: int, step: EnsembleStep, call: Call) -> None:
            for _, tensor in step.inputs:
                if tensor in ready:
                    await ready[tensor]
            where = f"{self.label}: step {index} (model {step.model!r} version {call.served.version})"
            inputs = {model_input: made[tensor] for model_input, tensor in step.inputs}
            try:
                call.check_arrays(inputs)
                result = await call.infer(
                    inputs,
                    [output for output, _ in step.outputs],
                    _for_step(call, scheduling, deadline, loop),
                )
            except ServiceError as exc:
                raise _step_error(exc, where) from None
            for output, tensor in step.outputs:
                made[tensor] = result.outputs[output]
                ready[tensor].set_result(None)

        try:
            async with asyncio.TaskGroup() as group:
                for index, (step, call) in enumerate(zip(self.steps, calls, strict=True)):
                    group.create_task(run(index, step, call))
        except BaseExceptionGroup as failed:
            # The first step that failed is the answer (the others were stopped for it).
            raise _first(failed) from None
        return made


def _for_step(
    call: Call, scheduling: Scheduling, deadline: float | None, loop: asyncio.AbstractEventLoop
) -> Scheduling:
    """The request's scheduling as a step asks it of its model: the deadline that is left, and
    the priority where the step's model has that level (Call.levelled: else its default)."""
    levelled = call.levelled(scheduling)
    if deadline is None:
        return levelled
    return levelled._replace(time_remaining_s=max(0.0, deadline - loop.time()))


def _step_error(exc: ServiceError, where: str) -> ServiceError:
    """The error of a step as the ensemble's answer: the step named first. A step's model or
    version that is not served is the ensemble's unavailability, not an unknown model."""
    if isinstance(exc, ModelNotFound):
        return ModelUnavailable(f"{where}: {exc}")
    named = copy.copy(exc)  # a batch's failure may be the same object for several requests
    named.args = (f"{where}: {exc}",)
    return named


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    first: BaseException = group.exceptions[0]
    return first


class EnsembleSteps(Instances):
    """An ensemble version's `instances`: no session; a run is its Plan. It never runs inline
    and takes no run thread (its capacity is its own: the steps' models share the service's)."""

    def __init__(self, runner: ModelRunner, plan: Plan) -> None:
        super().__init__([runner], ["ensemble"], runs=ActiveRuns(0.0, RunCapacity(0)))
        self.plan = plan

    def run_here(
        self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str], label: str
    ) -> list[np.ndarray]:
        raise AssertionError(f"{label} is an ensemble: its steps never run inline")  # runs_inline is False

    async def run(
        self,
        feeds: Mapping[str, np.ndarray],
        output_names: Sequence[str],
        executor: Executor,
        label: str,
        timing: RunTiming | None = None,
        wait: WaitLimit | None = None,
    ) -> list[np.ndarray]:
        # The data plane passes the request's Scheduling as the wait limit.
        scheduling = wait if isinstance(wait, Scheduling) else DEFAULT_SCHEDULING
        started = time.perf_counter_ns()
        outputs = await self.plan.run(feeds, output_names, scheduling)
        if timing is not None:
            timing.queue_ns = started - timing.admitted_ns
            timing.run_ns = time.perf_counter_ns() - started
        return [outputs[name] for name in output_names]

    async def run_shadow(
        self,
        feeds: Mapping[str, np.ndarray],
        output_names: Sequence[str],
        label: str,
        timing: RunTiming | None = None,
    ) -> list[np.ndarray]:
        """A shadow call's steps run as shadows of their models (each only on spare capacity)."""
        outputs = await self.plan.run(feeds, output_names, Scheduling(shadow=True))
        return [outputs[name] for name in output_names]
