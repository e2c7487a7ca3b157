"""The decode loop of one decoder model version: admission, continuous batching, delivery.

Sequences wait for a decode slot in an AdmissionQueue, the one the dynamic batcher uses: per
priority level bounded queues (a full one refuses at once), deadlines while waiting, removal on
cancel, and its metrics. A slot that frees goes to the queue's head (highest priority, oldest).

One asyncio task per model version runs the loop while there is work and ends when there is none.
Each turn of the loop:

1. drops waiting sequences whose deadline passed (never prefilled), running ones whose reader left
   (cancelled, disconnected) or whose deadline passed, pauses those whose reader is behind (buffer
   full) and resumes those whose reader caught up;
2. preempts paused sequences when others wait for a slot (below), gives free slots to the
   waiting ones and prefills their prompts (first token at once);
3. runs decode steps for every running sequence together, as one batch: one executor call runs
   steps back to back, leaving each step's tokens for the event loop as it goes, until something
   needs the loop between steps (an arrival, a leave, a reader behind, a deadline, a finish).

The hand-over of tokens costs the fewest wake-ups it can: a reader that runs out of events takes
what the steps left pending itself (`GenerationSequence.take` pulls), and the executor thread wakes the loop
(its self-pipe) only when a reader found nothing, or when it would otherwise run more than
MAX_AHEAD steps ahead; what piled up meanwhile goes over in one wake-up. With one stream whose
reader is busy writing the previous token, that is one wake-up fewer per token.

Joins and leaves happen only between steps (continuous batching). Model runs, cache copies and
sampling go to the executor; the event loop only plans, and turns tokens into text and events.
Stepping on in the executor thread, instead of one executor call per step, matters for a lone
stream: the hop to the executor and back (mostly waiting for the GIL while the event loop sends
the previous token) cost more than the step itself; now the loop sends while the next step runs.
With `continuous_batching: false` (or a graph without position_ids, whose positions would shift
under padding) every sequence decodes in a batch of its own instead.

Preemption: a paused sequence (its reader is not reading: gone, or slower than the model) holds
a slot that does no work. When others wait for one, it gives it up (PREEMPTED): its cache is kept
in host memory (on a device it is copied there, not dropped: see cache_ops.offload), with its
sampling state, so that what it emits once back is exactly what it would have emitted
uninterrupted. When its reader has taken every event, it waits for a slot again, in line with the
queued sequences by priority and by the time it started waiting, and rejoins a batch with its
cache. At most `max_preempted` are kept: past it the oldest one whose reader is still behind is
dropped (its stream ends ABORTED, reader_stalled). A preempted sequence costs its cache (layers x 2
x heads x length x head size x the cache's element size) and its stream buffer, no slot, no step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from modelyard.service.errors import (
    DeadlineExceeded,
    ModelUnavailable,
    PreemptedDropped,
    ReaderStalled,
    ServiceError,
)
from modelyard.service.generation.decoder import Cache, DecodeBatch, StepRunner, prefill
from modelyard.service.generation.logprobs import Logprob, prompt_logprobs, token_logprob
from modelyard.service.generation.model import DecoderModel
from modelyard.service.generation.sampling import choose, choose_rows
from modelyard.service.generation.sequence import (
    FinishReason,
    GenerationRequest,
    GenerationSequence,
    State,
    TokenEvent,
    Usage,
)
from modelyard.service.metrics import GenerationMetrics
from modelyard.service.runtime.session import run_error
from modelyard.service.scheduling.clock import MonotonicClock
from modelyard.service.scheduling.queue import DEFAULT_SCHEDULING, AdmissionQueue, QueueObserver, Scheduling

log = logging.getLogger(__name__)

# Prompt tokens prefilled per turn (at least one prompt): bounds how long a burst of new
# arrivals can hold up the tokens of the sequences already running.
PREFILL_TOKEN_BUDGET = 1024
T = TypeVar("T")
# A prompt's run: its cache, its first token, that token's log-probability (when asked) and the
# prompt's own (when asked).
_Prefilled = tuple[Cache, int, "Logprob | None", tuple[Logprob, ...]]
# Steps the executor thread may run past what the loop has delivered. Without a bound it held the
# GIL between its model runs often enough to keep the loop from sending for milliseconds; with
# 1 it waited on the loop at almost every step (bench.generate: 3 did best, 8 no better).
MAX_AHEAD = 3


@dataclass
class _Change:
    """What one batch does this turn, decided on the event loop, applied in the executor."""

    leaving: list[GenerationSequence] = field(default_factory=list)
    pausing: list[GenerationSequence] = field(default_factory=list)
    joining: list[tuple[GenerationSequence, Cache, int]] = field(default_factory=list)


@dataclass
class _Run:
    """One executor call's steps of one batch, as the executor thread and the event loop share it
    (plain attribute reads and writes and deque appends/pops: each is atomic under the GIL)."""

    deadline: float | None  # the earliest time the loop must look (a deadline, a stall)
    stop: bool = False  # set by the loop: something needs it between steps
    steps: int = 0  # steps run (by the executor thread)
    delivered: int = 0  # steps whose tokens the loop has delivered
    # Steps run but not yet handed to the loop: (rows, their tokens, the step's seconds, and the
    # tokens' log-probabilities where a row asked for them).
    pending: deque[tuple[list[GenerationSequence], list[int], float, list[Logprob | None] | None]] = field(
        default_factory=deque
    )
    # Rows whose step failed alone (the rest of the batch went on): failed on the loop after the
    # steps before it are delivered.
    failed: deque[tuple[GenerationSequence, Exception]] = field(default_factory=deque)
    scheduled: bool = False  # a _drain is on its way to the loop (one wake-up for what piles up)
    waiting: bool = False  # the executor thread waits for the loop to catch up
    # A reader of the batch found no event: wake the loop after the next step. Otherwise the
    # steps' tokens wait for the loop to take them when it next runs (a reader's pull, the end of
    # the executor call, or MAX_AHEAD steps behind): one wake-up fewer per token when the
    # readers are busy writing the previous one.
    wanted: bool = False
    caught_up: threading.Event = field(default_factory=threading.Event)  # set for a waiting thread

    @property
    def ahead(self) -> int:
        """Tokens per row run but not yet delivered."""
        return self.steps - self.delivered


class Engine:
    def __init__(
        self,
        model: DecoderModel,
        runner: StepRunner,
        version: int,
        executor: Executor,
        metrics: GenerationMetrics,
        queue_metrics: QueueObserver | None = None,
        name: str = "the model",  # for messages: "model m version 3"
    ) -> None:
        assert model.codec is not None, "an engine needs a tokenizer"
        self._model = model
        self._name = name
        self._codec = model.codec
        self._runner = runner
        self._version = version
        self._executor = executor
        self._metrics = metrics
        self._settings = model.settings
        self._vocab = model.vocab
        self._eos = self._codec.eos_ids
        self._shared_batches = self._settings.continuous_batching and model.layout.has_position_ids
        # The engine's times are time.monotonic() (request deadlines too); the queue's clock is the same.
        self._clock = MonotonicClock()
        self._queue: AdmissionQueue[GenerationSequence] = AdmissionQueue(
            self._settings.admission, self._clock, queue_metrics, name
        )
        self._slots: set[GenerationSequence] = set()  # admitted: prefill, running or paused
        # Preempted sequences by id, oldest preemption first; those ready to rejoin, by readiness.
        self._preempted: dict[int, GenerationSequence] = {}
        self._ready: dict[int, GenerationSequence] = {}
        self._max_preempted = self._settings.max_preempted
        self._unprefilled: deque[GenerationSequence] = deque()  # given a slot, prompt not run yet
        self._batches: list[DecodeBatch[GenerationSequence]] = []
        self._batch_of: dict[int, DecodeBatch[GenerationSequence]] = {}  # id(sequence) -> its batch
        self._runs: dict[int, _Run] = {}  # id(batch) -> its steps running in the executor now
        self._stall_s = self._settings.stall_timeout_ms / 1000
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def active(self) -> int:
        return len(self._slots)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def paused(self) -> int:
        """Sequences holding a slot out of the decode steps until their reader catches up."""
        return sum(1 for sequence in self._slots if sequence.state is State.PAUSED)

    @property
    def preempted(self) -> int:
        """Paused sequences that gave up their slot (kept in host memory)."""
        return len(self._preempted)

    # -- the readers' side -------------------------------------------------------------------

    def submit(
        self, request: GenerationRequest, scheduling: Scheduling = DEFAULT_SCHEDULING
    ) -> GenerationSequence:
        """Queue a validated request at its priority; raise what AdmissionQueue.admit raises:
        InvalidInput (no such priority), DeadlineExceeded (already late), Overloaded (its
        level's queue is full)."""
        if self._closed:
            raise ModelUnavailable("the model version is shutting down")
        if request.deadline is not None:
            # The queue measures the client's time from now: what is left of the request's
            # deadline, so that both end at the same instant.
            scheduling = scheduling._replace(time_remaining_s=request.deadline - self._clock.now())
        sequence = GenerationSequence(
            request, self._codec, self._version, self._settings.stream_buffer, self._drained, self._pull
        )
        sequence.ticket = self._queue.admit(sequence, scheduling)
        sequence.level = sequence.ticket.level
        # A free slot is taken now, not at the loop's next turn: arrivals that fit in free slots
        # must not count against (or be refused by) the wait queue's bound.
        self._seat()
        self._gauges()
        self._kick()
        return sequence

    def release(self, sequence: GenerationSequence, cause: str) -> None:
        """The reader left before the end ("cancelled" or "deadline"): the sequence leaves its
        batch at the next step, and its cache is freed there."""
        if sequence.state is State.DONE:
            return
        sequence.cancel_cause = cause
        self._metrics.cancelled(cause)
        self._metrics.finished(cause)
        if sequence.state is State.WAITING and sequence.ticket is not None:
            self._queue.remove(sequence.ticket)
        elif sequence.state is State.PREEMPTED:
            self._unpreempt(sequence)
        sequence.state = State.DONE
        self._gauges()
        self._kick()

    async def close(self) -> None:
        """Stop the loop (service shutdown); every unfinished stream ends UNAVAILABLE."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._fail_all(ModelUnavailable("the service is shutting down"))

    # -- the loop ----------------------------------------------------------------------------

    def _kick(self) -> None:
        self._wake.set()
        for run in self._runs.values():  # the loop has something to do between steps
            run.stop = True
        if not self._closed and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="decode-loop")

    async def _loop(self) -> None:
        while self._slots or self._queue or self._preempted:
            self._wake.clear()
            try:
                worked = await self._turn()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug or a runtime failure: end the streams, keep serving
                log.exception("decode loop of version %d failed", self._version)
                self._fail_all(run_error(exc, self._name))
            self._gauges()
            if not worked:
                # Every sequence is paused for its reader (or just left): wait for a reader, a new
                # arrival or the next deadline of a waiting sequence instead of spinning.
                await self._clock.wait(self._wake, self._next_deadline())
        self._gauges()

    def _stalled(self, sequence: GenerationSequence, now: float) -> bool:
        """Paused (or preempted) while its reader took nothing for the stall limit."""
        return (
            self._stall_s > 0
            and (
                sequence.state is State.PAUSED
                or (sequence.state is State.PREEMPTED and sequence.ready_at is None)
            )
            and now - sequence.paused_since >= self._stall_s
        )

    def _next_deadline(self) -> float | None:
        """When the loop must look again with nothing else happening: a waiting sequence's
        deadline, a seated sequence's deadline (its handler may never see the deadline pass: gRPC
        can abandon a stream whose send failed without closing it), or the moment a paused
        sequence's reader counts as stalled."""
        deadlines = [d for d in (self._queue.next_deadline(),) if d is not None]
        held = [*self._slots, *self._preempted.values()]
        deadlines += [
            s.request.deadline for s in held if s.request.deadline is not None and s.state is not State.DONE
        ]
        if self._stall_s:
            deadlines += [
                s.paused_since + self._stall_s
                for s in held
                if s.state is State.PAUSED or (s.state is State.PREEMPTED and s.ready_at is None)
            ]
        return min(deadlines, default=None)

    async def _turn(self) -> bool:
        """One turn; False when there was nothing to do (every sequence waits for its reader)."""
        self._expire(time.monotonic())
        changes = self._plan_leaving()
        await self._preempt()
        self._seat()
        admitted = self._admit()
        if admitted:
            await self._prefill(admitted)
        self._plan_joining(changes)
        # A batch that still has rows has runnable ones: rows whose reader is behind are pausing.
        if changes or any(len(batch) for batch in self._batches):
            await self._advance(changes)
            return True
        return bool(admitted)

    def _expire(self, now: float) -> None:
        for ticket in self._queue.expire():
            self._metrics.cancelled("deadline")
            self._metrics.finished("deadline")
            ticket.item.fail(DeadlineExceeded("the deadline passed while the generation waited for a slot"))
        # The queue's deadlines end at the slot; a sequence that has one keeps its client's deadline.
        for sequence in [*self._slots, *self._preempted.values()]:
            if sequence.state is not State.DONE and sequence.expired(now):
                self._unpreempt(sequence)
                self._metrics.cancelled("deadline")
                self._metrics.finished("deadline")
                sequence.fail(DeadlineExceeded("the deadline passed during generation"))
            elif self._stalled(sequence, now):
                self._unpreempt(sequence)
                # Its reader took nothing while it was paused: free the slot for the others.
                self._metrics.cancelled("stalled")
                self._metrics.finished("stalled")
                error = ReaderStalled(
                    f"the stream's reader took no tokens for {self._stall_s:g} s "
                    "(generation.stall_timeout_ms); the generation was dropped"
                )
                sequence.fail(error)
                if sequence.on_stalled is not None:
                    sequence.on_stalled(error)

    def _plan_leaving(self) -> dict[int, _Change]:
        """Finished or abandoned rows leave; rows whose reader is behind pause; paused or prefilled
        sequences that are done give their slot back at once (they hold no batch row)."""
        changes: dict[int, _Change] = {}
        for sequence in list(self._slots):
            batch = self._batch_of.get(id(sequence))
            if sequence.state is State.DONE:
                if batch is None:
                    self._free(sequence)
                else:
                    changes.setdefault(id(batch), _Change()).leaving.append(sequence)
            elif sequence.state is State.RUNNING and sequence.buffer_full and batch is not None:
                changes.setdefault(id(batch), _Change()).pausing.append(sequence)
        return changes

    def _seat(self) -> None:
        """Give every free slot to the head of the queue (the highest priority, then the oldest), or
        to a preempted sequence ready to run again that has waited longer at the same level or
        waits at a higher one: it gets back its slot with its cache (PAUSED, with room: it joins a
        batch at the next step)."""
        while len(self._slots) < self._settings.max_concurrent_sequences:
            ticket = self._queue.head()
            if self._ready:
                ready = min(self._ready.values(), key=_waiting_since)
                if ticket is None or _waiting_since(ready) <= (ticket.level, ticket.enqueued_at):
                    self._unpreempt(ready)
                    ready.state, ready.paused_since = State.PAUSED, time.monotonic()
                    self._slots.add(ready)
                    continue
            if ticket is None:
                return
            self._queue.take((ticket,))
            sequence = ticket.item
            sequence.state = State.PREFILL
            self._slots.add(sequence)
            self._unprefilled.append(sequence)

    # -- preemption --------------------------------------------------------------------------

    def _drained(self, sequence: GenerationSequence) -> None:
        """A paused or preempted sequence's reader has taken every event: it may run again (a
        preempted one waits for a slot from now on)."""
        if sequence.state is State.PREEMPTED and sequence.ready_at is None and not sequence.buffered:
            sequence.ready_at = self._clock.now()
            self._ready[id(sequence)] = sequence
        self._kick()

    async def _preempt(self) -> None:
        """Paused sequences whose reader is behind give their slots to the sequences waiting for
        one (queued, or preempted and ready again), the longest paused first."""
        if not self._max_preempted:
            return
        free = self._settings.max_concurrent_sequences - len(self._slots)
        wanted = len(self._queue) + len(self._ready) - free
        if wanted <= 0:
            return
        paused = sorted(
            (s for s in self._slots if s.state is State.PAUSED and s.cache is not None and not s.has_room),
            key=lambda s: s.paused_since,
        )[:wanted]
        if not paused:
            return
        if self._runner.bound:  # a cache on the device: copied to host memory, in the executor
            offload = self._runner.ops.offload
            caches = await asyncio.get_running_loop().run_in_executor(
                self._executor, lambda: [offload(s.cache.past) if s.cache is not None else [] for s in paused]
            )
            for sequence, past in zip(paused, caches, strict=True):
                if sequence.cache is not None:
                    sequence.cache = Cache(past, sequence.cache.length)
        for sequence in paused:
            # Still paused with its reader behind (it may have left, or read, while the cache moved).
            if sequence.state is not State.PAUSED or sequence.cache is None or sequence.has_room:
                continue
            self._slots.discard(sequence)
            sequence.state, sequence.ready_at = State.PREEMPTED, None
            self._preempted[id(sequence)] = sequence
            self._metrics.preemptions.inc()
        while len(self._preempted) > self._max_preempted:
            behind = (s for s in self._preempted.values() if s.ready_at is None)
            self._drop_preempted(next(behind, None) or next(iter(self._preempted.values())))

    def _drop_preempted(self, sequence: GenerationSequence) -> None:
        """Over max_preempted: this one's work is dropped; its stream ends ABORTED (reader_stalled)."""
        self._unpreempt(sequence)
        self._metrics.cancelled("preempted")
        self._metrics.finished("preempted")
        error = PreemptedDropped(
            "the stream's reader fell behind, so its generation gave its decode slot to waiting ones; "
            f"it was then the oldest of more than {self._max_preempted} such generations "
            "(generation.max_preempted) and was dropped"
        )
        sequence.fail(error)
        if sequence.on_stalled is not None:
            sequence.on_stalled(error)

    def _unpreempt(self, sequence: GenerationSequence) -> None:
        """No longer preempted (it has its slot again, or it ends)."""
        self._preempted.pop(id(sequence), None)
        self._ready.pop(id(sequence), None)
        sequence.ready_at = None

    def _admit(self) -> list[GenerationSequence]:
        """The seated sequences whose prompts run this turn, within the prefill budget."""
        admitted: list[GenerationSequence] = []
        budget = PREFILL_TOKEN_BUDGET
        while self._unprefilled:
            sequence = self._unprefilled[0]
            if sequence.state is State.DONE:  # left before its prompt ran; _plan_leaving frees it
                self._unprefilled.popleft()
                continue
            size = len(sequence.request.prompt_ids)
            if admitted and size > budget:
                break
            admitted.append(self._unprefilled.popleft())
            budget -= size
        return admitted

    def _plan_joining(self, changes: dict[int, _Change]) -> None:
        """Prefilled sequences, and paused ones whose reader caught up, join a batch."""
        for sequence in list(self._slots):
            if sequence.state not in (State.PAUSED, State.PREFILL) or sequence.cache is None:
                continue
            if not sequence.has_room:
                if sequence.state is not State.PAUSED:
                    sequence.state, sequence.paused_since = State.PAUSED, time.monotonic()
                continue
            batch = self._batch_for_joining()
            changes.setdefault(id(batch), _Change()).joining.append(
                (sequence, sequence.cache, sequence.next_token)
            )
            self._batch_of[id(sequence)] = batch
            sequence.cache = None
            sequence.state = State.RUNNING

    def _batch_for_joining(self) -> DecodeBatch[GenerationSequence]:
        if self._shared_batches and self._batches:
            return self._batches[0]
        batch: DecodeBatch[GenerationSequence] = DecodeBatch(self._runner, self._model.layout)
        self._batches.append(batch)
        return batch

    async def _prefill(self, sequences: list[GenerationSequence]) -> None:
        """Run the admitted prompts in the executor, one after another. Each first token is handed
        to the event loop as soon as its prompt is done (call_soon_threadsafe), so that it streams
        while the next prompt runs; all those callbacks run before this coroutine resumes, since
        the loop runs callbacks in the order they were scheduled and the executor's completion
        is scheduled last."""
        loop = asyncio.get_running_loop()
        layout = self._model.layout

        vocab, text = self._vocab, self._codec.token_text

        def run() -> None:
            for sequence in sequences:
                result: _Prefilled | Exception
                request = sequence.request
                try:
                    if request.prompt_logprobs:  # every position's logits: the prompt's scores
                        cache, logits = prefill(self._runner, layout, request.prompt_ids, all_positions=True)
                    else:
                        cache, logits = prefill(self._runner, layout, request.prompt_ids)
                    last = logits[-1, :vocab] if request.prompt_logprobs else logits[:vocab]
                    token = choose(last, request.sampling, sequence.rng, sequence.produced)
                    top = request.top_logprobs
                    first = token_logprob(last, token, top, text) if request.logprobs else None
                    scored = (
                        prompt_logprobs(logits[:, :vocab], request.prompt_ids, top, text)
                        if request.prompt_logprobs
                        else ()
                    )
                    result = (cache, token, first, scored)
                except Exception as exc:  # one bad prompt must not fail the others
                    result = exc
                loop.call_soon_threadsafe(self._after_prefill, sequence, result)

        await loop.run_in_executor(self._executor, run)

    def _after_prefill(self, sequence: GenerationSequence, result: _Prefilled | Exception) -> None:
        if isinstance(result, Exception):
            self._fail(sequence, run_error(result, self._name))
            self._free(sequence)
            return
        cache, token, first, scored = result
        if sequence.state is State.DONE:  # its reader left while the prompt ran
            self._free(sequence)
            return
        if sequence.request.prompt_only:  # the prompt's scores, no token
            self._prompt_only(sequence, scored, time.monotonic())
            self._free(sequence)
            return
        self._deliver(sequence, token, time.monotonic(), first, scored)
        if sequence.done:  # the first token ended it (eos, stop, max_tokens 1)
            self._free(sequence)
            return
        sequence.cache = cache
        sequence.next_token = token

    async def _advance(self, changes: dict[int, _Change]) -> None:
        """Apply each batch's changes and step it, in the executor, until the loop is needed
        between steps; the steps' tokens are delivered as they end (_drain)."""
        loop = asyncio.get_running_loop()
        batches = list(self._batches)
        work = [(batch, changes.get(id(batch), _Change())) for batch in batches]
        deadline = self._next_deadline()
        runs = [_Run(deadline) for _ in work]
        self._runs = {id(batch): run for (batch, _), run in zip(work, runs, strict=True)}
        try:
            results = await asyncio.gather(
                *(
                    loop.run_in_executor(self._executor, self._steps, batch, change, run, loop)
                    for (batch, change), run in zip(work, runs, strict=True)
                ),
                return_exceptions=True,
            )
        finally:
            for run in runs:  # the tokens of the last steps, not pulled or woken for
                self._drain(run)
            self._runs = {}
        now = time.monotonic()
        for (batch, change), result in zip(work, results, strict=True):
            for sequence in change.leaving:
                self._batch_of.pop(id(sequence), None)
                self._free(sequence)
            if isinstance(result, BaseException):
                self._fail_batch(batch, change, result)
                continue
            for sequence in change.pausing:
                self._batch_of.pop(id(sequence), None)
                cache, token = result[id(sequence)]
                if sequence.state is State.DONE:
                    self._free(sequence)
                else:
                    sequence.state, sequence.cache, sequence.next_token = State.PAUSED, cache, token
                    sequence.paused_since = now
            if not len(batch):
                self._batches.remove(batch)

    def _steps(
        self,
        batch: DecodeBatch[GenerationSequence],
        change: _Change,
        run: _Run,
        loop: asyncio.AbstractEventLoop,
    ) -> dict[int, tuple[Cache, int]]:
        """In the executor: apply the batch's changes, then step it while no row needs the loop.
        -> the caches of the rows that paused."""
        kept = batch.remove([*change.leaving, *change.pausing], keep=change.pausing)
        batch.add(change.joining)
        # The rows stay the same for this whole call: their sampling inputs are gathered once.
        members = list(batch.members)
        params = [m.request.sampling for m in members]
        rngs = [m.rng for m in members]
        produced = [m.produced for m in members]
        vocab, text = self._vocab, self._codec.token_text
        argmax = all(p.greedy and p.plain for p in params)  # choose_rows' plain path, decided once
        scored = any(m.request.logprobs for m in members)
        while len(batch):
            start = time.perf_counter()
            try:
                logits = batch.step()
            except Exception:
                if not self._isolate(batch, run, loop):
                    raise
                # The failed rows left; the others go on from the same caches, as they would have.
                members = list(batch.members)
                params = [m.request.sampling for m in members]
                rngs = [m.rng for m in members]
                produced = [m.produced for m in members]
                argmax = all(p.greedy and p.plain for p in params)
                scored = any(m.request.logprobs for m in members)
                continue
            if argmax:
                tokens: list[int] = np.argmax(logits[:, :vocab], axis=-1).tolist()
            else:
                tokens = choose_rows(logits[:, :vocab], params, rngs, produced)
            batch.set_next(tokens)
            logprobs = (
                [
                    token_logprob(row[:vocab], token, m.request.top_logprobs, text)
                    if m.request.logprobs
                    else None
                    for m, row, token in zip(members, logits, tokens, strict=True)
                ]
                if scored
                else None
            )
            run.pending.append((members, tokens, time.perf_counter() - start, logprobs))
            run.steps += 1
            # The loop is woken (a write to its self-pipe, and its thread taking the GIL from this
            # one) only when a reader waits or this thread would have to wait for it; once for
            # every step that piles up before it runs. `wanted` is read after the append: a
            # reader that says it waits after that read finds the step in its own pull.
            if not run.scheduled and (run.wanted or run.ahead > MAX_AHEAD):
                run.scheduled = True
                loop.call_soon_threadsafe(self._drain, run)
            if not self._step_again(run, members, tokens) or not self._wait_for_loop(run):
                break
        return kept

    def _isolate(
        self, batch: DecodeBatch[GenerationSequence], run: _Run, loop: asyncio.AbstractEventLoop
    ) -> bool:
        """In the executor, after a step of several rows failed: run each row's step alone to find
        the rows that fail, and take them out of the batch (their streams fail on the loop, after
        their earlier tokens). False when no row fails alone (the batch as a whole failed: an
        out-of-memory, a device fault), or the batch had one row: then the batch fails whole."""
        if len(batch) < 2:
            return False
        failed = batch.failing_rows()
        if not failed:
            return False
        batch.remove([member for member, _ in failed])
        run.failed.extend(failed)
        if not run.scheduled:
            run.scheduled = True
            loop.call_soon_threadsafe(self._drain, run)
        return True

    def _wait_for_loop(self, run: _Run) -> bool:
        """In the executor: wait (without the GIL) until the loop is at most MAX_AHEAD steps behind,
        so that it gets its turn to send while the next step runs. False: the loop wants to stop."""
        while True:
            if run.stop or self._closed:
                return False
            if run.ahead <= MAX_AHEAD:
                return True
            run.caught_up.clear()
            run.waiting = True
            # Looked at again after saying so: the loop sets the event only for a waiting thread.
            if run.ahead > MAX_AHEAD and not run.stop:
                run.caught_up.wait(0.001)
            run.waiting = False

    def _step_again(self, run: _Run, members: list[GenerationSequence], tokens: list[int]) -> bool:
        """In the executor, after a step: whether the next one can run without the loop. Not when
        the loop asked, a deadline is due, a row ended (its end-of-text token, its length; a stop
        sequence or a cancel shows as DONE, perhaps a step late, whose token is then dropped) or
        the next token would overfill a row's buffer (counting the tokens still on their way)."""
        if run.stop or self._closed:
            return False
        if run.deadline is not None and time.monotonic() >= run.deadline:
            return False
        ahead = run.ahead
        for member, token in zip(members, tokens, strict=True):
            if member.state is not State.RUNNING or token in self._eos:
                return False
            generated = member.generated + ahead
            if (
                generated >= member.request.max_tokens
                or len(member.request.prompt_ids) + generated >= self._model.context_length
                or member.buffered + ahead + 1 > self._settings.stream_buffer
            ):
                return False
        return True

    def _pull(self, sequence: GenerationSequence) -> None:
        """On the loop, from a reader that has no event: what its batch's running steps left
        pending, and a wake-up after the next step if that was nothing (`_Run.wanted`)."""
        batch = self._batch_of.get(id(sequence))
        run = None if batch is None else self._runs.get(id(batch))
        if run is None:  # not decoding now (prefill, paused, between executor calls)
            return
        run.wanted = True  # first: a step appended from now on wakes the loop
        if run.pending:
            self._drain(run)

    def _drain(self, run: _Run) -> None:
        """On the loop: the tokens of every step run since the last drain, in order."""
        run.scheduled = False  # first: a step appended from now on schedules the next drain
        if run.pending:
            run.wanted = False  # the readers have tokens; one that runs dry pulls again
        observe_rows, observe_seconds = self._metrics.step_rows.observe, self._metrics.step_seconds.observe
        now = time.monotonic()
        while run.pending:
            members, tokens, seconds, logprobs = run.pending.popleft()
            observe_rows(len(members))
            observe_seconds(seconds)
            for row, (sequence, token) in enumerate(zip(members, tokens, strict=True)):
                self._deliver(sequence, token, now, logprobs[row] if logprobs else None)
                if sequence.state is State.DONE or sequence.buffer_full:
                    run.stop = True
            # After the rows' counts include them: the executor thread reads `ahead` from this.
            run.delivered += 1
        while run.failed:  # after the tokens of the steps before their failure
            sequence, exc = run.failed.popleft()
            self._row_failed(sequence, exc)
        if run.waiting:
            run.caught_up.set()

    # -- tokens to events --------------------------------------------------------------------

    def _deliver(
        self,
        sequence: GenerationSequence,
        token: int,
        now: float,
        logprob: Logprob | None = None,
        scored: tuple[Logprob, ...] = (),
    ) -> None:
        if sequence.state is State.DONE:
            return  # its reader left during the step: the token is dropped
        sequence.generated += 1
        request = sequence.request
        finish: FinishReason | None = None
        if token in self._eos:
            finish, text = FinishReason.EOS, sequence.text.finish()
        else:
            delta = sequence.text.push(token)
            text = delta.text
            if delta.stopped:
                finish = FinishReason.STOP
            elif (
                sequence.generated >= request.max_tokens
                or len(request.prompt_ids) + sequence.generated >= self._model.context_length
            ):
                finish = FinishReason.LENGTH
                text += sequence.text.finish()
        self._metrics.tokens.inc()
        if sequence.generated == 1:
            sequence.first_token_at = now
            self._metrics.time_to_first_token.observe(now - sequence.submitted_at)
        else:
            self._metrics.inter_token.observe(now - sequence.last_token_at)
        sequence.last_token_at = now
        if sequence.generated == 1 and request.opening:
            text = request.opening + text
        logprobs = (logprob,) if logprob is not None else ()
        event = TokenEvent(
            sequence.generated - 1, text, (token,), self._version, logprobs=logprobs, prompt_logprobs=scored
        )
        if finish is not None:
            sequence.state = State.DONE
            self._metrics.finished(finish.value)
            event = TokenEvent(
                event.index,
                text,
                event.token_ids,
                self._version,
                finish,
                Usage(len(request.prompt_ids), sequence.generated),
                sequence.first_token_at - sequence.submitted_at,
                logprobs,
                scored,
            )
        sequence.push(event)

    def _prompt_only(self, sequence: GenerationSequence, scored: tuple[Logprob, ...], now: float) -> None:
        """A request that generates nothing: one event with the prompt's scores, and its end."""
        request = sequence.request
        sequence.first_token_at = now
        sequence.state = State.DONE
        self._metrics.finished(FinishReason.LENGTH.value)
        sequence.push(
            TokenEvent(
                0,
                request.opening,
                (),
                self._version,
                FinishReason.LENGTH,
                Usage(len(request.prompt_ids), 0),
                now - sequence.submitted_at,
                (),
                scored,
            )
        )

    # -- bookkeeping -------------------------------------------------------------------------

    def _free(self, sequence: GenerationSequence) -> None:
        sequence.cache = None
        self._slots.discard(sequence)

    def _fail(self, sequence: GenerationSequence, error: ServiceError) -> None:
        if sequence.state is not State.DONE:
            self._metrics.finished("error")
            sequence.fail(error)

    def _row_failed(self, sequence: GenerationSequence, error: Exception) -> None:
        """One row's step failed alone (the others went on): its stream ends with the error."""
        log.warning("decode step of version %d failed for one sequence: %s", self._version, error)
        self._fail(sequence, run_error(error, self._name))
        self._batch_of.pop(id(sequence), None)
        self._free(sequence)

    def _fail_batch(
        self, batch: DecodeBatch[GenerationSequence], change: _Change, error: BaseException
    ) -> None:
        """A batch whose step failed as a whole (no row fails alone, or it had one row) is dropped:
        its caches are in an unknown state."""
        log.error("decode step of version %d failed: %s", self._version, error)
        members = [*batch.members, *change.pausing, *(s for s, _, _ in change.joining)]
        for sequence in _unique(members):
            self._fail(sequence, run_error(error, self._name))
            self._batch_of.pop(id(sequence), None)
            self._free(sequence)
        if batch in self._batches:
            self._batches.remove(batch)

    def _fail_all(self, error: ServiceError) -> None:
        waiting = [ticket.item for ticket in self._queue.close()]
        for sequence in [*self._slots, *self._preempted.values(), *waiting]:
            self._fail(sequence, error)
            self._free(sequence)
        self._preempted.clear()
        self._ready.clear()
        self._unprefilled.clear()
        self._batches.clear()
        self._batch_of.clear()
        self._gauges()

    def _gauges(self) -> None:
        self._metrics.active.set(len(self._slots))
        self._metrics.waiting.set(len(self._queue) + len(self._ready))
        self._metrics.preempted.set(len(self._preempted))


def _waiting_since(sequence: GenerationSequence) -> tuple[int, float]:
    """A ready preempted sequence's place in line for a slot, as a queued ticket's (level, time)."""
    return sequence.level, sequence.ready_at if sequence.ready_at is not None else 0.0


def _unique(items: Iterable[T]) -> list[T]:
    """Distinct objects, in order (by identity: sequences are not hashable by value)."""
    seen: set[int] = set()
    out = []
    for item in items:
        if id(item) not in seen:
            seen.add(id(item))
            out.append(item)
    return out
