"""Admission control: bounded queues per priority level, deadlines, and removal of abandoned work.

One `AdmissionQueue` orders the waiting work of one model version: highest priority first (level
1 is the highest), oldest first within a level. It decides at the door, at once, whether work may
wait at all (its level's queue has room; its deadline has not passed) and removes work whose
deadline passes while it waits or whose client leaves, so that neither is ever run.

It knows nothing about tensors, models or asyncio: the item it holds is the owner's (a batcher's
pending request, a generation's sequence), and the owner runs the loop that takes work out. The
owner wakes its loop after `admit`; `expire` and `next_deadline` let the loop drop expired work
and sleep until the next deadline.

Not thread-safe: use it from one event loop.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, Protocol, TypeVar

from modelyard.service.errors import DeadlineExceeded, InvalidInput, Overloaded
from modelyard.service.scheduling.clock import Clock

T = TypeVar("T")

# Why work left a queue without being taken to run, as the observer hears it.
QUEUE_FULL = "queue_full"
DEADLINE = "deadline"
CANCELLED = "cancelled"
SHUTDOWN = "shutdown"


@dataclass(frozen=True)
class QueuePolicy:
    """The rules of one priority level's queue (Triton's ModelQueuePolicy, REJECT action)."""

    max_queue_size: int = 0  # requests waiting at this level; one more is refused at once; 0 = no bound
    default_timeout_us: int = 0  # how long a request may wait at this level; 0 = no limit
    allow_timeout_override: bool = False  # may a request ask for a shorter wait than the default?


@dataclass(frozen=True)
class AdmissionPolicy:
    """Priority levels (1 is the highest), the level of requests that name none, and the queue
    policy of each level: `priority_queue_policy` lists the levels that differ from the default."""

    priority_levels: int = 1
    default_priority_level: int = 1
    default_queue_policy: QueuePolicy = field(default_factory=QueuePolicy)
    priority_queue_policy: tuple[tuple[int, QueuePolicy], ...] = ()

    def __post_init__(self) -> None:
        if self.priority_levels < 1:
            raise ValueError(f"priority_levels must be >= 1, got {self.priority_levels}")
        if not 1 <= self.default_priority_level <= self.priority_levels:
            raise ValueError(
                f"default_priority_level {self.default_priority_level} is not a level in "
                f"1..{self.priority_levels}"
            )
        for level, _ in self.priority_queue_policy:
            if not 1 <= level <= self.priority_levels:
                raise ValueError(f"priority_queue_policy level {level} is not in 1..{self.priority_levels}")

    def policy(self, level: int) -> QueuePolicy:
        for configured, policy in self.priority_queue_policy:
            if configured == level:
                return policy
        return self.default_queue_policy


class Scheduling(NamedTuple):
    """What a request asks of the queue: its priority, a timeout, and its client's deadline. A
    tuple: made for every request with a deadline (a frozen dataclass's __init__ is Python and
    sets each field through object.__setattr__; service/api/scheduling.py makes it as the tuple
    it is)."""

    priority: int = 0  # 1 is the highest level; 0 means the default level
    timeout_us: int = 0  # lowers the level's default timeout, where the level allows it; 0 = none
    time_remaining_s: float | None = None  # until the client's own deadline (gRPC); None = none
    # A shadow call (x-model-dye: shadow): the lowest priority there is, only on spare capacity
    # (runtime/capacity.py); it never raises a call's priority.
    shadow: bool = False

    def wait_s(self) -> float | None:
        """How long the request may wait (its timeout_us or its client's deadline, whichever
        comes first; None: for ever): a run waiting for its version's run slot."""
        remaining = self.time_remaining_s
        if self.timeout_us:
            timeout = self.timeout_us / 1e6
            remaining = timeout if remaining is None else min(timeout, remaining)
        return remaining


DEFAULT_SCHEDULING = Scheduling()  # the default level, the level's timeout, no client deadline


@dataclass(eq=False, slots=True)
class Ticket(Generic[T]):
    """One piece of waiting work. `queued` turns False when it leaves the queue for any reason."""

    item: T
    level: int
    enqueued_at: float
    deadline: float | None  # on the queue's clock; None = may wait for ever
    number: int  # order of arrival at this queue
    queued: bool = True


