"""The admission queue on its own: order, bounds, deadlines, removal; a hand-stepped clock."""

from __future__ import annotations

import weakref
from collections import Counter

import pytest

from modelyard.service.errors import DeadlineExceeded, InvalidInput, Overloaded
from modelyard.service.scheduling.queue import (
    AdmissionPolicy,
    AdmissionQueue,
    QueuePolicy,
    Scheduling,
)
from tests.batching_fakes import ManualClock


class Observer:
    """Records what the queue reports (a QueueObserver)."""

    def __init__(self) -> None:
        self.depths: dict[int, int] = {}
        self.waited: list[tuple[int, float]] = []
        self.drops: Counter[tuple[int, str]] = Counter()

    def depth(self, level: int, depth: int) -> None:
        self.depths[level] = depth

    def dequeued(self, level: int, waited_s: float) -> None:
        self.waited.append((level, waited_s))

    def dropped(self, level: int, reason: str) -> None:
        self.drops[(level, reason)] += 1


def make(policy: AdmissionPolicy) -> tuple[AdmissionQueue[str], ManualClock, Observer]:
    clock, observer = ManualClock(), Observer()
    return AdmissionQueue(policy, clock, observer, name="model m version 1"), clock, observer


TWO_LEVELS = AdmissionPolicy(
    priority_levels=2,
    default_priority_level=2,
    default_queue_policy=QueuePolicy(max_queue_size=3, default_timeout_us=5000, allow_timeout_override=True),
    priority_queue_policy=((1, QueuePolicy(max_queue_size=1)),),
)


def test_higher_priority_first_then_oldest_first() -> None:
    queue, clock, observer = make(TWO_LEVELS)
    queue.admit("low-a", Scheduling())  # default level 2
    clock.advance(0.001)
    queue.admit("low-b", Scheduling(priority=2))
    queue.admit("high", Scheduling(priority=1))
    assert [t.item for t in queue] == ["high", "low-a", "low-b"]
    assert observer.depths == {1: 1, 2: 2}
    clock.advance(0.001)
    popped = [queue.pop(), queue.pop(), queue.pop(), queue.pop()]
    assert [t.item if t else None for t in popped] == ["high", "low-a", "low-b", None]
    assert [level for level, _ in observer.waited] == [1, 2, 2]
    assert [waited for _, waited in observer.waited] == pytest.approx([0.001, 0.002, 0.001])
    assert len(queue) == 0 and observer.depths == {1: 0, 2: 0}


def test_each_level_is_bounded_on_its_own() -> None:
    queue, _, observer = make(TWO_LEVELS)
    for i in range(3):
        queue.admit(f"low-{i}", Scheduling())
    with pytest.raises(Overloaded, match="priority 2 queue holds 3 requests"):
        queue.admit("low-3", Scheduling())
    queue.admit("high-0", Scheduling(priority=1))  # level 1 has its own room
    with pytest.raises(Overloaded, match="model m version 1"):
        queue.admit("high-1", Scheduling(priority=1))
    assert observer.drops == {(2, "queue_full"): 1, (1, "queue_full"): 1}
    assert queue.depth(1) == 1 and queue.depth(2) == 3
    queue.pop()
    queue.admit("high-1", Scheduling(priority=1))  # room again once one left


def test_priority_zero_means_default_and_others_must_exist() -> None:
    queue, _, _ = make(TWO_LEVELS)
    assert queue.level_of(Scheduling(priority=0)) == 2
    assert queue.level_of(Scheduling(priority=1)) == 1
    with pytest.raises(InvalidInput, match=r"priority 3 .* 1 \(highest\) to 2"):
        queue.admit("x", Scheduling(priority=3))


