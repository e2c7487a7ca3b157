"""Who may take the service's run threads: each served version's bound, and shadows on what is spare.

The service runs models on one executor of `threads` threads (--inference-threads, one per core by
default). Without a bound per version, a slow or busy version (a canary of a CPU-heavy graph, a
shadow's mirrored calls) takes every thread, and another version's runs queue behind its runs.
So each version that runs on the executor may have at most its bound of runs going at once
(Instances.limit): `execution.max_concurrent_runs` from its config, or by default a share of the
threads among the versions that run there, `max(1, threads // versions)` (and never fewer than its
instances: each is a session the config asked to run side by side), so that the bounds add up to
no more than the threads while there are no more versions than threads (then a version at its
bound never waits for a thread another version holds). A version alone has no bound of its own:
its runs queue for the executor's threads directly. The share follows the served table: a version that
loads lowers it, one that retires raises it again (and its waiting runs start). Versions that run
inline on the event loop take no thread and do not count.

A shadow (a sidecar's mirrored call, `x-model-dye: shadow`, that nobody waits for) runs only on
spare capacity: on a thread of its own whose scheduling policy is Linux's SCHED_IDLE (the kernel
gives it a core only when nothing else wants one; elsewhere the lowest nice value), and only when
the executor has an idle thread and no real run waits for a run slot; otherwise it is dropped at
once (RESOURCE_EXHAUSTED `shadow_dropped`), never queued. The dye only ever lowers a call's own
priority: a call that claims to be a shadow gets less, never more.

Everything here is touched on the event loop only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

log = logging.getLogger(__name__)

# Shadows running at once (each on its own idle-priority thread); one more is dropped.
SHADOW_THREADS = 1
# A bound no version reaches: what a version may take when the threads are not known.
UNBOUNDED = 1 << 30


def lowest_priority() -> None:
    """Make the calling thread the machine's last choice: SCHED_IDLE on Linux (it runs only on a
    core nothing else wants), else the highest nice value. Lowering one's own priority needs no
    privilege."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread
        return
    except (AttributeError, OSError) as exc:
        log.debug("SCHED_IDLE not available for the shadow thread: %s", exc)
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class Sharer(Protocol):
    """What a version's run bound needs to hear (runtime.instances.Instances)."""

    def share_changed(self, share: int) -> None: ...


class RunCapacity:
    """The run threads of one service, the versions that share them, and its shadows."""

    def __init__(self, threads: int = 0) -> None:
        self.threads = threads  # the executor's threads; 0: not known (no default bound)
        self._sharers: list[Sharer] = []
        self.share = UNBOUNDED  # each version's default bound: none while a version is alone
        self.waiting = 0  # real runs waiting for their version's bound, service-wide
        self.shadows = 0  # shadow runs going (on the shadow thread)
        self._shadow_executor: ThreadPoolExecutor | None = None
        self._closed = False

    def register(self, sharer: Sharer) -> None:
        """A version that runs on the executor: it takes a share of the threads from now on."""
        if sharer not in self._sharers:
            self._sharers.append(sharer)
            self._reshare()

    def unregister(self, sharer: Sharer) -> None:
        """The version retired: the others' share grows back (their waiting runs may start)."""
        if sharer in self._sharers:
            self._sharers.remove(sharer)
            self._reshare()

    @property
    def versions(self) -> int:
        return len(self._sharers)

    def _reshare(self) -> None:
        if not self.threads:
            return
        # A version alone needs no bound of its own: its runs queue for the threads in the
        # executor's own queue, with no wait of ours per run (a wait of ours is a Python future
        # and its wake-up on every run, a cost that shows under saturation).
        versions = len(self._sharers)
        share = max(1, self.threads // versions) if versions > 1 else UNBOUNDED
        if share == self.share:
            return
        self.share = share
        for sharer in list(self._sharers):
            sharer.share_changed(share)

    # -- shadows --------------------------------------------------------------------------------

    def spare(self, executor_runs: int) -> str:
        """Why a shadow may not run now ("" when it may), `executor_runs` the service's runs going
        on executor threads (ActiveRuns, shadows included): its thread is taken, the executor has
        no idle thread, or a real run waits for a run slot."""
        if self._closed:
            return "the service is shutting down"
        if self.shadows >= SHADOW_THREADS:
            return "the shadow thread is busy"
        if self.threads and executor_runs - self.shadows >= self.threads:
            return "every run thread is busy"
        if self.waiting:
            return f"{self.waiting} calls wait for a run slot"
        return ""

    @property
    def shadow_executor(self) -> ThreadPoolExecutor:
        """The shadows' thread (made on the first shadow: a service nobody mirrors to has none)."""
        if self._shadow_executor is None:
            self._shadow_executor = ThreadPoolExecutor(
                max_workers=SHADOW_THREADS, thread_name_prefix="shadow", initializer=lowest_priority
            )
        return self._shadow_executor

    def close(self) -> ThreadPoolExecutor | None:
        """No shadow runs from now on; the shadows' executor, if one was made, to shut down."""
        self._closed = True
        executor, self._shadow_executor = self._shadow_executor, None
        return executor
