"""One generation as the decode loop and its reader share it: request, state, bounded event buffer.

The decode loop writes events, the reader (one gRPC stream) takes them. The buffer is bounded by
the loop, not by the reader: a sequence whose buffer is full is paused (left out of decode steps)
until the reader catches up, so a slow reader costs a paused slot, never a growing buffer.
Everything here runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from modelyard.service.generation.decoder import Cache
from modelyard.service.generation.logprobs import Logprob
from modelyard.service.generation.sampling import Produced, SamplingParams
from modelyard.service.generation.text import Decoder, TextStream
from modelyard.service.scheduling.queue import Ticket

_UNDRAWN = np.random.default_rng(0)  # see GenerationSequence.rng


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    EOS = "eos"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request: every field fits the model."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    deadline: float | None = None  # time.monotonic() after which the work is dropped
    logprobs: bool = False  # each generated token's log-probability with its event
    top_logprobs: int = 0  # with logprobs or prompt_logprobs: the N most likely at each position
    prompt_logprobs: bool = False  # the first event carries the prompt's log-probabilities
    prompt_only: bool = False  # generate nothing (the prompt's scores only)
    opening: str = ""  # text the first event begins with (a chat template's reply opening)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class TokenEvent:
    """One streamed event: the tokens it adds and the text they release. The last event of a
    stream carries the finish reason, usage and time to first token."""

    index: int  # the event's sequence number in its stream
    text: str
    token_ids: tuple[int, ...]
    version: int
    finish: FinishReason | None = None
    usage: Usage | None = None
    time_to_first_token_s: float = 0.0
    logprobs: tuple[Logprob, ...] = ()  # one per token id, when the request asked
    prompt_logprobs: tuple[Logprob, ...] = ()  # the first event's, when the request asked


class State(enum.Enum):
    WAITING = "waiting"  # in the engine's AdmissionQueue, for a slot
    PREFILL = "prefill"  # has a slot; its prompt runs next
    RUNNING = "running"  # a row of a decode batch
    PAUSED = "paused"  # holds its slot and cache, out of the batch until its reader catches up
    # Was paused while others waited for a slot: gave its slot up, its cache kept in host memory,
    # until its reader has taken every event (ready) and a slot is free again.
    PREEMPTED = "preempted"
    DONE = "done"


class GenerationSequence:
    """One Generate request's life in its version's decode loop (engine.py): waiting for a slot,
    its prompt's prefill, its decode steps, paused for its reader or preempted, done; and the
    events it leaves for its reader (`take`). Named apart from collections.abc.Sequence."""

    def __init__(
        self,
        request: GenerationRequest,
        decoder: Decoder,
        version: int,
        buffer: int,
        on_drained: Callable[[GenerationSequence], None],
        pull: Callable[[GenerationSequence], None] | None = None,
    ) -> None:
        self.request = request
        self.version = version
        self.state = State.WAITING
        # A greedy choice draws nothing: such a sequence shares one generator that is never drawn
        # from, instead of seeding its own (seeding is work on the first token's path).
        self.rng: np.random.Generator = _UNDRAWN if request.sampling.greedy else request.sampling.generator()
        self.produced = Produced(request.sampling)  # for its penalties: touched by the choosing thread
        self.text = TextStream(decoder, request.stop)
        self.generated = 0
        self.cache: Cache | None = None  # while PAUSED, or between prefill and joining a batch
        self.next_token = 0
        self.cancel_cause = ""  # set when the reader leaves: "cancelled" or "deadline"
        self.ticket: Ticket[GenerationSequence] | None = None  # its place in the wait queue, while WAITING
        self.submitted_at = time.monotonic()
        self.first_token_at = 0.0
        self.last_token_at = 0.0
        self.paused_since = 0.0  # when it last paused for its reader
        self.level = 0  # its priority level in the wait queue (a preempted one waits at it again)
        self.ready_at: float | None = None  # preempted, and its reader has taken everything since
        # Told when the sequence is dropped because its reader stalled: the reader is then blocked
        # in a write, so the transport must end the stream from outside it.
        self.on_stalled: Callable[[BaseException], None] | None = None
        self._buffer = buffer
        self._events: deque[TokenEvent | BaseException] = deque()
        self._readable = asyncio.Event()
        self._on_drained = on_drained
        self._pull = pull  # asks the decode loop for tokens its steps ran but did not hand over yet

    # -- the decode loop's side --------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.state is State.DONE

    @property
    def buffer_full(self) -> bool:
        return len(self._events) >= self._buffer

    @property
    def buffered(self) -> int:
        """Events its reader has not taken yet."""
        return len(self._events)

    @property
    def has_room(self) -> bool:
        return len(self._events) < self._buffer

    def push(self, event: TokenEvent) -> None:
        self._events.append(event)
        self._readable.set()

    def fail(self, error: BaseException) -> None:
        """End the stream with an error (the reader raises it after the events before it)."""
        self.state = State.DONE
        self.cache = None
        self._events.append(error)
        self._readable.set()

    def expired(self, now: float) -> bool:
        return self.request.deadline is not None and now >= self.request.deadline

    # -- the reader's side -------------------------------------------------------------------

    async def take(self) -> list[TokenEvent]:
        """Every event buffered now (waiting for one if there is none). A reader that keeps up
        gets one token per call; one that fell behind gets what piled up, in one go."""
        while not self._events:
            if self._pull is not None:
                self._pull(self)
                if self._events:
                    break
            self._readable.clear()
            await self._readable.wait()
        taken: list[TokenEvent] = []
        while self._events:
            item = self._events[0]
            if isinstance(item, BaseException):
                if taken:
                    break  # the events before the error first; the error on the next call
                self._events.popleft()
                raise item
            taken.append(item)
            self._events.popleft()
        if self.state is State.PAUSED or self.state is State.PREEMPTED:
            self._on_drained(self)
        return taken