@pytest.mark.parametrize(
    ("policy", "request_us", "remaining_s", "expected_s"),
    [
        (QueuePolicy(), 0, None, None),  # no timeout anywhere: waits for ever
        (QueuePolicy(default_timeout_us=5000), 0, None, 0.005),
        (QueuePolicy(default_timeout_us=5000), 1000, None, 0.005),  # override not allowed: ignored
        (QueuePolicy(default_timeout_us=5000, allow_timeout_override=True), 1000, None, 0.001),
        (QueuePolicy(default_timeout_us=5000, allow_timeout_override=True), 9000, None, 0.005),  # only lower
        (QueuePolicy(allow_timeout_override=True), 2000, None, 0.002),  # lowers "no limit"
        (QueuePolicy(default_timeout_us=5000), 0, 0.003, 0.003),  # the client's deadline is earlier
        (QueuePolicy(default_timeout_us=5000), 0, 0.5, 0.005),
        (QueuePolicy(), 0, 0.25, 0.25),
    ],
)
def test_deadline_is_the_earliest_allowed_limit(
    policy: QueuePolicy, request_us: int, remaining_s: float | None, expected_s: float | None
) -> None:
    queue, clock, _ = make(AdmissionPolicy(default_queue_policy=policy))
    ticket = queue.admit("x", Scheduling(timeout_us=request_us, time_remaining_s=remaining_s))
    if expected_s is None:
        assert ticket.deadline is None
    else:
        assert ticket.deadline == pytest.approx(clock.now() + expected_s)


def test_expired_requests_leave_and_are_reported_once() -> None:
    queue, clock, observer = make(TWO_LEVELS)
    short = queue.admit("short", Scheduling(timeout_us=1000))
    long_ = queue.admit("long", Scheduling())  # the level's 5 ms
    forever = queue.admit("forever", Scheduling(priority=1))  # level 1: no timeout
    assert queue.next_deadline() == short.deadline
    clock.advance(0.002)
    assert [t.item for t in queue.expire()] == ["short"]
    assert not short.queued and queue.next_deadline() == long_.deadline
    assert queue.expire() == []
    clock.advance(0.01)
    assert [t.item for t in queue.expire()] == ["long"]
    assert [t.item for t in queue] == ["forever"] and forever.queued
    assert queue.next_deadline() is None
    assert observer.drops == {(2, "deadline"): 2}


def test_a_deadline_already_passed_is_refused_at_the_door() -> None:
    queue, _, observer = make(TWO_LEVELS)
    with pytest.raises(DeadlineExceeded):
        queue.admit("late", Scheduling(time_remaining_s=0.0))
    with pytest.raises(DeadlineExceeded):
        queue.check(Scheduling(time_remaining_s=0.0))
    assert len(queue) == 0 and observer.drops == {(2, "deadline"): 2}


def test_removed_requests_never_come_out() -> None:
    queue, clock, observer = make(TWO_LEVELS)
    first = queue.admit("first", Scheduling())
    second = queue.admit("second", Scheduling(timeout_us=1000))
    assert queue.remove(second) is True
    assert queue.remove(second) is False  # already gone
    clock.advance(1.0)
    assert queue.expire() == [first]  # the removed one's deadline does not come back
    assert queue.head() is None and observer.drops == {(2, "cancelled"): 1, (2, "deadline"): 1}


def test_take_and_close() -> None:
    queue, _, observer = make(TWO_LEVELS)
    tickets = [queue.admit(str(i), Scheduling()) for i in range(3)]
    queue.take(tickets[1:2])
    with pytest.raises(ValueError, match="already left"):
        queue.take(tickets[1:2])
    assert [t.item for t in queue.close()] == ["0", "2"]
    assert len(queue) == 0 and observer.drops == {(2, "shutdown"): 2}


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"priority_levels": 0}, "priority_levels"),
        ({"priority_levels": 2, "default_priority_level": 3}, "default_priority_level 3"),
        ({"priority_queue_policy": ((2, QueuePolicy()),)}, "level 2"),
    ],
)
def test_policy_checks_itself(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        AdmissionPolicy(**kwargs)  # type: ignore[arg-type]


class Work:
    """An item that can be watched for being freed."""


def test_answered_work_is_not_kept_until_its_deadline() -> None:
    queue: AdmissionQueue[Work] = AdmissionQueue(AdmissionPolicy(), ManualClock())
    watched = []
    for _ in range(500):
        work = Work()
        watched.append(weakref.ref(work))
        queue.admit(work, Scheduling(time_remaining_s=30.0))
        queue.pop()
        del work
    kept = sum(ref() is not None for ref in watched)
    assert kept <= 130, f"{kept} answered items are still referenced by the deadline heap"
    assert queue.next_deadline() is None