class QueueObserver(Protocol):
    """What a queue reports as it changes (metrics); every call is cheap and must not raise."""

    def depth(self, level: int, depth: int) -> None: ...

    def dequeued(self, level: int, waited_s: float) -> None:
        """Work left the queue to run, after waiting `waited_s`."""
        ...

    def dropped(self, level: int, reason: str) -> None:
        """Work was refused or left without running: queue_full, deadline, cancelled, shutdown."""
        ...


class _Silent:
    def depth(self, level: int, depth: int) -> None:
        pass

    def dequeued(self, level: int, waited_s: float) -> None:
        pass

    def dropped(self, level: int, reason: str) -> None:
        pass


class AdmissionQueue(Generic[T]):
    def __init__(
        self, policy: AdmissionPolicy, clock: Clock, observer: QueueObserver | None = None, name: str = ""
    ) -> None:
        self.policy = policy
        self._clock = clock
        self._observer = observer or _Silent()
        self._name = name  # says whose queue it is in error messages, e.g. "model m version 3"
        # One insertion-ordered dict per level: O(1) removal of any ticket, oldest first.
        self._levels: list[dict[int, Ticket[T]]] = [{} for _ in range(policy.priority_levels)]
        # Each level's policy, looked up once (admit reads it on every request).
        self._policies = [policy.policy(level) for level in range(1, policy.priority_levels + 1)]
        # The levels whose requests wait without a timeout unless they ask for one: a request
        # there that asks nothing of the queue and has no client deadline has no deadline at all.
        self._untimed = [not p.default_timeout_us for p in self._policies]
        self._default_level = policy.default_priority_level
        # Deadlines in a heap; tickets that left the queue stay in it until they reach the top, or
        # until they are half of it: then it is rebuilt, so that work answered long before its
        # deadline (a 30 s gRPC deadline, say) is not kept alive for that long.
        self._deadlines: list[tuple[float, int, Ticket[T]]] = []
        self._stale = 0
        self._sequence = itertools.count()
        self._count = 0

    # -- the door ----------------------------------------------------------------------------

    def level_of(self, scheduling: Scheduling) -> int:
        """The priority level a request waits at; InvalidInput for a level the model lacks."""
        if scheduling.priority == 0:
            return self.policy.default_priority_level
        if not 1 <= scheduling.priority <= self.policy.priority_levels:
            raise InvalidInput(
                f"priority {scheduling.priority} is not a priority level of {self._name or 'this model'}: "
                f"its levels are 1 (highest) to {self.policy.priority_levels}, and 0 means the default "
                f"level {self.policy.default_priority_level}"
            )
        return scheduling.priority

    def deadline_of(self, level: int, scheduling: Scheduling, now: float) -> float | None:
        """When a request admitted now must have left the queue: the earlier of its level's timeout
        (lowered by the request's own timeout where allowed) and its client's deadline."""
        policy = self._policies[level - 1]
        timeout_us = policy.default_timeout_us
        if scheduling.timeout_us and policy.allow_timeout_override:
            timeout_us = min(timeout_us, scheduling.timeout_us) if timeout_us else scheduling.timeout_us
        deadline = now + timeout_us / 1e6 if timeout_us else None
        if scheduling.time_remaining_s is not None:
            client = now + scheduling.time_remaining_s
            deadline = client if deadline is None else min(deadline, client)
        return deadline

    def check(self, scheduling: Scheduling) -> tuple[int, float | None]:
        """The level and deadline a request would get, raising what `admit` raises except for a full
        queue: for work that runs at once, without waiting in the queue."""
        level, deadline, _ = self._check(scheduling)
        return level, deadline

    def _check(self, scheduling: Scheduling) -> tuple[int, float | None, float]:
        level = self.level_of(scheduling) if scheduling.priority else self._default_level
        now = self._clock.now()
        if scheduling.time_remaining_s is None and not scheduling.timeout_us and self._untimed[level - 1]:
            return level, None, now  # most requests: no deadline, nothing to check (no call)
        deadline = self.deadline_of(level, scheduling, now)
        if deadline is not None and deadline <= now:
            self._observer.dropped(level, DEADLINE)
            raise DeadlineExceeded("the request's deadline passed before it was queued")
        return level, deadline, now

    def admit(self, item: T, scheduling: Scheduling) -> Ticket[T]:
        """Queue `item`, or refuse it at once: InvalidInput (no such priority), DeadlineExceeded
        (its deadline has already passed), Overloaded (its level's queue is full)."""
        level, deadline, now = self._check(scheduling)
        queue = self._levels[level - 1]
        limit = self._policies[level - 1].max_queue_size
        if limit and len(queue) >= limit:
            self._observer.dropped(level, QUEUE_FULL)
            raise Overloaded(
                f"{self._name or 'the model'} is overloaded: its priority {level} queue holds "
                f"{len(queue)} requests, its max_queue_size; retry later or with a higher priority"
            )
        ticket = Ticket(item, level, now, deadline, next(self._sequence))
        queue[ticket.number] = ticket
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, ticket.number, ticket))
        self._count += 1
        self._observer.depth(level, len(queue))
        return ticket

    # -- leaving -----------------------------------------------------------------------------

    def remove(self, ticket: Ticket[T]) -> bool:
        """The owner gave up on the work (its client cancelled): take it out, so it never runs.
        False when it had already left the queue."""
        if not ticket.queued:
            return False
        self._unlink(ticket)
        self._observer.dropped(ticket.level, CANCELLED)
        return True

    def expire(self) -> list[Ticket[T]]:
        """Take out every ticket whose deadline has passed; the owner answers them."""
        now = self._clock.now()
        expired: list[Ticket[T]] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, ticket = heapq.heappop(self._deadlines)
            if not ticket.queued:
                self._stale -= 1
            else:
                self._unlink(ticket, in_heap=False)
                self._observer.dropped(ticket.level, DEADLINE)
                expired.append(ticket)
        return expired

    def next_deadline(self) -> float | None:
        """The earliest deadline of the work still waiting, so that a loop knows when to wake."""
        while self._deadlines and not self._deadlines[0][2].queued:
            heapq.heappop(self._deadlines)
            self._stale -= 1
        return self._deadlines[0][0] if self._deadlines else None

    def take(self, tickets: Iterable[Ticket[T]]) -> None:
        """Take tickets out to run them (they must still be queued)."""
        now = self._clock.now()
        levels: set[int] = set()
        observer = self._observer
        for ticket in tickets:
            if not ticket.queued:
                raise ValueError("the ticket has already left the queue")
            # _unlink's work, without its call and its depth report (once per level, below)
            level = ticket.level
            del self._levels[level - 1][ticket.number]
            ticket.queued = False
            self._count -= 1
            if ticket.deadline is not None:
                self._stale_entry()
            levels.add(level)
            observer.dequeued(level, now - ticket.enqueued_at)
        for level in levels:  # once per level a batch took from, not once per request
            observer.depth(level, len(self._levels[level - 1]))

    def pop(self) -> Ticket[T] | None:
        """Take the head (highest priority, oldest) out to run it; None when the queue is empty."""
        head = self.head()
        if head is not None:
            self.take((head,))
        return head

    def close(self) -> list[Ticket[T]]:
        """Take out everything (the owner is shutting down); the owner answers them."""
        left = list(self)
        for ticket in left:
            self._unlink(ticket)
            self._observer.dropped(ticket.level, SHUTDOWN)
        self._deadlines.clear()
        self._stale = 0
        return left

    # -- looking -----------------------------------------------------------------------------

    def head(self) -> Ticket[T] | None:
        for queue in self._levels:
            if queue:
                return next(iter(queue.values()))
        return None

    def __iter__(self) -> Iterator[Ticket[T]]:
        """Waiting tickets in the order they are served: by level, then oldest first. Do not change
        the queue while iterating: collect, then `take`."""
        for queue in self._levels:
            yield from queue.values()

    def __len__(self) -> int:
        return self._count

    def depth(self, level: int) -> int:
        return len(self._levels[level - 1])

    def _unlink(self, ticket: Ticket[T], in_heap: bool = True) -> None:
        queue = self._levels[ticket.level - 1]
        del queue[ticket.number]
        ticket.queued = False
        self._count -= 1
        self._observer.depth(ticket.level, len(queue))
        if ticket.deadline is not None and in_heap:
            self._stale_entry()

    def _stale_entry(self) -> None:
        """A ticket with a deadline left the queue; its heap entry stays until it reaches the top,
        or until the stale entries are half the heap: then the heap is rebuilt."""
        self._stale += 1
        if self._stale > 64 and self._stale * 2 > len(self._deadlines):
            self._deadlines = [entry for entry in self._deadlines if entry[2].queued]
            heapq.heapify(self._deadlines)
            self._stale = 0
