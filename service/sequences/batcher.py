"""The sequence batcher of one stateful model version (Triton's, for ONNX models).

A sequence is the steps that carry one correlation id (KServe `sequence_id`), from the one with
START to the one with END. The batcher keeps each live sequence on one model instance (a lane),
runs its steps there one at a time and in order, fills the control inputs the config names
(START, END, READY, CORRID) and feeds each state output of one step back as the state input of
the next (implicit state, kept here, per sequence: the graph itself holds nothing between runs).

Strategies, as Triton's:
- direct: each live sequence holds a batch slot of its instance (max_batch_size of them, or one
  for a model without a batch dimension) from START to END; a run is a batch of the instance's
  slots up to the highest one with a step ready, slots without one given READY false and zeros.
- oldest: an instance keeps up to max_candidate_sequences live sequences, and a run batches the
  oldest ready steps of different sequences (never two of one), up to max_batch_size rows.
With max_queue_delay_us a batch that is not full waits that long for more steps.

Bounds: the live sequences are at most the slots (direct) or max_candidate_sequences per instance
(oldest); a START beyond them is refused at once (RESOURCE_EXHAUSTED, queue_full), not kept in a
backlog as Triton does: a backlog holds its requests for as long as the live sequences take.
Each sequence has at most MAX_QUEUED_STEPS steps waiting. A sequence that has no step waiting or
running for max_sequence_idle_us is released (its state dropped); a later step of it, like a step
of a sequence never started, answers FAILED_PRECONDITION naming it, and a START for a live id is
refused the same way (Triton would end the old one: here it ends by END or by idling).

A live sequence holds a lease on its version, so that a reload lets it finish there: the version
retires once its sequences end or idle (or the drain timeout passes). The sequences of this
version are listed in the layer's directory, so that a step naming no version reaches the
version its sequence lives on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import numpy as np

from modelyard.service.errors import (
    DeadlineExceeded,
    DeviceFault,
    InvalidInput,
    ModelRunError,
    ModelUnavailable,
    Overloaded,
    SequenceStateError,
    ServiceError,
)
from modelyard.service.repository.model_config import SequenceBatchingConfig
from modelyard.service.runtime.instances import Instance
from modelyard.service.runtime.runs import RunControl, RunTiming
from modelyard.service.runtime.served import Lease, ServedVersion
from modelyard.service.runtime.session import run_checked, run_error
from modelyard.service.runtime.strings import to_ort
from modelyard.service.scheduling.queue import DEFAULT_SCHEDULING, Scheduling
from modelyard.service.sequences.step import Step
from modelyard.service.sequences.tensors import check_corrid, control_tensor, initial_state, null_row

log = logging.getLogger(__name__)

Outputs = dict[str, np.ndarray]
SequenceKey = int | str

# Steps of one sequence that may wait at once (a client pipelining its steps); one more is refused.
MAX_QUEUED_STEPS = 64
# Ids of sequences released for idling that are remembered, so that a late step hears why.
REMEMBERED_EXPIRED = 4096


@dataclass(eq=False, slots=True)
class _Step:
    feeds: Mapping[str, np.ndarray]
    names: tuple[str, ...]  # the outputs the client asked for (all of them when it named none)
    start: bool
    end: bool
    future: asyncio.Future[Outputs]
    arrived_ns: int
    key: Hashable  # steps with equal keys can share a run (same input names, dtypes, shapes)
    timer: asyncio.TimerHandle | None = None
    started_ns: int = 0
    run_ns: int = 0


@dataclass(eq=False, slots=True)
class _Sequence:
    id: SequenceKey
    lane: _Lane
    slot: int  # direct: its batch row; oldest: -1
    steps: deque[_Step] = field(default_factory=deque)
    state: dict[str, np.ndarray] | None = None  # None until its first step ran: the initial state
    running: bool = False
    ending: bool = False  # its END step is queued or running: no step may follow
    idle_since: float = 0.0  # monotonic; while it has no step waiting or running
    # Its version's lease while it lives (runtime/served.py): a reload leaves it on its version.
    lease: Lease | None = None


@dataclass(eq=False, slots=True)
class _Lane:
    """One instance and the sequences it keeps."""

    instance: Instance
    slots: list[_Sequence | None]  # direct: one per batch row; oldest: unused
    live: int = 0
    running: bool = False
    timer: asyncio.TimerHandle | None = None  # a batch waiting out max_queue_delay


@dataclass(eq=False, slots=True)
class _Row:
    sequence: _Sequence | None  # None: a direct slot with no step (READY false)
    step: _Step | None


class SequenceDirectory:
    """Which version each live sequence of a model lives on (the layer's, shared by the
    batchers of every version), so that a step that names no version follows its sequence."""

    def __init__(self) -> None:
        self._versions: dict[tuple[str, SequenceKey], ServedVersion] = {}

    def version_of(self, model: str, sequence_id: SequenceKey) -> ServedVersion | None:
        """The version the sequence lives on (one a reload took out of the served table included:
        the sequence's lease keeps it until the sequence ends); None when it is not live."""
        return self._versions.get((model, sequence_id))

    def add(self, served: ServedVersion, sequence_id: SequenceKey) -> None:
        self._versions[(served.model, sequence_id)] = served

    def remove(self, served: ServedVersion, sequence_id: SequenceKey) -> None:
        if self._versions.get((served.model, sequence_id)) is served:
            del self._versions[(served.model, sequence_id)]


class SequenceBatcher:
    def __init__(
        self,
        served: ServedVersion,
        settings: SequenceBatchingConfig,
        executor: Executor,
        directory: SequenceDirectory | None = None,
        clock: Callable[[], float] = time.monotonic,
        note: str = "",  # said of a sequence this process does not have (a worker's)
    ) -> None:
        self.served = served
        self.settings = settings
        self.name = served.label
        self._model = served.model
        self._instances = served.instances
        self._executor = executor
        self._stats = served.stats
        self._directory = directory if directory is not None else SequenceDirectory()
        self._clock = clock
        self._batched = bool(served.config.max_batch_size)
        rows = max(1, served.config.max_batch_size)
        self._direct = settings.strategy == "direct"
        self._rows = rows
        self._per_lane = rows if self._direct else settings.max_candidate_sequences
        self._lanes = [
            _Lane(instance, [None] * rows if self._direct else []) for instance in served.instances.all
        ]
        self._target = max(settings.preferred_batch_sizes, default=rows)
        self._delay_s = settings.max_queue_delay_us / 1e6
        self._idle_s = settings.max_sequence_idle_us / 1e6
        self._live: dict[SequenceKey, _Sequence] = {}
        self._idle: OrderedDict[SequenceKey, _Sequence] = OrderedDict()  # oldest idle first
        self._idle_timer: asyncio.TimerHandle | None = None
        self._expired: OrderedDict[SequenceKey, None] = OrderedDict()
        self._corrid = next((c for c in settings.controls if c.kind == "corrid"), None)
        self._initial = {s.input_name: initial_state(s, self._batched) for s in settings.states}
        self._state_outputs = settings.state_outputs
        self._state_map = tuple((s.output_name, s.input_name) for s in settings.states)
        self._string_states = frozenset(s.input_name for s in settings.states if s.datatype == "BYTES")
        self._client_outputs = served.runner.signature.output_names
        self._queued = 0
        self._closed = False
        self._note = note

    # -- what the data plane asks of a batcher ------------------------------------------------

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def has_idle_slot(self) -> bool:
        return not self._queued and any(not lane.running for lane in self._lanes)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def live(self) -> int:
        """Sequences live now (started, not ended, not released)."""
        return len(self._live)

    async def infer(
        self,
        feeds: Mapping[str, np.ndarray],
        names: Sequence[str],
        scheduling: Scheduling = DEFAULT_SCHEDULING,
        timing: RunTiming | None = None,
    ) -> Outputs:
        """A request that names no sequence: refused, as Triton refuses it."""
        raise InvalidInput(
            f"inference request to model '{self._model}' must specify a non-zero or non-empty correlation "
            "ID (it is a sequence model: KServe request parameters sequence_id, sequence_start, sequence_end)"
        )

    async def step(
        self,
        feeds: Mapping[str, np.ndarray],
        names: Sequence[str],
        step: Step,
        scheduling: Scheduling = DEFAULT_SCHEDULING,
        timing: RunTiming | None = None,
    ) -> Outputs:
        """Run one step of its sequence (checked inputs); its outputs, once the steps before it
        in its sequence have run."""
        if self._closed:
            raise ModelUnavailable(f"{self.name} is no longer served")
        if self._batched:
            for name, array in feeds.items():
                if array.shape[0] != 1:
                    raise InvalidInput(
                        f"inference request to model '{self._model}' must specify batch-size 1 due to "
                        f"requirements of sequence batcher (input {name!r} has {array.shape[0]} rows)"
                    )
        sequence = self._live.get(step.sequence_id)
        if step.start:
            if sequence is not None:
                raise SequenceStateError(
                    f"inference request for {step.shown} to model '{self._model}' has the START flag, but "
                    f"{step.shown} is live on {self.name}: end it first (sequence_end on its last step), or "
                    f"let it idle out ({self.settings.max_sequence_idle_us} us)"
                )
            if self._corrid is not None:
                check_corrid(self._corrid, step.sequence_id, self._model)
            sequence = self._begin(step)
        elif sequence is None:
            why = (
                f"; {step.shown} was released after idling for more than "
                f"{self.settings.max_sequence_idle_us} us (sequence_batching.max_sequence_idle_us)"
                if step.sequence_id in self._expired
                else f"; {step.shown} is not live on {self.name} (never started, or ended){self._note}"
            )
            raise SequenceStateError(
                f"inference request for {step.shown} to model '{self._model}' must specify the START flag on "
                f"the first request of the sequence{why}"
            )
        elif sequence.ending:
            raise SequenceStateError(
                f"inference request for {step.shown} to model '{self._model}' follows the step that ended it"
            )
        elif len(sequence.steps) >= MAX_QUEUED_STEPS:
            raise Overloaded(
                f"{step.shown} of {self.name} has {len(sequence.steps)} steps waiting already; retry later"
            )
        loop = asyncio.get_running_loop()
        pending = _Step(
            feeds,
            tuple(names) or self._client_outputs,
            step.start,
            step.end,
            loop.create_future(),
            time.perf_counter_ns(),
            tuple(
                sorted(
                    (name, a.dtype.str, a.shape[1:] if self._batched else a.shape)
                    for name, a in feeds.items()
                )
            ),
        )
        if step.end:
            sequence.ending = True
        sequence.steps.append(pending)
        self._idle.pop(sequence.id, None)
        self._queued += 1
        wait_s = scheduling.wait_s()
        if wait_s is not None:
            pending.timer = loop.call_later(max(0.0, wait_s), self._expire_step, sequence, pending)
        self._plan(sequence.lane)
        try:
            outputs = await pending.future
        except asyncio.CancelledError:
            # The client left: a step still waiting never runs (one already running finishes,
            # and its state stands).
            self._drop_step(sequence, pending)
            raise
        if timing is not None:
            timing.queue_ns, timing.run_ns = pending.started_ns - timing.admitted_ns, pending.run_ns
        return outputs

    # -- sequences ----------------------------------------------------------------------------

    def _begin(self, step: Step) -> _Sequence:
        """A new sequence on the instance with room (fewest live sequences, healthy first)."""
        lanes = [lane for lane in self._lanes if lane.live < self._per_lane]
        if not lanes:
            where = (
                "instances x max_batch_size slots (strategy direct)"
                if self._direct
                else "instances x sequence_batching.max_candidate_sequences (strategy oldest)"
            )
            raise Overloaded(
                f"{self.name} holds {len(self._live)} live sequences, as many as it may ({where}); a new "
                "sequence may start once one ends or idles out"
            )
        healthy = [lane for lane in lanes if self._instances.healthy(lane.instance)] or lanes
        lane = min(healthy, key=lambda each: each.live)
        slot = -1
        if self._direct:
            slot = lane.slots.index(None)
        sequence = _Sequence(step.sequence_id, lane, slot)
        if self._direct:
            lane.slots[slot] = sequence
        lane.live += 1
        self._live[step.sequence_id] = sequence
        self._expired.pop(step.sequence_id, None)
        sequence.lease = Lease(self.served)  # the version stays while the sequence lives
        self._directory.add(self.served, step.sequence_id)
        return sequence

    def _end(self, sequence: _Sequence) -> None:
        """The sequence is over (its END step ran, it idled out, or the batcher closed)."""
        if self._live.get(sequence.id) is not sequence:
            return
        del self._live[sequence.id]
        self._idle.pop(sequence.id, None)
        lane = sequence.lane
        lane.live -= 1
        if self._direct:
            lane.slots[sequence.slot] = None
        sequence.state = None
        self._directory.remove(self.served, sequence.id)
        if sequence.lease is not None:
            sequence.lease.release()

    def _rested(self, sequence: _Sequence) -> None:
        """The sequence has no step waiting or running: it idles from now on."""
        sequence.idle_since = self._clock()
        self._idle[sequence.id] = sequence
        self._idle.move_to_end(sequence.id)
        if self._idle_timer is None:
            self._arm_idle()

    def _arm_idle(self) -> None:
        if not self._idle or self._closed:
            self._idle_timer = None
            return
        oldest = next(iter(self._idle.values()))
        delay = max(0.0, oldest.idle_since + self._idle_s - self._clock())
        self._idle_timer = asyncio.get_running_loop().call_later(delay, self._sweep)

    def _sweep(self) -> None:
        """Release the sequences idle for longer than max_sequence_idle_us."""
        now = self._clock()
        while self._idle:
            key, sequence = next(iter(self._idle.items()))
            if sequence.idle_since + self._idle_s > now:
                break
            log.info(
                "%s: %s released after idling for %.3f s", self.name, _shown(key), now - sequence.idle_since
            )
            self._end(sequence)
            self._expired[key] = None
            if len(self._expired) > REMEMBERED_EXPIRED:
                self._expired.popitem(last=False)
        self._arm_idle()

    def _drop_step(self, sequence: _Sequence, pending: _Step) -> None:
        if pending.timer is not None:
            pending.timer.cancel()
        if pending in sequence.steps:
            sequence.steps.remove(pending)
            self._queued -= 1
            if pending.end:
                sequence.ending = False
            if not sequence.steps and not sequence.running and self._live.get(sequence.id) is sequence:
                if pending.start and sequence.state is None:
                    self._end(sequence)  # a START that never ran: no sequence to keep
                else:
                    self._rested(sequence)

    def _expire_step(self, sequence: _Sequence, pending: _Step) -> None:
        if pending.future.done() or pending not in sequence.steps:
            return  # running or answered: its deadline no longer applies
        self._drop_step(sequence, pending)
        self._stats.record_request(False, time.perf_counter_ns() - pending.arrived_ns)
        pending.future.set_exception(
            DeadlineExceeded(f"the request's deadline passed while it waited for {self.name}; not run")
        )

    # -- batches ------------------------------------------------------------------------------

    def _plan(self, lane: _Lane) -> None:
        """Start the lane's next batch, if its instance is free and a step is ready."""
        if lane.running or self._closed:
            return
        if lane.timer is not None:
            lane.timer.cancel()
            lane.timer = None
        if self._direct:
            ready = [s for s in lane.slots if s is not None and s.steps]
        else:
            ready = [s for s in self._live.values() if s.lane is lane and s.steps]
        if not ready:
            return
        ready.sort(key=lambda s: s.steps[0].arrived_ns)
        oldest = ready[0]
        key = oldest.steps[0].key
        chosen = [s for s in ready if s.steps[0].key == key and self._state_key(s) == self._state_key(oldest)]
        if not self._direct:
            chosen = chosen[: self._rows]
        full = len(chosen) >= (self._target if not self._direct else lane.live)
        if self._delay_s and not full:
            waited = (time.perf_counter_ns() - oldest.steps[0].arrived_ns) / 1e9
            if waited < self._delay_s:
                lane.timer = asyncio.get_running_loop().call_later(self._delay_s - waited, self._plan, lane)
                return
        if self._direct:
            top = max(s.slot for s in chosen)
            by_slot = {s.slot: s for s in chosen}
            rows = [
                _Row(by_slot[i], by_slot[i].steps.popleft()) if i in by_slot else _Row(None, None)
                for i in range(top + 1)
            ]
        else:
            chosen.sort(key=lambda s: s.steps[0].arrived_ns)
            rows = [_Row(s, s.steps.popleft()) for s in chosen]
        self._start(lane, rows)

    def _state_key(self, sequence: _Sequence) -> Hashable:
        """Sequences whose states have the same shapes can share a run."""
        if not self._initial:
            return None
        states = sequence.state if sequence.state is not None else self._initial
        return tuple(states[name].shape for name in sorted(states))

    def _start(self, lane: _Lane, rows: list[_Row]) -> None:
        lane.running = True
        instance = lane.instance
        instance.pending += 1
        instance.runs += 1
        now = time.perf_counter_ns()
        waited = 0
        real = 0
        for row in rows:
            if row.sequence is not None and row.step is not None:
                row.sequence.running = True
                self._queued -= 1
                if row.step.timer is not None:
                    row.step.timer.cancel()
                waited += now - row.step.arrived_ns
                real += 1
        self._stats.record_queue(waited, real)
        plan = _Plan(rows, self._feeds_for(rows), self._names_for(rows))
        if self._instances.runs_inline:  # a cheap model: on the loop (its watchdog may move it off)
            started, cpu = time.perf_counter(), time.thread_time()
            try:
                done = _compute(instance.runner, plan, self._batched, self._state_map, self.name, None)
            except Exception as exc:  # a bug in _compute: answer the steps rather than hang them
                done = _Computed([run_error(exc, self.name)] * len(rows), [])
            self._instances.ran_inline(time.perf_counter() - started, self.name, time.thread_time() - cpu)
            self._finished(lane, plan, done, inline=True)
            return
        control = self._instances.runs.start()
        try:
            future = self._executor.submit(
                _compute, instance.runner, plan, self._batched, self._state_map, self.name, control
            )
        except RuntimeError as exc:  # the executor is shut down
            self._instances.runs.end(control)
            self._finished(lane, plan, _Computed([run_error(exc, self.name)] * len(rows), []))
            return
        loop = asyncio.get_running_loop()
        future.add_done_callback(lambda done: loop.call_soon_threadsafe(self._ran, lane, plan, control, done))

    def _ran(self, lane: _Lane, plan: _Plan, control: RunControl, future: Future[_Computed]) -> None:
        self._instances.runs.end(control)
        try:
            done = future.result()
        except Exception as exc:
            done = _Computed([run_error(exc, self.name)] * len(plan.rows), [])
        self._finished(lane, plan, done)

    def _finished(self, lane: _Lane, plan: _Plan, done: _Computed, inline: bool = False) -> None:
        lane.running = False
        self._instances.finish(
            lane.instance, next((o for o in done.outcomes if isinstance(o, DeviceFault)), None)
        )
        stats = self._stats
        now = time.perf_counter_ns()
        served = 0
        for row, outcome, state in zip(plan.rows, done.outcomes, done.states, strict=True):
            sequence, pending = row.sequence, row.step
            if sequence is None or pending is None:
                continue
            sequence.running = False
            if not isinstance(outcome, dict):
                stats.record_request(False, now - pending.arrived_ns)
                if not pending.future.done():
                    pending.future.set_exception(
                        outcome
                        if outcome is not None
                        else ModelRunError(f"{self.name}: a step got no outcome")
                    )
            else:
                served += 1
                stats.record_request(True, now - pending.arrived_ns)
                if state is not None and self._live.get(sequence.id) is sequence:
                    sequence.state = state
                pending.started_ns, pending.run_ns = done.started_ns, done.run_ns
                if not pending.future.done():
                    pending.future.set_result({name: outcome[name] for name in pending.names})
            if pending.end:
                self._end(sequence)
            elif not sequence.steps and self._live.get(sequence.id) is sequence:
                if pending.start and sequence.state is None:
                    self._end(sequence)  # its START failed: it never began
                else:
                    self._rested(sequence)
        for rows, compute_ns in done.runs:
            stats.record_execution(rows, compute_ns)
        if len(done.runs) == 1:
            stats.record_compute(served, done.runs[0][1])
        else:
            for _, compute_ns in done.runs:
                stats.record_compute(1, compute_ns)
        # The next batch of this lane; after an inline run, at the loop's next turn (the answers
        # go out first, and no batch plans the next from inside its own call).
        if inline:
            asyncio.get_running_loop().call_soon(self._plan, lane)
        else:
            self._plan(lane)

    def _feeds_for(self, rows: list[_Row]) -> dict[str, np.ndarray]:
        """The batch's inputs: the steps' own, the controls, the states (on the event loop: a
        step's tensors are small, and a row is a reference, not a copy, where it can be)."""
        template = next(row.step for row in rows if row.step is not None)
        feeds: dict[str, np.ndarray] = {}
        for name, like in template.feeds.items():
            if self._batched:
                parts = [row.step.feeds[name] if row.step is not None else null_row(like) for row in rows]
                feeds[name] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
            else:
                feeds[name] = like
        for control in self.settings.controls:
            values: list[bool | int | str]
            if control.kind == "start":
                values = [row.step is not None and row.step.start for row in rows]
            elif control.kind == "end":
                values = [row.step is not None and row.step.end for row in rows]
            elif control.kind == "ready":
                values = [row.step is not None for row in rows]
            else:
                values = [row.sequence.id if row.sequence is not None else 0 for row in rows]
            feeds[control.name] = control_tensor(control, values, self._batched)
        for state in self.settings.states:
            name = state.input_name
            parts = []
            for row in rows:
                held = row.sequence.state if row.sequence is not None else None
                parts.append(held[name] if held is not None else self._initial[name])
            value = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
            feeds[name] = to_ort(name, value) if name in self._string_states else value
        return feeds

    def _names_for(self, rows: list[_Row]) -> tuple[str, ...]:
        names: dict[str, None] = {}
        for row in rows:
            if row.step is not None:
                names.update(dict.fromkeys(row.step.names))
        names.update(dict.fromkeys(self._state_outputs))
        return tuple(names)

    async def close(self) -> None:
        """The version retired: steps still waiting are answered UNAVAILABLE, every sequence is
        released (its lease given back)."""
        self._closed = True
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        for lane in self._lanes:
            if lane.timer is not None:
                lane.timer.cancel()
        for sequence in list(self._live.values()):
            while sequence.steps:
                pending = sequence.steps.popleft()
                if pending.timer is not None:
                    pending.timer.cancel()
                if not pending.future.done():
                    pending.future.set_exception(
                        ModelUnavailable(f"{self.name} stopped serving before the step ran")
                    )
            self._end(sequence)
        self._queued = 0


def _shown(key: SequenceKey) -> str:
    return Step(key).shown


@dataclass(eq=False, slots=True)
class _Plan:
    rows: list[_Row]
    feeds: dict[str, np.ndarray]
    names: tuple[str, ...]


@dataclass(eq=False, slots=True)
class _Computed:
    outcomes: list[Outputs | ServiceError | None]  # per row (None: a row without a step)
    runs: list[tuple[int, int]]  # (rows with a step, compute ns) of each successful run
    states: list[dict[str, np.ndarray] | None] = field(default_factory=list)  # per row, the next state
    started_ns: int = 0
    run_ns: int = 0

    def __post_init__(self) -> None:
        if not self.states:
            self.states = [None] * len(self.outcomes)


def _compute(
    runner: object,
    plan: _Plan,
    batched: bool,
    state_map: tuple[tuple[str, str], ...],
    label: str,
    control: RunControl | None,
) -> _Computed:
    """Run one batch (on an executor thread, or inline), and cut its outputs and next states
    (`state_map`: each state's output and input names) back into rows. A batch of several steps
    that fails is rerun step by step, so that one step's values cannot fail the steps that shared
    its run."""
    rows = plan.rows
    real = sum(1 for row in rows if row.step is not None)
    started = time.perf_counter_ns()
    try:
        arrays = run_checked(runner, plan.feeds, plan.names, label, control)  # type: ignore[arg-type]
    except ServiceError as exc:
        stopped = control is not None and control.why is not None
        if real == 1 or isinstance(exc, DeviceFault) or stopped:
            return _Computed([exc if row.step is not None else None for row in rows], [])
        return _alone(runner, plan, batched, state_map, label, control)
    run_ns = time.perf_counter_ns() - started
    outputs = dict(zip(plan.names, arrays, strict=True))
    outcomes: list[Outputs | ServiceError | None] = []
    states: list[dict[str, np.ndarray] | None] = []
    for index, row in enumerate(rows):
        if row.step is None:
            outcomes.append(None)
            states.append(None)
            continue
        try:
            mine = _row_of(outputs, index, len(rows), batched)
        except ModelRunError as exc:
            outcomes.append(exc)
            states.append(None)
            continue
        outcomes.append(mine)
        # Copies: the next step's state must not hold the whole batch's output alive.
        states.append({state: np.array(mine[output], copy=True) for output, state in state_map})
    return _Computed(outcomes, [(real, run_ns)], states, started, run_ns)


def _row_of(outputs: Mapping[str, np.ndarray], index: int, total: int, batched: bool) -> Outputs:
    if not batched:
        return dict(outputs)
    mine = {}
    for name, array in outputs.items():
        if array.ndim == 0 or array.shape[0] != total:
            raise ModelRunError(
                f"output {name!r} has shape {list(array.shape)}, whose first dimension is not the batch of "
                f"{total} rows: its rows cannot be given back to the steps of the batch"
            )
        mine[name] = array[index : index + 1]
    return mine


def _alone(
    runner: object,
    plan: _Plan,
    batched: bool,
    state_map: tuple[tuple[str, str], ...],
    label: str,
    control: RunControl | None,
) -> _Computed:
    outcomes: list[Outputs | ServiceError | None] = []
    states: list[dict[str, np.ndarray] | None] = []
    runs: list[tuple[int, int]] = []
    started = time.perf_counter_ns()
    for index, row in enumerate(plan.rows):
        if row.step is None:
            outcomes.append(None)
            states.append(None)
            continue
        feeds = {name: (array[index : index + 1] if batched else array) for name, array in plan.feeds.items()}
        one = _Plan([row], feeds, plan.names)
        done = _compute(runner, one, batched, state_map, label, control)
        outcomes.extend(done.outcomes)
        states.extend(done.states)
        runs.extend(done.runs)
    return _Computed(outcomes, runs, states, started, runs[-1][1] if runs else 0)
